"""flash-linear-attention models without Triton: fla's kernels as standard PyTorch ops.

An fla model (`fla.models.GLAForCausalLM`, `fla.layers.GatedLinearAttention`)
calls Triton kernels for its GLA operator, norms, activations, short
convolution and losses. Under `torch.compile(backend="laplace")` every one of
them that the GLA model can reach is replaced by PyTorch ops (see
NOTE [how fla calls are replaced] in `laplace_passes.fla.install`):

    GLA            chunk_gla, fused_recurrent_gla, naive_recurrent_gla -> one laplace::gla site
                   (state_v_first either way, initial/final states, scale, cu_seqlens)
    norms          rms_norm, layer_norm, group_norm (+ residual / prenorm forms),
                   rms_norm_gated, layer_norm_gated                     (norms.py)
    activations    swish, sigmoid, logsigmoid, swiglu kernels, swiglu_linear, powglu(_linear)
    convolution    causal_conv1d (+ cache, cu_seqlens), causal_conv1d_update (decode step)
    losses         cross_entropy_loss, FusedCrossEntropyLoss, fused_linear_cross_entropy_loss,
                   FusedLinearCrossEntropyLoss

What is not replaced is reported, never silent (`not_replaced`). The design:
docs/DESIGN.md section 3.7.
"""

from laplace_passes.fla.install import covered_before_install, install, not_installed, replaced
from laplace_passes.fla.not_replaced import FlaCallNotReplaced

__all__ = ["FlaCallNotReplaced", "covered_before_install", "install", "not_installed", "replaced"]
