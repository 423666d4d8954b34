"""One Muon update of this rank's row shards: `muon_shard_step`, the function ShardedMuon compiles.

It is a pure function of tensors apart from its collectives, so
`torch.compile(muon_shard_step, backend="laplace")` captures the whole
communication pattern in one graph, which the Muon pass
(`laplace_passes.collectives`) rewrites into two all-to-alls. Tests and
benchmarks call it directly (with `functools.partial` for the keywords).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from laplace_passes.collectives.plan import greedy_owners
from laplace_passes.ops.scaled_add import add_scaled
from model_zoo.muon.collectives import RowSplit, all_gather_rows, broadcast
from model_zoo.muon.hparams import MuonConstants, MuonHParams, StepSizes

COMM_MODES = ("all_gather", "gather_broadcast")


def newton_schulz(
    grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz``, out of place.

    Same ops in the same order (bf16, transpose when rows > cols, Frobenius
    normalisation clamped at eps, quintic iteration), so bit-identical to it.
    """
    a, b, c = ns_coefficients
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    if tall:
        x = x.T
    return x


def assign_owners(splits: tuple[RowSplit, ...], world_size: int) -> tuple[int, ...]:
    """Owner rank per matrix, balancing Newton-Schulz cost (largest first, to the least-loaded rank).

    Depends only on shapes, so every rank computes the same assignment; the
    greedy is the Muon pass's own (`laplace_passes.collectives.plan`).
    """
    cost = [sp.rows * sp.cols * min(sp.rows, sp.cols) for sp in splits]
    return tuple(greedy_owners(cost, world_size))


def muon_shard_step(
    momentum_shards: list[Tensor],
    grad_shards: list[Tensor],
    param_shards: list[Tensor],
    rank: Tensor,
    step_sizes: Tensor | None = None,
    *,
    splits: tuple[RowSplit, ...],
    hparams: tuple[MuonHParams | MuonConstants, ...],
    owners: tuple[int, ...],
    comm: str,
    world_size: int,
    group: Any,
) -> tuple[list[Tensor], list[Tensor]]:
    """One Muon update of this rank's row shards; the ``torch.compile`` target.

    Inputs, per matrix i (all ``[splits[i].shard_rows, cols]``, zero-padded,
    identical shapes on every rank): the momentum buffer shard, the averaged
    gradient shard, the parameter shard; and ``rank``, this rank as a 0-d
    int64 tensor; optionally ``step_sizes``, a float32 ``[matrices, 4]``
    tensor of each matrix's `StepSizes` (NOTE [step sizes are inputs of the
    compiled step]): then the graph reads learning rate, weight decay and
    momentum from it, and ``hparams`` may be `MuonConstants`; without it
    they are the constants of ``hparams`` (`MuonHParams`).
    Returns new momentum shards and new parameter shards;
    inputs are not modified.  Pure function of tensors apart from the
    collectives on ``group``.

    The rank is data, not a Python constant, so the captured graph is the
    same on every rank: "my rows" are picked with ``index_select(., 0,
    rank)`` on the ``[W, shard_rows, cols]`` layout of a result, and in
    ``gather_broadcast`` the owner-only Newton-Schulz is a ``torch.cond`` on
    ``rank == owner`` (under ``torch.compile``; a Python ``if`` in eager).

    ``comm="all_gather"``::

        u_i    = nesterov(lerp(momentum_i, grad_i)).bfloat16()      # local
        g      = all_gather_into_tensor(cat(flatten(u_i)))          # + wait_tensor
        o_i    = NS(unpad(g[:, slice_i]))                            # every rank, every i
        mine_i = index_select(pad_all(o_i), 0, rank)                 # own rows

    ``comm="gather_broadcast"``: same all-gather (the "gather"); for each
    owner rank o: ``o_i = cond(rank == o, NS, zeros)(unpad(g[:, slice_i]))``
    for the matrices o owns (only the owner computes), ``b =
    broadcast(cat(flatten(o_i)), src=o)`` (+ wait_tensor); every rank keeps
    its own rows of each ``o_i`` taken from ``b``.

    Then, locally: ``param_i * (1 - lr*wd) - adjusted_lr * mine_i``.
    """
    sizes = _step_sizes(hparams, step_sizes)
    new_bufs, updates = _momentum_updates(momentum_shards, grad_shards, hparams, sizes)
    if not splits:
        ortho: list[Tensor] = []
    elif comm == "all_gather":
        ortho = _orthogonalise_all_gather(updates, rank, splits, hparams, world_size, group)
    elif comm == "gather_broadcast":
        ortho = _orthogonalise_gather_broadcast(updates, rank, splits, hparams, owners, world_size, group)
    else:
        raise ValueError(f"unknown comm {comm!r}; expected one of {COMM_MODES}")
    return new_bufs, [_updated(shard, mine, size) for shard, mine, size in zip(param_shards, ortho, sizes)]


def _updated(shard: Tensor, mine: Tensor, size: StepSizes) -> Tensor:
    """torch.optim.Muon's ``param.mul_(1 - lr * wd); param.add_(update, alpha=-adjusted_lr)``, out of place."""
    p = shard.mul(size.decay)
    if isinstance(size.neg_adjusted_lr, Tensor):  # torch.add's alpha takes numbers only; add_scaled, same rounding
        return add_scaled(p, mine, size.neg_adjusted_lr)
    return p.add_(mine, alpha=size.neg_adjusted_lr)


def _step_sizes(hparams, step_sizes: Tensor | None) -> list[StepSizes]:
    """Each matrix's step sizes: from the constants of `hparams`, or read from the tensor `step_sizes`."""
    if step_sizes is None:
        return [hp.step_sizes() for hp in hparams]
    expected = (len(hparams), len(StepSizes._fields))
    if tuple(step_sizes.shape) != expected or step_sizes.dtype != torch.float32:
        raise ValueError(f"step_sizes must be a float32 tensor of shape {expected} (one row of StepSizes per "
                         f"matrix), got {step_sizes.dtype} {tuple(step_sizes.shape)}")
    if torch.compiler.is_compiling():
        return [StepSizes(*row.unbind()) for row in step_sizes]  # 0-d tensors: graph inputs, not constants
    # Eagerly, Python floats: the ops cast each back to the same float32 value, as with MuonHParams' floats.
    return [StepSizes(*row) for row in step_sizes.tolist()]


def _momentum_updates(momentum_shards, grad_shards, hparams, sizes) -> tuple[list[Tensor], list[Tensor]]:
    """New momentum shards and the (bf16) Nesterov updates to orthogonalise."""
    new_bufs: list[Tensor] = []
    updates: list[Tensor] = []
    for m, g, hp, size in zip(momentum_shards, grad_shards, hparams, sizes):
        buf = m.lerp(g, size.one_minus_momentum)
        new_bufs.append(buf)
        upd = g.lerp(buf, size.momentum) if hp.nesterov else buf
        # Newton-Schulz casts to bf16 first; casting the shards before the
        # gather is elementwise-identical and halves the bytes sent.
        updates.append(upd.bfloat16())
    return new_bufs, updates


def _ns(x: Tensor, hp: MuonHParams | MuonConstants) -> Tensor:
    return newton_schulz(x, hp.ns_coefficients, hp.ns_steps, hp.eps)


def _orthogonalise_all_gather(updates, rank, splits, hparams, world_size, group) -> list[Tensor]:
    full = all_gather_rows(updates, list(splits), world_size, group)
    return [sp.own_rows(_ns(f, hp), rank) for f, sp, hp in zip(full, splits, hparams)]


def _owner_only_ns(full: Tensor, hp: MuonHParams | MuonConstants, rank: Tensor, owner: int) -> Tensor:
    """NS(full) on the owner rank, zeros elsewhere (the value other ranks send is ignored)."""
    if torch.compiler.is_compiling():
        # A Python branch on the rank would specialise the graph per rank.
        # Both branches must return one layout, row-major with the canonical strides: NS of a tall
        # matrix is a transposed view, and `.contiguous()` keeps it as is when a dimension is 1
        # ([n, 1] with strides (1, n)), which torch.cond rejects beside zeros of strides (1, 1).
        return torch.cond(rank == owner, lambda x: _row_major(_ns(x, hp)), _row_major_zeros, (full,))
    return _ns(full, hp) if int(rank) == owner else torch.zeros_like(full)


def _row_major(x: Tensor) -> Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def _row_major_zeros(x: Tensor) -> Tensor:
    return torch.zeros_like(x, memory_format=torch.contiguous_format)


def _orthogonalise_gather_broadcast(updates, rank, splits, hparams, owners, world_size, group) -> list[Tensor]:
    full = all_gather_rows(updates, list(splits), world_size, group)
    ortho: list[Tensor] = [None] * len(splits)  # type: ignore[list-item]
    for owner in range(world_size):
        mine = [i for i in range(len(splits)) if owners[i] == owner]
        if not mine:
            continue
        results = [_owner_only_ns(full[i], hparams[i], rank, owner) for i in mine]
        packed = broadcast(torch.cat([r.reshape(-1) for r in results]), owner, world_size, group)
        pos = 0
        for i in mine:
            sp = splits[i]
            o = packed[pos : pos + sp.rows * sp.cols].view(sp.rows, sp.cols)
            pos += sp.rows * sp.cols
            ortho[i] = sp.own_rows(o, rank)
    return ortho
