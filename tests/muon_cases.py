"""Shared helpers for ShardedMuon tests: per-rank gradients, and stepping it beside the torch reference."""

from __future__ import annotations

import torch


def rank_grads(step: int, world_size: int, shapes) -> list[torch.Tensor]:
    """Per-rank gradients of one step, [W, *shape] each: multiples of 1/32 in [-2, 2), so every sum is exact."""
    out = []
    for i, shape in enumerate(shapes):
        gen = torch.Generator().manual_seed(1000 * step + i)
        out.append(torch.randint(-64, 64, (world_size, *shape), generator=gen).float() / 32)
    return out


def compare_params(tag: str, mine, ref, failures: list[str]) -> None:
    """Bit-identical or a failure line naming the parameter and the largest difference."""
    for i, (x, y) in enumerate(zip(mine, ref)):
        if not torch.equal(x, y):
            failures.append(f"{tag}: param {i} {tuple(x.shape)} differs, max abs diff {(x - y).abs().max().item():.3e}")


def step_beside_reference(opt, refs, params, ref_params, rank: int, world_size: int, steps: int, tag: str,
                          failures: list[str], after_step=None) -> None:
    """`steps` steps of `opt` (this rank's gradient) and of the reference optimizers `refs` (the rank average);
    `after_step()`, if given, after each (a learning-rate schedule's step, say)."""
    shapes = [p.shape for p in params]
    for step in range(steps):
        for p, r, g in zip(params, ref_params, rank_grads(step, world_size, shapes)):
            p.grad = g[rank].clone()
            r.grad = g.sum(0) / world_size
        opt.step()
        for reference in refs:
            reference.step()
        compare_params(f"{tag} step {step}", params, ref_params, failures)
        if after_step is not None:
            after_step()


def step_with_same_grads(opt, params, refs, ref_params, steps: int) -> None:
    """`steps` single-process steps: each parameter and its reference copy get the same random gradient."""
    for _ in range(steps):
        for p, r in zip(params, ref_params):
            p.grad = torch.randn(p.shape)
            r.grad = p.grad.clone()
        opt.step()
        for reference in refs:
            reference.step()
