"""Shared GLA inputs and the error measure fla's own tests use."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def relative_rmse(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """fla's criterion: RMSE of the difference over RMS of the reference."""
    diff = (actual.double() - expected.double()).pow(2).mean().sqrt()
    base = expected.double().pow(2).mean().sqrt()
    return (diff / base.clamp_min(1e-30)).item()


def make_inputs(B, T, H, K, V, *, gate_divisor=1.0, dtype=torch.float32, initial_state=True, seed=0):
    """fla-style stress inputs: gates logsigmoid(rand) / n (n = 0.1 is a strong decay)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen).to(dtype)
    k = torch.randn(B, T, H, K, generator=gen).to(dtype)
    v = torch.randn(B, T, H, V, generator=gen).to(dtype)
    gk = (F.logsigmoid(torch.rand(B, T, H, K, generator=gen)) / gate_divisor).to(dtype)
    h0 = torch.randn(B, H, K, V, generator=gen) if initial_state else None
    return q, k, v, gk, h0


def output_cotangents(B, T, H, K, V, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
