"""What ShardedMuon checks across ranks before a step's collectives, and the errors a step raises.

NOTE [ranks agree before the step's collectives]
Every collective of a step takes its sizes from this rank's parameters. If the
ranks disagree on how many parameters there are, their shapes or dtypes, or
which have a ``.grad``, gloo sees mismatched sizes and aborts the process
(SIGABRT, no Python exception), or worse, sizes that happen to match and a
step that mixes unrelated rows. So each step first all-gathers one summary of
a fixed size per rank: the number of parameters, a digest of their ordered
(shape, dtype) list and a digest of their has-grad flags. Equal summaries are
the normal path: one small collective per step. Only when they differ does a
second gather (now of equal lengths on every rank, since the counts were
compared first) find what names the first difference, and every rank raises
the same kind of error, decided from the same gathered data. Digests use
hashlib: Python's ``hash`` of a string differs between processes.

At the first step (and the first after `add_param_group`) the parameters'
values are compared too (a float64 sum and sum of squares each, gathered
once; sums that are not finite must be equal): ShardedMuon keeps one replica of every
parameter per rank and updates each rank's rows on that rank, so replicas that
start different become a patchwork of the ranks' rows after one step.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor

NOTHING_MODIFIED = "No parameter or optimizer state was modified on this rank."

# Two replicas' sums may differ by summation order (other thread counts, other kernels): the float64 sums of
# float32 values are within about numel * 1e-16 of each other, relative to their scale. Values that differ give
# differences of the order of the values themselves.
REPLICA_RTOL = 1e-6


class ShardedMuonStepError(RuntimeError):
    """``ShardedMuon.step()`` failed on this rank; nothing was modified."""


class ShardedMuonRanksDisagreeError(ShardedMuonStepError):
    """The ranks' parameters do not match (NOTE [ranks agree before the step's collectives]); raised on every rank
    before any update."""


class ShardedMuonGradLayoutError(ShardedMuonRanksDisagreeError):
    """The ranks disagree on which parameters have a ``.grad``."""


class ShardedMuonParamLayoutError(ShardedMuonRanksDisagreeError):
    """The ranks have different numbers of parameters, or different shapes or dtypes at some position."""


class ShardedMuonUnreplicatedError(ShardedMuonRanksDisagreeError):
    """The parameters' values differ between the ranks at the first step (not replicated)."""


def check_ranks_agree(params: list[Tensor], rank: int, world_size: int, group, check_values: bool) -> None:
    """Raise the same error on every rank if the ranks' parameters disagree; one small all-gather if they agree.

    ``params``: every parameter of the optimizer, in its order. ``check_values``: also compare the parameters'
    values (the first step). A collective over ``group`` (all ranks call it).
    """
    if world_size == 1:
        return
    summary = torch.tensor([len(params), _digest(_layout(p) for p in params),
                            _digest("1" if p.grad is not None else "0" for p in params)], dtype=torch.int64)
    every = _all_gather(summary, world_size, group)  # [W, 3]
    counts, layouts, grads = every.unbind(1)
    if (counts != counts[0]).any():
        listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts.tolist()))
        raise ShardedMuonParamLayoutError(
            f"ShardedMuon.step(): the ranks have different numbers of parameters in the optimizer ({listed}). "
            "Build ShardedMuon on every rank over the same parameters in the same order (the same model and "
            f"param groups). {NOTHING_MODIFIED}")
    if (layouts != layouts[0]).any():
        _raise_layout_difference(params, rank, world_size, group)
    if (grads != grads[0]).any():
        _raise_grad_difference(params, world_size, group)
    if check_values:
        _check_replicated(params, world_size, group)


def _layout(p: Tensor) -> str:
    return f"{tuple(p.shape)} {p.dtype}"


def _digest(parts) -> int:
    """A 64-bit digest of the strings ``parts``, the same in every process."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part.encode())
        h.update(b";")
    return int.from_bytes(h.digest(), "little", signed=True)


def _all_gather(mine: Tensor, world_size: int, group) -> Tensor:
    """``[W, *mine.shape]``: every rank's ``mine`` (equal shapes and dtypes on every rank)."""
    import torch.distributed as dist

    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    return torch.stack(every)


def _raise_layout_difference(params: list[Tensor], rank: int, world_size: int, group) -> None:
    every = _all_gather(torch.tensor([_digest([_layout(p)]) for p in params], dtype=torch.int64), world_size, group)
    i = int((every != every[0]).any(0).nonzero()[0])
    others = [r for r in range(world_size) if every[r, i] != every[rank, i]]
    raise ShardedMuonParamLayoutError(
        f"ShardedMuon.step(): the ranks' parameters differ in shape or dtype: parameter {i} (in the order of the "
        f"param groups) is {_layout(params[i])} on this rank (rank {rank}) and something else on ranks {others}. "
        "Build ShardedMuon on every rank over the same parameters, in the same order, with the same shapes and "
        f"dtypes. {NOTHING_MODIFIED}")


def _raise_grad_difference(params: list[Tensor], world_size: int, group) -> None:
    flags = _all_gather(torch.tensor([p.grad is not None for p in params], dtype=torch.uint8), world_size, group)
    differ = (flags != flags[0]).any(0).nonzero().flatten().tolist()
    i = differ[0]
    with_grad = flags[:, i].nonzero().flatten().tolist()
    raise ShardedMuonGradLayoutError(
        f"ShardedMuon.step(): the ranks disagree on which parameters have a .grad ({len(differ)} "
        f"parameter(s)); e.g. parameter {i} of shape {tuple(params[i].shape)} has one on ranks "
        f"{with_grad} only, of {world_size}. A parameter one rank's loss does not use has no "
        f".grad there: give it zeros on every rank, or leave it out of the optimizer. {NOTHING_MODIFIED}")


def _check_replicated(params: list[Tensor], world_size: int, group) -> None:
    """Each parameter's float64 sum and sum of squares must agree across ranks up to summation order."""
    # Parameters on the meta device (a step traced for its traffic, `benchmarks/bench_muon.py`) hold no values;
    # every rank has the same ones there, their layouts compared already.
    params = [p for p in params if not p.is_meta]
    if not params:
        return
    sums = torch.stack([torch.stack([x.sum(), x.square().sum()])
                        for x in (p.detach().to(torch.float64) for p in params)]).cpu()  # [n, 2]
    every = _all_gather(sums, world_size, group)  # [W, n, 2]
    numel = torch.tensor([float(p.numel()) for p in params], dtype=torch.float64)
    squares = every[:, :, 1].abs().amax(0)
    # |sum| <= sqrt(numel * sum of squares): the scale of a sum's rounding; a sum of squares is its own.
    scale = torch.stack([(numel * squares).sqrt(), squares], dim=1)
    # An inf or NaN anywhere makes the scale inf or NaN, which would let any value pass: such sums must be equal.
    scale = torch.where(scale.isfinite(), scale, torch.zeros_like(scale))
    agree = ((every - every[0]).abs() <= REPLICA_RTOL * scale) | (every == every[0])
    agree |= every.isnan() & every[0].isnan()
    differ = (~agree).any(2).any(0).nonzero().flatten().tolist()
    if not differ:
        return
    i = differ[0]
    ranks = [r for r in range(world_size) if not bool(agree[r, i].all())]
    sums_i = ", ".join(f"rank {r}: {_fmt(every[r, i, 0].item())}" for r in [0, *ranks])
    raise ShardedMuonUnreplicatedError(
        "ShardedMuon.step(): the parameters are not the same on every rank at the first step (or the first "
        f"after add_param_group): parameter {i} "
        f"({_layout(params[i])}, in the order of the param groups) differs between rank 0 and ranks {ranks} "
        f"(its sum: {sums_i}). ShardedMuon updates each rank's rows of a matrix on that rank, so replicas that "
        "differ become a patchwork of the ranks' rows. Replicate the parameters before the first step: create "
        "the model with the same seed on every rank, or broadcast rank 0's values "
        f"(torch.distributed.broadcast(p, src=0) for every parameter). {NOTHING_MODIFIED}")


def _fmt(x: float) -> str:
    return f"{x:.9g}" if math.isfinite(x) else str(x)
