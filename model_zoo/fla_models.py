"""flash-linear-attention's own GLA language model (`fla.models.GLAForCausalLM`), by name.

    model = model_zoo.build("fla-gla-tiny")      # CPU, initialised by fla, fla's default flags
    model = model_zoo.build("fla-gla-1.3b")      # meta device: the shape of fla-hub's GLA 1.3B

These are fla's classes with fla's default config flags (fuse_norm,
fuse_swiglu, fuse_cross_entropy, attn_mode "chunk"), the models users load
from the hub; they run on this machine only under the laplace backend, which
replaces every Triton kernel they call (`laplace_passes.fla`). They need the
`flash-linear-attention` package (in the `test` extra); building one without
it is an ImportError that says what to install.
"""

from __future__ import annotations

import torch

FLA_CONFIGS: dict[str, dict] = {
    # Small enough to train on MQAR in seconds: vocab 128, d 64, 2 layers, 2 heads.
    "fla-gla-tiny": {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2},
    # fla's GLAConfig defaults are the 1.3B shape: d 2048, 24 layers, 4 heads, expand_k 0.5.
    "fla-gla-1.3b": {"vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 24, "num_heads": 4},
}
FLA_DEFAULT_DEVICE = {"fla-gla-1.3b": "meta"}


def build_fla(name: str, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
              **overrides):
    """fla's GLAForCausalLM for the named config, `overrides` applied to its GLAConfig."""
    try:
        from fla.models import GLAConfig, GLAForCausalLM
    except ImportError as error:
        raise ImportError(f"model {name!r} is flash-linear-attention's GLAForCausalLM: install the "
                          "'flash-linear-attention' package (it is in this project's 'test' extra)") from error
    config = GLAConfig(**{**FLA_CONFIGS[name], **overrides})
    device = device if device is not None else FLA_DEFAULT_DEVICE.get(name, torch.get_default_device())
    with torch.device(device):
        model = GLAForCausalLM(config)
    return model.to(dtype) if dtype is not None else model
