"""Argument checks shared by every GLA entry point.

Shapes and dtypes are checked in Python, before anything is traced, so the
error names the argument. Gate *values* are data: they are checked by the
`laplace::check_gates` op (see `laplace_passes.ops.gla`), which also runs inside
compiled graphs.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name: str, value: object, ndim: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {value.dtype}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    return value


def check_gla_args(q, k, v, gk, initial_state, scale) -> None:
    """Validate GLA inputs in fla's layout: q, k, gk [B,T,H,K]; v [B,T,H,V]; state [B,H,K,V]."""
    for name, value in (("q", q), ("k", k), ("v", v), ("gk", gk)):
        check_tensor(name, value, 4)
    B, T, H, K = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have the shape of q {tuple(q.shape)} [B,T,H,K], got {tuple(k.shape)}")
    if tuple(gk.shape) != tuple(q.shape):
        raise ValueError(f"gk must have the shape of q {tuple(q.shape)} [B,T,H,K], got {tuple(gk.shape)}")
    if tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must have shape [B,T,H,V] = [{B},{T},{H},V] to match q, got {tuple(v.shape)}")
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) != 1:
        raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    devices = {t.device for t in (q, k, v, gk)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v and gk must be on one device, got {sorted(map(str, devices))}")
    if initial_state is not None:
        check_tensor("initial_state", initial_state, 4)
        expected = (B, H, K, v.shape[-1])
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must have shape [B,H,K,V] = {list(expected)}, got {tuple(initial_state.shape)}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state must be on q's device {q.device}, got {initial_state.device}")
    _check_scale(scale)


def _check_scale(scale: object) -> None:
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")


def check_flag(name: str, value: object) -> bool:
    """A bool argument: a string such as "no" would otherwise count as True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_chunk_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """fla's default: 1 / sqrt(K).

    K = 0 is an empty sum: every score and output is 0 whatever the scale, as
    the reference computes it with an explicit scale; 1 stands in for 1 / sqrt(0).
    """
    if scale is not None:
        return float(scale)
    return float(head_dim) ** -0.5 if head_dim else 1.0
