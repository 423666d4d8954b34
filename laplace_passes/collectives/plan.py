"""Ownership plans: which rank runs Newton-Schulz on which matrix, and the all-to-all layout.

Every rank sends every owner one chunk of `chunk_numel` elements (equal
split sizes, as TorchNeuron's all-to-all requires): its shard of each
matrix that owner owns, at the matrix's offset, zeros elsewhere. Two ways
to lay the chunks out, both giving a graph that is the same on every rank:

"uniform": matrices whose whole pipeline (rebuild from shards,
    Newton-Schulz, per-rank layout) is the same computation form a group
    (same shape and hyper-parameters). Every rank owns `ceil(n / W)` slots
    of each group at the same offsets, so every rank runs the same code on
    whatever the all-to-all routed to it. Spare slots hold zero matrices
    (Newton-Schulz maps zero to zero; nobody reads the result). No control
    flow; the zero matrices cost traffic and compute when counts are not
    multiples of W.

"balanced": any matrix can go to any rank. Three packings are tried
    (largest first to the least-loaded rank by bytes, the same by
    Newton-Schulz cost, best-fit into the tightest chunk that works), each
    improved by moves and swaps off the fullest rank; the smallest chunk
    wins, then the smallest Newton-Schulz load. Owners then hold different
    matrices, so each rank's work sits in a `cond(rank == owner)` branch:
    same graph everywhere, only the owner's branch runs. Chunks are padded to
    the fullest owner's.

`plan_ownership` takes "uniform" when it needs no zero matrices or when
balanced plans are not allowed (no rank tensor for the conds, or a target
whose compiler takes no control flow), otherwise whichever sends less.
`plan_candidates` gives both, for the report to compare.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """A uniform plan's place for one matrix of a group, the same on every rank."""

    group: int
    template: int  # a matrix of the group: whose computation the slot runs
    numel: int  # shard elements per rank
    offset: int  # position in a rank's chunk
    flops: int  # Newton-Schulz FLOPs of one matrix of the group


@dataclass(frozen=True)
class OwnershipPlan:
    kind: str  # "uniform" or "balanced"
    world_size: int
    chunk_numel: int  # elements sent to (and received from) each rank in one all-to-all
    owners: tuple[int, ...]  # per matrix
    offsets: tuple[int, ...]  # per matrix: position in its owner's chunk
    numels: tuple[int, ...]  # per matrix: shard elements per rank
    flops: tuple[int, ...]  # per matrix: Newton-Schulz FLOPs
    slots: tuple[Slot, ...] = ()  # uniform plans only

    @property
    def padding_matrices(self) -> int:
        """Zero matrices a uniform plan runs (balanced plans pad chunks instead)."""
        return self.world_size * len(self.slots) - len(self.owners) if self.slots else 0

    def owned(self, rank: int) -> list[int]:
        """The matrices `rank` orthogonalises, by offset."""
        return sorted((i for i, r in enumerate(self.owners) if r == rank), key=self.offsets.__getitem__)

    def layout(self, rank: int) -> list[tuple[int, int, int | None]]:
        """(offset, numel, matrix or None for zeros) covering `rank`'s chunk."""
        if self.slots:
            at = {(r, self.offsets[i]): i for i, r in enumerate(self.owners)}
            pieces = [(s.offset, s.numel, at.get((rank, s.offset))) for s in self.slots]
        else:
            pieces = [(self.offsets[i], self.numels[i], i) for i in self.owned(rank)]
        end = pieces[-1][0] + pieces[-1][1] if pieces else 0
        return pieces + ([(end, self.chunk_numel - end, None)] if end < self.chunk_numel else [])

    @property
    def flops_per_rank(self) -> int:
        """Newton-Schulz FLOPs of the busiest rank (zero matrices of uniform plans included)."""
        if self.slots:
            return sum(s.flops for s in self.slots)
        return max(self.useful_flops(r) for r in range(self.world_size))

    def useful_flops(self, rank: int) -> int:
        """Newton-Schulz FLOPs of the real matrices `rank` owns."""
        return sum(f for f, r in zip(self.flops, self.owners) if r == rank)


def plan_ownership(
    keys: Sequence[Hashable],
    numels: Sequence[int],
    flops: Sequence[int],
    world_size: int,
    allow_balanced: bool = True,
) -> OwnershipPlan:
    """Plan for matrices with computation `keys`, shard sizes `numels` and Newton-Schulz `flops`."""
    return choose_plan(plan_candidates(keys, numels, flops, world_size), allow_balanced)


def choose_plan(candidates: Sequence[OwnershipPlan], allow_balanced: bool) -> OwnershipPlan:
    """The uniform plan, or the balanced one where allowed and it sends less."""
    if len(candidates) == 1 or not allow_balanced:
        return candidates[0]
    uniform, balanced = candidates
    return balanced if balanced.chunk_numel < uniform.chunk_numel else uniform


def plan_candidates(keys, numels, flops, world_size: int) -> list[OwnershipPlan]:
    """[the uniform plan] when it needs no zero matrices, else [uniform, balanced]."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    uniform = uniform_plan(keys, numels, flops, world_size)
    if uniform.padding_matrices == 0:
        return [uniform]
    return [uniform, balanced_plan(numels, flops, world_size)]


def uniform_plan(keys, numels, flops, world_size) -> OwnershipPlan:
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    # Most expensive groups first: their slots come first in the chunk.
    ordered = sorted(groups.values(), key=lambda members: (-flops[members[0]], members[0]))
    slots: list[Slot] = []
    group_slots: list[list[int]] = []
    offset = 0
    for g, members in enumerate(ordered):
        first = members[0]
        indices = []
        for _ in range(math.ceil(len(members) / world_size)):
            indices.append(len(slots))
            slots.append(Slot(g, first, numels[first], offset, flops[first]))
            offset += numels[first]
        group_slots.append(indices)
    owners, offsets = [0] * len(keys), [0] * len(keys)
    for i, (rank, slot) in _place_in_slots(ordered, group_slots, flops, world_size).items():
        owners[i], offsets[i] = rank, slots[slot].offset
    return OwnershipPlan("uniform", world_size, offset, tuple(owners), tuple(offsets),
                         tuple(numels), tuple(flops), tuple(slots))


def _place_in_slots(ordered, group_slots, flops, world_size) -> dict[int, tuple[int, int]]:
    """Largest first, to the least-loaded rank that still has a free slot of the matrix's group."""
    load = [0] * world_size
    used = [[0] * world_size for _ in ordered]
    group_of = {i: g for g, members in enumerate(ordered) for i in members}
    placement: dict[int, tuple[int, int]] = {}
    for i in sorted(group_of, key=lambda i: (-flops[i], i)):
        g = group_of[i]
        capacity = len(group_slots[g])
        rank = min((r for r in range(world_size) if used[g][r] < capacity), key=lambda r: (load[r], r))
        placement[i] = (rank, group_slots[g][used[g][rank]])
        used[g][rank] += 1
        load[rank] += flops[i]
    return placement


def balanced_plan(numels, flops, world_size) -> OwnershipPlan:
    """The best of three heuristics, each followed by `_even_out`: none wins on every model."""
    starts = [greedy_owners(numels, world_size), greedy_owners(flops, world_size), _tightest_best_fit(numels, world_size)]
    candidates = [_as_plan(_even_out(owners, numels, world_size), numels, flops, world_size) for owners in starts]
    return min(candidates, key=lambda p: (p.chunk_numel, p.flops_per_rank))


def _tightest_best_fit(numels, world_size) -> list[int]:
    """Best-fit decreasing into W chunks of the smallest capacity it manages (binary search)."""
    low, high = max(math.ceil(sum(numels) / world_size), max(numels, default=0)), sum(numels)
    best = _best_fit(numels, world_size, high)
    while low < high:
        capacity = (low + high) // 2
        owners = _best_fit(numels, world_size, capacity)
        if owners is None:
            low = capacity + 1
        else:
            high, best = capacity, owners
    return best


def _best_fit(numels, world_size, capacity) -> list[int] | None:
    load = [0] * world_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        fits = [r for r in range(world_size) if load[r] + numels[i] <= capacity]
        if not fits:
            return None
        rank = max(fits, key=lambda r: (load[r], -r))
        owners[i] = rank
        load[rank] += numels[i]
    return owners


def greedy_owners(weight, world_size) -> list[int]:
    """Largest `weight` first, each matrix to the rank with the least `weight` so far."""
    load = [0] * world_size
    owners = [0] * len(weight)
    for i in sorted(range(len(weight)), key=lambda i: (-weight[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += weight[i]
    return owners


def _even_out(owners: list[int], numels, world_size, max_rounds: int = 1000) -> list[int]:
    """Shrink the fullest chunk (what every rank sends to every owner) by moves and swaps.

    Each round moves one matrix off the fullest rank, or swaps it for a
    smaller one elsewhere, whichever lowers the larger of the two chunks
    most; stops when nothing helps. Deterministic.
    """
    owners = list(owners)
    load = [0] * world_size
    for i, r in enumerate(owners):
        load[r] += numels[i]
    for _ in range(max_rounds):
        full = max(range(world_size), key=lambda r: (load[r], -r))
        best = None  # (new max of the pair, i, j or None, rank)
        for i in (i for i, r in enumerate(owners) if r == full):
            for j, r in enumerate(owners):
                if r == full or numels[j] >= numels[i]:
                    continue
                delta = numels[i] - numels[j]
                pair = max(load[full] - delta, load[r] + delta)
                if pair < load[full] and (best is None or pair < best[0]):
                    best = (pair, i, j, r)
            for r in range(world_size):
                pair = load[r] + numels[i]
                if r != full and pair < load[full] and (best is None or pair < best[0]):
                    best = (pair, i, None, r)
        if best is None:
            break
        _, i, j, r = best
        owners[i] = r
        load[full] -= numels[i]
        load[r] += numels[i]
        if j is not None:
            owners[j] = full
            load[full] += numels[j]
            load[r] -= numels[j]
    return owners


def _as_plan(owners: list[int], numels, flops, world_size) -> OwnershipPlan:
    filled = [0] * world_size
    offsets = [0] * len(numels)
    for i, rank in enumerate(owners):
        offsets[i] = filled[rank]
        filled[rank] += numels[i]
    return OwnershipPlan("balanced", world_size, max(filled), tuple(owners), tuple(offsets),
                         tuple(numels), tuple(flops))
