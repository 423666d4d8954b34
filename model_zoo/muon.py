"""Data-parallel (ZeRO-1) sharded Muon, written the way users write it.

``ShardedMuon`` is a drop-in for :class:`torch.optim.Muon` in data-parallel
training over W ranks (see DESIGN.md section 5)::

    opt = ShardedMuon(model.parameters(), lr=0.02, comm="all_gather")
    loss.backward()          # each rank: its local gradient
    opt.step()               # all ranks: identical updated parameters

Parameters are replicated on every rank, each rank's ``.grad`` is local.
One ``step()``:

1. 2D ("Muon") parameters: the gradients are reduce-scattered and averaged,
   so each rank holds the average gradient for its *row shard* of every
   matrix.  Rows are split as evenly as possible (the first ``rows % W``
   ranks get one more row); every shard is zero-padded to
   ``ceil(rows / W)`` rows so all collectives see equal sizes and every rank
   holds tensors of identical shapes.  Momentum lives only for the own shard.
2. ``_muon_shard_step`` (the compile target, see below) updates the momentum
   shard, orthogonalises with Newton-Schulz, which needs whole matrices, and
   returns new momentum and parameter shards.  Two ways to get whole
   matrices (``comm=``):

   * ``"all_gather"``: every rank all-gathers every (bf16) momentum-updated
     matrix, runs Newton-Schulz on all of them redundantly and keeps its own
     rows of each result.  Collectives: one ``all_gather_into_tensor``.
   * ``"gather_broadcast"``: each matrix has an owner rank (greedy balance
     by Newton-Schulz cost).  The matrices are gathered (expressed as one
     ``all_gather_into_tensor``, there is no functional gather), only the
     owner orthogonalises a matrix, and each owner ``broadcast``s its results
     to everyone, who keep their own rows.  Collectives: one
     ``all_gather_into_tensor`` + one ``broadcast`` per owner rank.

3. The new parameter shards are all-gathered so every rank has the full,
   identical parameters.
4. Non-2D parameters (and any group with ``use_muon=False``) use AdamW
   (``torch.optim.AdamW`` semantics, via ``torch.optim.adamw.adamw``): the
   gradients are all-reduced and averaged, and every rank updates them
   identically.

All collectives are functional collectives: the ``_c10d_functional.*`` ops
that ``torch.distributed._functional_collectives`` issues, each followed by
``_c10d_functional.wait_tensor``, i.e. exactly the nodes a ``torch.compile``
FX graph holds.  The Newton-Schulz communication lives entirely in
``_muon_shard_step``, a pure function of tensors.  With ``backend=None`` it runs eagerly; with any other
``backend`` it is run through ``torch.compile(_muon_shard_step,
backend=backend, dynamic=False)``; ``backend="laplace"`` rewrites its
gathers into two ``all_to_all_single`` with one owner per matrix
(``laplace_passes.collectives``; bit-identical results).

Numerics: Newton-Schulz always runs on the *same full matrix* (same shape,
same bf16 values) as ``torch.optim.Muon`` would, and every other operation is
elementwise on row shards, so with the same averaged gradient the result is
bit-identical to ``torch.optim.Muon`` (+ ``torch.optim.AdamW``) on the full
parameters.  The gradient average is a sum over ranks divided by W; its
summation order is the collective's, so for arbitrary float gradients it
matches a reference average only up to fp32 rounding.

Failure handling: everything a step computes goes into temporaries; the
parameters and optimizer state are written only after the step's last
collective has completed.  Any exception during the step (a local error, a
peer that closed its connection, or a collective that ran past the process
group timeout because a peer hung) is raised as :class:`ShardedMuonStepError`
on that rank, with parameters and state unchanged.  A failing rank never
reaches the final all-gather, so every other rank fails in a collective and
raises too.  (Whatever happens after the last collective is local copying.)

Requirements: every rank calls ``step()`` the same number of times with the
same set of parameters having a ``.grad`` (``None`` grads are skipped, as in
``torch.optim.Muon``; ranks must agree on which).  The optimizer state of a
Muon parameter is this rank's padded momentum shard, so ``state_dict()`` is
per rank and reloads into the same rank of the same world size (at W=1 it is
the same as ``torch.optim.Muon``'s).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, _get_scalar_dtype

__all__ = [
    "COMM_MODES",
    "MuonHParams",
    "RowSplit",
    "ShardedMuon",
    "ShardedMuonStepError",
    "assign_owners",
    "newton_schulz",
]

COMM_MODES = ("all_gather", "gather_broadcast")

# torch.optim.Muon's defaults (torch/optim/_muon.py).
EPS = 1e-7
DEFAULT_A = 3.4445
DEFAULT_B = -4.7750
DEFAULT_C = 2.0315
DEFAULT_NS_STEPS = 5

# torch.optim.AdamW's defaults, used for non-2D parameters.
_ADAMW_DEFAULTS = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 1e-2,
    "amsgrad": False,
}


class ShardedMuonStepError(RuntimeError):
    """``ShardedMuon.step()`` failed on this rank; nothing was modified."""


# --------------------------------------------------------------------------
# Pure tensor math (shared by every path)
# --------------------------------------------------------------------------


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


def _adjust_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning-rate adjustment for a (rows, cols) matrix."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


@dataclass(frozen=True)
class RowSplit:
    """How the rows of one ``rows x cols`` matrix are split over W ranks.

    Rank r owns ``size(r)`` consecutive rows starting at ``offset(r)``; the
    first ``rows % W`` ranks own one row more.  Every shard is padded with
    zero rows to ``shard_rows = ceil(rows / W)``.
    """

    rows: int
    cols: int
    world_size: int

    @property
    def base(self) -> int:
        return self.rows // self.world_size

    @property
    def extra(self) -> int:
        return self.rows % self.world_size

    @property
    def shard_rows(self) -> int:
        return self.base + (1 if self.extra else 0)

    @property
    def shard_numel(self) -> int:
        return self.shard_rows * self.cols

    def size(self, rank: int) -> int:
        return self.base + (1 if rank < self.extra else 0)

    def offset(self, rank: int) -> int:
        return rank * self.base + min(rank, self.extra)

    def pad_all(self, full: Tensor) -> Tensor:
        """``[rows, cols]`` -> ``[W, shard_rows, cols]``, rank r's rows at ``[r, :size(r)]``."""
        W, s, q, e = self.world_size, self.shard_rows, self.base, self.extra
        if e == 0:
            return full.reshape(W, s, self.cols)
        out = full.new_zeros(W, s, self.cols)
        out[:e] = full[: e * s].reshape(e, s, self.cols)
        if q:
            out[e:, :q] = full[e * s :].reshape(W - e, q, self.cols)
        return out

    def unpad_all(self, padded: Tensor) -> Tensor:
        """Inverse of :meth:`pad_all`: ``[W, shard_rows, cols]`` -> ``[rows, cols]``."""
        W, s, q, e = self.world_size, self.shard_rows, self.base, self.extra
        padded = padded.reshape(W, s, self.cols)
        if e == 0:
            return padded.reshape(self.rows, self.cols)
        head = padded[:e].reshape(e * s, self.cols)
        tail = padded[e:, :q].reshape((W - e) * q, self.cols)
        return torch.cat([head, tail])

    def own(self, full: Tensor, rank: int) -> Tensor:
        """Rank's rows of ``full`` padded to ``[shard_rows, cols]`` (a view when no padding is needed)."""
        lo, n, s = self.offset(rank), self.size(rank), self.shard_rows
        mine = full[lo : lo + n]
        if n == s:
            return mine
        return torch.cat([mine, mine.new_zeros(s - n, self.cols)])


@dataclass(frozen=True)
class MuonHParams:
    """Hyper-parameters of one Muon matrix (from its param group)."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_coefficients: tuple[float, float, float]
    ns_steps: int
    eps: float
    adjusted_lr: float


# Collectives.  These are the functional collectives exactly as
# torch.distributed._functional_collectives issues them (all_gather_single,
# broadcast, reduce_scatter_single, all_reduce call these ops), minus its eager
# AsyncCollectiveTensor wrapper: the ``_c10d_functional.*`` op followed by
# ``_c10d_functional.wait_tensor``, which is also what appears in the FX graph
# under torch.compile.  (The wrapper imports torch._dynamo on first eager use,
# seconds per process, which multi-process CPU tests cannot afford.)
# ``group`` is the process group's name; ranks are ranks within the group.


def _c10d_functional():
    return torch.ops._c10d_functional


def _all_gather(flat: Tensor, world_size: int, group: str | None) -> Tensor:
    """all_gather_into_tensor of a 1D tensor -> ``[world_size, numel]``."""
    if world_size == 1:
        return flat.unsqueeze(0)
    ops = _c10d_functional()
    out = ops.wait_tensor(ops.all_gather_into_tensor(flat, world_size, group))
    return out.view(world_size, -1)


def _broadcast(t: Tensor, src: int, world_size: int, group: str | None) -> Tensor:
    if world_size == 1:
        return t
    ops = _c10d_functional()
    return ops.wait_tensor(ops.broadcast(t, src, group))


def _reduce_scatter_sum(flat: Tensor, world_size: int, group: str | None) -> Tensor:
    ops = _c10d_functional()
    return ops.wait_tensor(ops.reduce_scatter_tensor(flat, "sum", world_size, group))


def _all_reduce_sum(flat: Tensor, group: str | None) -> Tensor:
    ops = _c10d_functional()
    return ops.wait_tensor(ops.all_reduce(flat, "sum", group))


def assign_owners(splits: tuple[RowSplit, ...], world_size: int) -> tuple[int, ...]:
    """Owner rank per matrix, balancing Newton-Schulz cost (greedy, largest first).

    Depends only on shapes, so every rank computes the same assignment.
    """
    loads = [0] * world_size
    owners = [0] * len(splits)
    cost = [sp.rows * sp.cols * min(sp.rows, sp.cols) for sp in splits]
    for i in sorted(range(len(splits)), key=lambda i: (-cost[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += cost[i]
    return tuple(owners)


def _muon_shard_step(
    momentum_shards: list[Tensor],
    grad_shards: list[Tensor],
    param_shards: list[Tensor],
    rank: Tensor,
    *,
    splits: tuple[RowSplit, ...],
    hparams: tuple[MuonHParams, ...],
    owners: tuple[int, ...],
    comm: str,
    world_size: int,
    group: Any,
) -> tuple[list[Tensor], list[Tensor]]:
    """One Muon update of this rank's row shards; the ``torch.compile`` target.

    Inputs, per matrix i (all ``[splits[i].shard_rows, cols]``, zero-padded,
    identical shapes on every rank): the momentum buffer shard, the averaged
    gradient shard, the parameter shard; and ``rank``, this rank as a 0-d
    int64 tensor.  Returns new momentum shards and new parameter shards;
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
    new_bufs, updates = _momentum_updates(momentum_shards, grad_shards, hparams)
    if not splits:
        ortho: list[Tensor] = []
    elif comm == "all_gather":
        ortho = _orthogonalise_all_gather(updates, rank, splits, hparams, world_size, group)
    elif comm == "gather_broadcast":
        ortho = _orthogonalise_gather_broadcast(updates, rank, splits, hparams, owners, world_size, group)
    else:
        raise ValueError(f"unknown comm {comm!r}; expected one of {COMM_MODES}")
    new_params: list[Tensor] = []
    for shard, mine, hp in zip(param_shards, ortho, hparams):
        p = shard.mul(1 - hp.lr * hp.weight_decay)
        p.add_(mine, alpha=-hp.adjusted_lr)
        new_params.append(p)
    return new_bufs, new_params


def _momentum_updates(momentum_shards, grad_shards, hparams) -> tuple[list[Tensor], list[Tensor]]:
    """New momentum shards and the (bf16) Nesterov updates to orthogonalise."""
    new_bufs: list[Tensor] = []
    updates: list[Tensor] = []
    for m, g, hp in zip(momentum_shards, grad_shards, hparams):
        buf = m.lerp(g, 1 - hp.momentum)
        new_bufs.append(buf)
        upd = g.lerp(buf, hp.momentum) if hp.nesterov else buf
        # Newton-Schulz casts to bf16 first; casting the shards before the
        # gather is elementwise-identical and halves the bytes sent.
        updates.append(upd.bfloat16())
    return new_bufs, updates


def _gather_full_matrices(updates, splits, world_size, group) -> list[Tensor]:
    """Every rank's shards all-gathered and reassembled into full ``[rows, cols]`` matrices."""
    gathered = _all_gather(torch.cat([u.reshape(-1) for u in updates]), world_size, group)
    full, pos = [], 0
    for sp in splits:
        full.append(sp.unpad_all(gathered[:, pos : pos + sp.shard_numel]))
        pos += sp.shard_numel
    return full


def _own_rows(full: Tensor, split: RowSplit, rank: Tensor) -> Tensor:
    """This rank's padded row shard of ``full``, selected by the rank tensor."""
    return split.pad_all(full).index_select(0, rank.view(1)).squeeze(0)


def _ns(x: Tensor, hp: MuonHParams) -> Tensor:
    return newton_schulz(x, hp.ns_coefficients, hp.ns_steps, hp.eps)


def _orthogonalise_all_gather(updates, rank, splits, hparams, world_size, group) -> list[Tensor]:
    full = _gather_full_matrices(updates, splits, world_size, group)
    return [_own_rows(_ns(f, hp), sp, rank) for f, sp, hp in zip(full, splits, hparams)]


def _owner_only_ns(full: Tensor, hp: MuonHParams, rank: Tensor, owner: int) -> Tensor:
    """NS(full) on the owner rank, zeros elsewhere (the value other ranks send is ignored)."""
    if torch.compiler.is_compiling():
        # A Python branch on the rank would specialise the graph per rank.
        # Both branches must agree on strides: NS of a tall matrix is a transposed view.
        return torch.cond(rank == owner, lambda x: _ns(x, hp).contiguous(), torch.zeros_like, (full,))
    return _ns(full, hp) if int(rank) == owner else torch.zeros_like(full)


def _orthogonalise_gather_broadcast(updates, rank, splits, hparams, owners, world_size, group) -> list[Tensor]:
    full = _gather_full_matrices(updates, splits, world_size, group)
    ortho: list[Tensor] = [None] * len(splits)  # type: ignore[list-item]
    for owner in range(world_size):
        mine = [i for i in range(len(splits)) if owners[i] == owner]
        if not mine:
            continue
        results = [_owner_only_ns(full[i], hparams[i], rank, owner) for i in mine]
        packed = _broadcast(torch.cat([r.reshape(-1) for r in results]), owner, world_size, group)
        pos = 0
        for i in mine:
            sp = splits[i]
            o = packed[pos : pos + sp.rows * sp.cols].view(sp.rows, sp.cols)
            pos += sp.rows * sp.cols
            ortho[i] = _own_rows(o, sp, rank)
    return ortho


# --------------------------------------------------------------------------
# Bucketed ZeRO-1 plumbing around the compile target
# --------------------------------------------------------------------------


def _by_dtype(tensors: list[Tensor]) -> dict[torch.dtype, list[int]]:
    out: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.dtype, []).append(i)
    return out


def _reduce_scatter_mean(
    grads: list[Tensor], splits: list[RowSplit], world_size: int, group
) -> list[Tensor]:
    """Average of ``grads`` over ranks, this rank's padded row shard of each.

    One reduce-scatter per dtype over a bucket laid out ``[W, sum shard_numel]``.
    """
    if world_size == 1:
        return list(grads)
    out: list[Tensor] = [None] * len(grads)  # type: ignore[list-item]
    for _, idx in _by_dtype(grads).items():
        bucket = torch.cat(
            [splits[i].pad_all(grads[i]).reshape(world_size, -1) for i in idx], dim=1
        ).reshape(-1)
        # gloo has no "avg": sum, then divide.
        shard = _reduce_scatter_sum(bucket, world_size, group).div_(world_size)
        pos = 0
        for i in idx:
            sp = splits[i]
            out[i] = shard[pos : pos + sp.shard_numel].view(sp.shard_rows, sp.cols)
            pos += sp.shard_numel
    return out


def _all_gather_rows(
    shards: list[Tensor], splits: list[RowSplit], world_size: int, group
) -> list[Tensor]:
    """Full ``[rows, cols]`` matrices from every rank's padded row shard."""
    if world_size == 1:
        return list(shards)
    out: list[Tensor] = [None] * len(shards)  # type: ignore[list-item]
    for _, idx in _by_dtype(shards).items():
        flat = torch.cat([shards[i].reshape(-1) for i in idx])
        gathered = _all_gather(flat, world_size, group)
        pos = 0
        for i in idx:
            sp = splits[i]
            out[i] = sp.unpad_all(gathered[:, pos : pos + sp.shard_numel])
            pos += sp.shard_numel
    return out


def _all_reduce_mean(grads: list[Tensor], world_size: int, group) -> list[Tensor]:
    if world_size == 1 or not grads:
        return list(grads)
    out: list[Tensor] = [None] * len(grads)  # type: ignore[list-item]
    for _, idx in _by_dtype(grads).items():
        flat = torch.cat([grads[i].reshape(-1) for i in idx])
        red = _all_reduce_sum(flat, group).div_(world_size)
        pos = 0
        for i in idx:
            g = grads[i]
            out[i] = red[pos : pos + g.numel()].view_as(g)
            pos += g.numel()
    return out


# --------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------


def _check_muon_hparams(
    lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn
) -> None:
    # torch.optim.Muon's checks ...
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= momentum:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn is not None and adjust_lr_fn not in ["original", "match_rms_adamw"]:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
    # ... and the ones it only makes inside the step (here: before any
    # communication, so a bad value cannot fail one rank mid-step).
    if not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(f"ns_steps must be an int in [0, 100), got {ns_steps!r}")
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(f"ns_coefficients must be 3 values (a, b, c), got {ns_coefficients!r}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")


def _check_adamw_hparams(lr, betas, eps, weight_decay, amsgrad) -> None:
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("AdamW: Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"AdamW: invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"AdamW: invalid epsilon value: {eps}")
    if len(tuple(betas)) != 2:
        raise ValueError(f"AdamW: betas must be a pair, got {betas!r}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"AdamW: invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"AdamW: invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"AdamW: invalid weight_decay value: {weight_decay}")
    if not isinstance(amsgrad, bool):
        raise ValueError(f"AdamW: amsgrad must be a bool, got {amsgrad!r}")


_MUON_KEYS = (
    "lr",
    "weight_decay",
    "momentum",
    "nesterov",
    "ns_coefficients",
    "eps",
    "ns_steps",
    "adjust_lr_fn",
)


class ShardedMuon(Optimizer):
    """ZeRO-1 data-parallel Muon (+ AdamW for non-2D parameters).

    Args:
        params: parameters or param groups, as for any torch optimizer.  A
            group may set ``use_muon``: ``None`` (default) = Muon for 2D
            parameters, AdamW otherwise; ``True`` = Muon only (a non-2D
            parameter is an error); ``False`` = AdamW for all (e.g.
            embeddings).  Groups may override ``adamw_lr``, ``adamw_betas``,
            ``adamw_eps``, ``adamw_weight_decay``, ``adamw_amsgrad``.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps,
        ns_steps, adjust_lr_fn: exactly ``torch.optim.Muon``'s, same defaults.
        comm: ``"all_gather"`` or ``"gather_broadcast"`` (module docstring).
        process_group: the data-parallel group; ``None`` = the default group
            if ``torch.distributed`` is initialised, else a single process.
        backend: ``"laplace"`` (default) compiles the shard step with the
            laplace backend (default options: target trn2, whose all-to-all
            takes groups of 4, 8, 16 or multiples of 32 ranks; other world
            sizes keep their gathers, with the reason in the report); a
            configured laplace backend, e.g. ``functools.partial(
            laplace_passes.backend.laplace_backend, options={"target": "cpu"})``;
            any other ``torch.compile`` backend; ``None`` runs it eagerly.
        adamw_kwargs: ``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``amsgrad`` for the AdamW parameters (``torch.optim.AdamW``'s
            defaults otherwise).

    ``step()`` raises :class:`ShardedMuonStepError` (parameters and state
    untouched) if anything fails on this rank or a peer.  For tests,
    ``opt._fault_hook = fn`` is called as ``fn(phase)`` with ``"reduce"``
    (before any collective of the step), ``"shard_step"`` (gradients
    averaged, before the Newton-Schulz collectives) and
    ``"all_gather_params"`` (before the last collective); raising from it
    simulates a rank failing there.

    Compile notes: ``_muon_shard_step`` receives the rank as a tensor, so its
    graph is the same on every rank (own rows picked by ``index_select``,
    the owner-only Newton-Schulz of ``gather_broadcast`` in a ``torch.cond``),
    and ``backend="laplace"`` rewrites its gathers into two all-to-alls
    (``laplace_passes.collectives``). The layouts, owners and
    hyper-parameters are Python constants: a changed learning rate is a new
    graph (a recompile; Dynamo stops compiling after its recompile limit).
    Shapes are compiled static (``dynamic=False``). With a learning-rate
    schedule, pass ``backend=None``: every new learning rate would be a
    recompile, and past Dynamo's recompile limit the step runs uncompiled.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        comm: str = "all_gather",
        process_group: Any = None,
        backend: str | Callable | None = "laplace",
        adamw_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if comm not in COMM_MODES:
            raise ValueError(
                f"ShardedMuon: unknown comm={comm!r}; expected one of {', '.join(map(repr, COMM_MODES))}"
            )
        if backend is not None and not (isinstance(backend, str) or callable(backend)):
            raise TypeError(
                f"ShardedMuon: backend must be None, a torch.compile backend name or a callable, got {backend!r}"
            )
        _check_muon_hparams(
            lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn
        )
        adamw = dict(_ADAMW_DEFAULTS)
        if adamw_kwargs is not None:
            if not isinstance(adamw_kwargs, dict):
                raise TypeError(f"ShardedMuon: adamw_kwargs must be a dict, got {type(adamw_kwargs).__name__}")
            unknown = sorted(set(adamw_kwargs) - set(_ADAMW_DEFAULTS))
            if unknown:
                raise TypeError(
                    f"ShardedMuon: unknown adamw_kwargs {unknown}; accepted: {sorted(_ADAMW_DEFAULTS)}"
                )
            adamw.update(adamw_kwargs)
        adamw["betas"] = tuple(adamw["betas"])
        _check_adamw_hparams(**adamw)

        self.comm = comm
        self.backend = backend
        self.process_group, self.rank, self.world_size = self._resolve_group(process_group)
        self._step_fn: Callable | None = None
        # Testing hook: called with a phase name at points inside step()
        # ("reduce", "shard_step", "all_gather_params"); raising from it
        # simulates a rank failing mid-step.
        self._fault_hook: Callable[[str], None] | None = None

        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "use_muon": None,
            **{f"adamw_{k}": v for k, v in adamw.items()},
        }
        super().__init__(params, defaults)

    # ---- setup ---------------------------------------------------------

    @staticmethod
    def _resolve_group(process_group):
        import torch.distributed as dist

        if process_group is None:
            if dist.is_available() and dist.is_initialized():
                process_group = dist.group.WORLD
            else:
                return None, 0, 1
        else:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "ShardedMuon: process_group was given but torch.distributed is not initialised"
                )
            if not isinstance(process_group, dist.ProcessGroup):
                raise TypeError(
                    f"ShardedMuon: process_group must be a torch.distributed.ProcessGroup, got {type(process_group).__name__}"
                )
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError("ShardedMuon: this process is not a member of process_group")
        world = dist.get_world_size(process_group)
        if world == 1:
            return None, 0, 1
        return process_group, rank, world

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_muon_hparams(*(group[k] for k in _MUON_KEYS))
        group["ns_coefficients"] = tuple(group["ns_coefficients"])
        group["adamw_betas"] = tuple(group["adamw_betas"])
        _check_adamw_hparams(
            group["adamw_lr"],
            group["adamw_betas"],
            group["adamw_eps"],
            group["adamw_weight_decay"],
            group["adamw_amsgrad"],
        )
        use_muon = group["use_muon"]
        if use_muon not in (None, True, False):
            raise ValueError(f"ShardedMuon: use_muon must be None, True or False, got {use_muon!r}")
        for p in group["params"]:
            if torch.is_complex(p):
                raise ValueError("ShardedMuon does not support complex parameters")
            if use_muon and p.ndim != 2:
                raise ValueError(
                    "ShardedMuon: Muon only supports 2D parameters, but a param group with "
                    f"use_muon=True has a parameter of size {tuple(p.shape)}; leave use_muon "
                    "unset to send non-2D parameters to AdamW"
                )

    @staticmethod
    def _is_muon(group: dict[str, Any], p: Tensor) -> bool:
        use = group["use_muon"]
        return p.ndim == 2 if use is None else bool(use)

    def _group_timeout(self) -> str:
        try:
            t = self.process_group._get_backend(torch.device("cpu")).options._timeout
            return f"{t.total_seconds():g}s"
        except Exception:
            return "the process group's"

    def _hook(self, phase: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(phase)

    def _shard_step(self):
        if self._step_fn is None:
            if self.backend is None:
                self._step_fn = _muon_shard_step
            else:
                # Static shapes: the layouts are Python constants anyway, and the
                # collective rewrite plans with concrete sizes.
                self._step_fn = torch.compile(_muon_shard_step, backend=self.backend, dynamic=False)
        return self._step_fn

    # ---- step ------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One optimisation step on every rank (a collective: all ranks call it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        W, rank = self.world_size, self.rank
        pg = self.process_group.group_name if self.process_group is not None else None
        muon_p: list[Tensor] = []
        muon_g: list[Tensor] = []
        muon_hp: list[MuonHParams] = []
        adam_p: list[Tensor] = []
        adam_g: list[Tensor] = []
        adam_grp: list[dict[str, Any]] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("ShardedMuon does not support sparse gradients")
                if self._is_muon(group, p):
                    rows, cols = p.shape
                    lr = float(group["lr"])
                    muon_p.append(p)
                    muon_g.append(p.grad)
                    muon_hp.append(
                        MuonHParams(
                            lr=lr,
                            weight_decay=group["weight_decay"],
                            momentum=group["momentum"],
                            nesterov=bool(group["nesterov"]),
                            ns_coefficients=tuple(group["ns_coefficients"]),
                            ns_steps=group["ns_steps"],
                            eps=group["eps"],
                            adjusted_lr=_adjust_lr(lr, group["adjust_lr_fn"], rows, cols),
                        )
                    )
                else:
                    adam_p.append(p)
                    adam_g.append(p.grad)
                    adam_grp.append(group)

        splits = [RowSplit(p.shape[0], p.shape[1], W) for p in muon_p]
        momentum_shards = []
        for p, sp in zip(muon_p, splits):
            buf = self.state[p].get("momentum_buffer")
            if buf is None:
                buf = torch.zeros(sp.shard_rows, sp.cols, dtype=p.dtype, device=p.device)
            elif tuple(buf.shape) != (sp.shard_rows, sp.cols):
                raise RuntimeError(
                    f"ShardedMuon: momentum_buffer of a {tuple(p.shape)} parameter has shape "
                    f"{tuple(buf.shape)}, expected this rank's padded shard {(sp.shard_rows, sp.cols)} "
                    f"(world size {W}); was the state saved with another world size?"
                )
            momentum_shards.append(buf)

        phase = "start"
        try:
            # 1. gradient averaging (all communication before any update)
            phase = "reduce"
            self._hook(phase)
            grad_shards = _reduce_scatter_mean(muon_g, splits, W, pg)
            adam_g_avg = _all_reduce_mean(adam_g, W, pg)

            # 2. Muon on the own row shards (Newton-Schulz communication inside)
            phase = "shard_step"
            self._hook(phase)
            param_shards = [sp.own(p.detach(), rank) for p, sp in zip(muon_p, splits)]
            new_bufs, new_shards = (
                self._shard_step()(
                    momentum_shards,
                    grad_shards,
                    param_shards,
                    torch.tensor(rank, dtype=torch.int64, device=muon_p[0].device),
                    splits=tuple(splits),
                    hparams=tuple(muon_hp),
                    owners=assign_owners(tuple(splits), W),
                    comm=self.comm,
                    world_size=W,
                    group=pg,
                )
                if muon_p
                else ([], [])
            )

            # 3. AdamW on temporaries (local)
            phase = "adamw"
            adam_new = self._adamw_compute(adam_p, adam_g_avg, adam_grp)

            # 4. the last collective: full parameters on every rank
            phase = "all_gather_params"
            self._hook(phase)
            new_full = _all_gather_rows(new_shards, splits, W, pg)
        except Exception as e:
            extra = (
                f" If another rank failed or hung, this rank's collective fails when the peer's "
                f"connection closes or after the process group timeout ({self._group_timeout()})."
                if W > 1
                else ""
            )
            raise ShardedMuonStepError(
                f"ShardedMuon.step() failed on rank {rank} of {W} during '{phase}' "
                f"(comm={self.comm!r}): {type(e).__name__}: {e}.{extra} "
                "No parameter or optimizer state was modified on this rank."
            ) from e

        # 5. commit: local copies only
        for p, full, buf in zip(muon_p, new_full, new_bufs):
            p.copy_(full)
            self.state[p]["momentum_buffer"] = buf
        for p, (new_p, new_state) in zip(adam_p, adam_new):
            p.copy_(new_p)
            self.state[p].update(new_state)
        return loss

    def _adamw_compute(self, params, grads, groups):
        """torch.optim.AdamW's update, applied to copies; returns (param, state) per param."""
        from torch.optim.adamw import adamw

        out = []
        for p, g, group in zip(params, grads, groups):
            state = self.state[p]
            amsgrad = group["adamw_amsgrad"]
            new_p = p.detach().clone()
            if "step" in state:
                step = state["step"].clone()
                exp_avg = state["exp_avg"].clone()
                exp_avg_sq = state["exp_avg_sq"].clone()
                max_sq = state["max_exp_avg_sq"].clone() if amsgrad else None
            else:
                # as torch.optim.Adam._init_group (non-capturable, non-fused)
                step = torch.tensor(0.0, dtype=_get_scalar_dtype())
                exp_avg = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg_sq = torch.zeros_like(p, memory_format=torch.preserve_format)
                max_sq = torch.zeros_like(p, memory_format=torch.preserve_format) if amsgrad else None
            beta1, beta2 = group["adamw_betas"]
            adamw(
                [new_p],
                [g],
                [exp_avg],
                [exp_avg_sq],
                [max_sq] if amsgrad else [],
                [step],
                foreach=None,
                capturable=False,
                differentiable=False,
                fused=None,
                has_complex=torch.is_complex(p),
                amsgrad=amsgrad,
                beta1=beta1,
                beta2=beta2,
                lr=group["adamw_lr"],
                weight_decay=group["adamw_weight_decay"],
                eps=group["adamw_eps"],
                maximize=False,
            )
            st = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
            if amsgrad:
                st["max_exp_avg_sq"] = max_sq
            out.append((new_p, st))
        return out
