"""ShardedMuon's state for torch.distributed.checkpoint (DCP): saved per rank, loadable at any world size.

``ShardedMuon.state_dict()`` holds this rank's *padded* momentum rows, so it
reloads only into the same rank of the same world size. For DCP, each Muon
matrix's momentum is instead described as one logical ``[rows, cols]`` tensor
of which this rank holds rows ``[offset(r), offset(r) + size(r))``
(:class:`RowSplit`), a ShardedTensor with explicit row offsets. DCP writes
each rank's rows to that rank's own file and, on load, reads whatever rows
the *loading* rank owns at its world size: a checkpoint saved at W = 2 loads
at W = 3 or W = 1.

(DTensor's ``Shard(0)`` assumes ``torch.chunk``'s layout, ``ceil(rows / W)``
rows per rank, the last ones short; RowSplit gives the first ``rows % W``
ranks one row more, so the two disagree, and DCP would write a checkpoint
that cannot be read back. ``torch.distributed.checkpoint.state_dict``'s
``get_optimizer_state_dict`` keys each rank's padded momentum identically, so
DCP would keep rank 0's copy only; it also runs a zero-gradient ``step()`` on
a fresh optimizer, which ShardedMuon's AdamW weight decay turns into an update.)

AdamW state (replicated, identical on every rank) is saved as plain tensors;
DCP writes each once. Keys are ``"<name>.<state key>"``, ``name`` being the
parameter's name (e.g. from ``model.named_parameters()``), so a checkpoint does
not depend on the order of the parameter groups. Every parameter of the
optimizer gets entries, zeros for one that has not stepped yet (the same as
no state: the first step starts from zeros either way).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from model_zoo.muon.collectives import RowSplit


def muon_state_for_dcp(opt, names: dict[Tensor, str]) -> dict[str, Any]:
    """The DCP state of ``opt`` (a ShardedMuon); also the template ``load_muon_state_from_dcp`` loads into."""
    missing = [tuple(p.shape) for group in opt.param_groups for p in group["params"] if p not in names]
    if missing:
        raise ValueError(f"ShardedMuon checkpoint: no name given for parameters of shapes {missing}")
    state: dict[str, Any] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            if opt._is_muon(group, p):
                state[f"{names[p]}.momentum_buffer"] = _momentum_rows(opt, p)
            else:
                for key, value in _adamw_state(opt, group, p).items():
                    state[f"{names[p]}.{key}"] = value
    return state


def load_muon_state_from_dcp(opt, names: dict[Tensor, str], loaded: dict[str, Any]) -> None:
    """Put a state filled by ``dcp.load`` (into ``muon_state_for_dcp``'s template) into ``opt.state``."""
    for group in opt.param_groups:
        for p in group["params"]:
            if opt._is_muon(group, p):
                rows = loaded[f"{names[p]}.momentum_buffer"]
                mine = _local_rows(rows, p)
                split = RowSplit(p.shape[0], p.shape[1], opt.world_size)
                padding = mine.new_zeros(split.shard_rows - mine.shape[0], split.cols)
                opt.state[p]["momentum_buffer"] = torch.cat([mine, padding])
            else:
                keys = _adamw_state(opt, group, p).keys()
                opt.state[p].update({key: loaded[f"{names[p]}.{key}"].clone() for key in keys})


def _momentum_rows(opt, p: Tensor):
    """This rank's unpadded momentum rows as part of the whole ``[rows, cols]`` tensor."""
    split = RowSplit(p.shape[0], p.shape[1], opt.world_size)
    buf = opt.state[p].get("momentum_buffer") if p in opt.state else None
    mine = buf[: split.size(opt.rank)] if buf is not None else p.new_zeros(split.size(opt.rank), split.cols)
    if opt.world_size == 1:
        return mine.detach().clone()
    return _row_sharded(mine.detach().clone(), split, opt.rank, opt.process_group)


def _row_sharded(mine: Tensor, split: RowSplit, rank: int, process_group):
    """A ShardedTensor of ``split``'s layout holding this rank's rows (collective over the group)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    shards = []
    if split.size(rank) > 0:  # a rank that owns no rows contributes no shard
        metadata = ShardMetadata(shard_offsets=[split.offset(rank), 0], shard_sizes=[split.size(rank), split.cols],
                                 placement=f"rank:{rank}/{mine.device}")
        shards.append(Shard(mine, metadata))
    return init_from_local_shards(shards, split.rows, split.cols, process_group=process_group)


def _local_rows(rows, p: Tensor) -> Tensor:
    if isinstance(rows, Tensor) and not hasattr(rows, "local_shards"):
        return rows.clone()
    shards = rows.local_shards()
    return shards[0].tensor.clone() if shards else p.new_zeros(0, p.shape[1])


def _adamw_state(opt, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
    """AdamW's state of ``p`` as ``_adamw_compute`` keeps it, or its zero-step equivalent."""
    from torch.optim.optimizer import _get_scalar_dtype

    state = opt.state[p] if p in opt.state else {}
    keys = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["adamw_amsgrad"] else [])
    fresh = {"step": torch.tensor(0.0, dtype=_get_scalar_dtype())}
    return {key: state[key].detach().clone() if key in state else fresh.get(key, torch.zeros_like(p.detach()))
            for key in keys}
