"""Where fla's GLA calls become `laplace::gla` sites: now `laplace_passes.fla`.

The substitutions that turn `chunk_gla`, `fused_recurrent_gla` and
`naive_recurrent_gla` into sites are installed together with the
replacements of fla's other Triton kernels (norms, activations, convolution,
losses) by `laplace_passes.fla.install`; this module keeps the names the
backend and the public `laplace_passes.fx.enable_fla_sites` use.
"""

from laplace_passes.fla.install import covered_before_install, install

__all__ = ["covered_before_install", "install"]
