"""Named GLA language models to test and benchmark `laplace_passes` on.

    model = model_zoo.build("tiny")                      # CPU, initialised, seconds to train
    model = model_zoo.build("laplace-3b")                # meta device: shapes only
    model = model_zoo.build("small", device="cuda", num_layers=2)

- tiny:       associative-recall toy (vocab 128, d 64, 2 layers, 2 heads).
- small:      vocab 8192, d 256, 4 layers, 4 heads.
- laplace-3b: d 2560, 36 layers, 16 heads, vocab 32000: about 2.9B parameters,
              29.5 MB of recurrent state per sequence. Built on meta by default
              because materialising it takes about 12 GB in fp32.
- plain-tiny: tiny with its recurrence written in plain PyTorch (a scan over tokens,
              `model_zoo.plain_gla`): no call to this project, found by what it computes.
- fla-gla-tiny, fla-gla-1.3b: flash-linear-attention's own GLAForCausalLM
              (see `model_zoo.fla_models`; needs flash-linear-attention).
"""

from __future__ import annotations

import torch

from model_zoo.fla_models import FLA_CONFIGS, build_fla
from model_zoo.gla_lm import GatedLinearAttention, GLABlock, GLAConfig, GLALM
from model_zoo.plain_gla import PlainGLALM

_CONFIGS: dict[str, GLAConfig] = {
    "tiny": GLAConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=2),
    "small": GLAConfig(vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4),
    "laplace-3b": GLAConfig(vocab_size=32000, hidden_size=2560, num_layers=36, num_heads=16),
    "plain-tiny": GLAConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=2),
}
_PLAIN = {"plain-tiny"}  # built as PlainGLALM: the recurrence in plain PyTorch
_DEFAULT_DEVICE = {"laplace-3b": "meta"}

CONFIG_NAMES: tuple[str, ...] = (*_CONFIGS, *FLA_CONFIGS)


def config(name: str, **overrides) -> GLAConfig:
    """The named config with `overrides` applied (unknown names or fields raise); not for fla models."""
    if name in FLA_CONFIGS:
        raise ValueError(f"{name!r} is fla's GLAForCausalLM, configured by fla's GLAConfig: "
                         "model_zoo.build(name).config holds it")
    if name not in _CONFIGS:
        raise ValueError(f"unknown model config {name!r}; available: {', '.join(CONFIG_NAMES)}")
    return _CONFIGS[name].replace(**overrides)


def build(
    name: str,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **overrides,
) -> torch.nn.Module:
    """Build the named model; `device` defaults to "meta" for laplace-3b and fla-gla-1.3b."""
    if name in FLA_CONFIGS:
        return build_fla(name, device=device, dtype=dtype, **overrides)
    cfg = config(name, **overrides)
    model_class = PlainGLALM if name in _PLAIN else GLALM
    return model_class(cfg, device=device if device is not None else _DEFAULT_DEVICE.get(name), dtype=dtype)


__all__ = ["CONFIG_NAMES", "GLABlock", "GLAConfig", "GLALM", "GatedLinearAttention", "PlainGLALM", "build", "config"]
