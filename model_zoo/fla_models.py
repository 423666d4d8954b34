"""flash-linear-attention's own GLA-family language models (`fla.models`), by name.

    model = model_zoo.build("fla-gla-tiny")      # CPU, initialised by fla, fla's default flags
    model = model_zoo.build("fla-gla-1.3b")      # meta device: the shape of fla-hub's GLA 1.3B
    model = model_zoo.build("fla-retnet-tiny")   # RetNet; likewise fla-hgrn2-, fla-rwkv6-, fla-gsa-, fla-lightnet-tiny

These are fla's classes with fla's default config flags (fuse_norm,
fuse_swiglu, fuse_cross_entropy, attn_mode "chunk"), the models users load
from the hub; they run on this machine only under the laplace backend, which
replaces every Triton kernel they call (`laplace_passes.fla`). They need the
`flash-linear-attention` package (in the `test` extra); building one without
it is an ImportError that says what to install.
"""

from __future__ import annotations

import torch

from model_zoo.inputs import check_fla_token_ids

TINY = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2}

# name -> (fla's model family, its config's fields). Every tiny model is small enough to train on MQAR in
# seconds: vocab 128, d 64, 2 layers, 2 heads.
FLA_CONFIGS: dict[str, tuple[str, dict]] = {
    "fla-gla-tiny": ("GLA", TINY),
    # fla's GLAConfig defaults are the 1.3B shape: d 2048, 24 layers, 4 heads, expand_k 0.5.
    "fla-gla-1.3b": ("GLA", {"vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 24, "num_heads": 4}),
    # HGRN2's default expand_ratio 128 leaves d 64 no head: None takes its key width from the heads.
    "fla-hgrn2-tiny": ("HGRN2", {**TINY, "expand_ratio": None}),
    "fla-retnet-tiny": ("RetNet", TINY),
    "fla-rwkv6-tiny": ("RWKV6", {**TINY, "proj_low_rank_dim": 8, "gate_low_rank_dim": 16, "intermediate_size": 128}),
    "fla-gsa-tiny": ("GSA", {**TINY, "num_slots": 16}),
    "fla-lightnet-tiny": ("LightNet", {**TINY, "expand_ratio": None}),
}
FLA_DEFAULT_DEVICE = {"fla-gla-1.3b": "meta"}


def build_fla(name: str, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
              **overrides):
    """fla's `<Family>ForCausalLM` for the named config, `overrides` applied to its `<Family>Config`."""
    family, fields = FLA_CONFIGS[name]
    try:
        import fla.models as models
    except ImportError as error:
        raise ImportError(f"model {name!r} is flash-linear-attention's {family}ForCausalLM: install the "
                          "'flash-linear-attention' package (it is in this project's 'test' extra)") from error
    config = getattr(models, f"{family}Config")(**{**fields, **overrides})
    device = device if device is not None else FLA_DEFAULT_DEVICE.get(name, torch.get_default_device())
    with torch.device(device):
        model = getattr(models, f"{family}ForCausalLM")(config)
    model.register_forward_pre_hook(check_fla_token_ids, with_kwargs=True)  # fla's own error is an unpack deep inside
    return model.to(dtype) if dtype is not None else model
