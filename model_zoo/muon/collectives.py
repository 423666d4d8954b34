"""How ShardedMuon lays rows out over ranks, and the collectives that move them.

The collectives are the functional collectives exactly as
`torch.distributed._functional_collectives` issues them (all_gather_single,
broadcast, reduce_scatter_single, all_reduce call these ops), minus its
eager AsyncCollectiveTensor wrapper: the `_c10d_functional.*` op followed by
`_c10d_functional.wait_tensor`, which is also what appears in the FX graph
under torch.compile. (The wrapper imports torch._dynamo on first eager use,
seconds per process, which multi-process CPU tests cannot afford.) `group`
is the process group's name; ranks are ranks within the group; with one
rank every function returns its input unchanged.

The bucketed functions (`reduce_scatter_mean`, `all_gather_rows`,
`all_reduce_mean`) issue one collective per dtype over all their tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class RowSplit:
    """How the rows of one ``rows x cols`` matrix are split over W ranks.

    Rank r owns ``size(r)`` consecutive rows starting at ``offset(r)``; the
    first ``rows % W`` ranks own one row more.  Every shard is padded with
    zero rows to ``shard_rows = ceil(rows / W)``, so every collective sees
    equal sizes and every rank holds tensors of identical shapes.
    """

    rows: int
    cols: int
    world_size: int
    # Derived sizes, stored rather than properties: torch.compile traces the
    # shard step through these reads, and a property is a function call for
    # Dynamo to inline (hundreds per step; a field read is a constant).
    base: int = field(init=False, repr=False)  # rows every rank owns
    extra: int = field(init=False, repr=False)  # ranks owning one row more
    shard_rows: int = field(init=False, repr=False)
    shard_numel: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        base, extra = divmod(self.rows, self.world_size)
        shard_rows = base + (1 if extra else 0)
        for name, value in (("base", base), ("extra", extra), ("shard_rows", shard_rows),
                            ("shard_numel", shard_rows * self.cols)):
            object.__setattr__(self, name, value)

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

    def own_rows(self, full: Tensor, rank: Tensor) -> Tensor:
        """This rank's padded row shard of ``full``, picked by the rank as a tensor (the same graph on every rank)."""
        return self.pad_all(full).index_select(0, rank.view(1)).squeeze(0)


def _ops():
    return torch.ops._c10d_functional


def all_gather(flat: Tensor, world_size: int, group: str | None) -> Tensor:
    """all_gather_into_tensor of a 1D tensor -> ``[world_size, numel]``."""
    if world_size == 1:
        return flat.unsqueeze(0)
    out = _ops().wait_tensor(_ops().all_gather_into_tensor(flat, world_size, group))
    return out.view(world_size, -1)


def broadcast(t: Tensor, src: int, world_size: int, group: str | None) -> Tensor:
    if world_size == 1:
        return t
    return _ops().wait_tensor(_ops().broadcast(t, src, group))


def by_dtype(tensors: list[Tensor]) -> dict[torch.dtype, list[int]]:
    """Indices of `tensors` by dtype, in order: one bucket per collective."""
    out: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.dtype, []).append(i)
    return out


def reduce_scatter_mean(grads: list[Tensor], splits: list[RowSplit], world_size: int, group) -> list[Tensor]:
    """Average of ``grads`` over ranks, this rank's padded row shard of each.

    One reduce-scatter per dtype over a bucket laid out ``[W, sum shard_numel]``.
    """
    if world_size == 1:
        return list(grads)
    out: list[Tensor] = [None] * len(grads)  # type: ignore[list-item]
    for idx in by_dtype(grads).values():
        bucket = torch.cat([splits[i].pad_all(grads[i]).reshape(world_size, -1) for i in idx], dim=1).reshape(-1)
        # gloo has no "avg": sum, then divide.
        shard = _ops().wait_tensor(_ops().reduce_scatter_tensor(bucket, "sum", world_size, group)).div_(world_size)
        pos = 0
        for i in idx:
            sp = splits[i]
            out[i] = shard[pos : pos + sp.shard_numel].view(sp.shard_rows, sp.cols)
            pos += sp.shard_numel
    return out


def all_gather_rows(shards: list[Tensor], splits: list[RowSplit], world_size: int, group) -> list[Tensor]:
    """Full ``[rows, cols]`` matrices from every rank's padded row shard (one all-gather per dtype)."""
    if world_size == 1:
        return list(shards)
    out: list[Tensor] = [None] * len(shards)  # type: ignore[list-item]
    for idx in by_dtype(shards).values():
        gathered = all_gather(torch.cat([shards[i].reshape(-1) for i in idx]), world_size, group)
        pos = 0
        for i in idx:
            sp = splits[i]
            out[i] = sp.unpad_all(gathered[:, pos : pos + sp.shard_numel])
            pos += sp.shard_numel
    return out


def all_reduce_mean(grads: list[Tensor], world_size: int, group) -> list[Tensor]:
    """Average of ``grads`` over ranks (one all-reduce per dtype)."""
    if world_size == 1 or not grads:
        return list(grads)
    out: list[Tensor] = [None] * len(grads)  # type: ignore[list-item]
    for idx in by_dtype(grads).values():
        flat = torch.cat([grads[i].reshape(-1) for i in idx])
        reduced = _ops().wait_tensor(_ops().all_reduce(flat, "sum", group)).div_(world_size)
        pos = 0
        for i in idx:
            g = grads[i]
            out[i] = reduced[pos : pos + g.numel()].view_as(g)
            pos += g.numel()
    return out
