"""The demo's checkpoints: torch.distributed.checkpoint (DCP) directories, written whole or not at all.

``DIR/step_00000012/`` holds the model, ShardedMuon's state (each rank's
momentum rows in its own file, resharded on load at any world size:
``model_zoo.muon.checkpoint``), AdamW's state, the step, the losses so far
and the run's settings. A checkpoint is saved into ``step_N.tmp/`` and
renamed once DCP has written ``.metadata`` (its last file), so a rank killed
mid-save leaves a ``.tmp`` directory that is never loaded; the newest
``step_N/`` with a ``.metadata`` is the one a run resumes from. Several nodes
need ``DIR`` on a filesystem they all see.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Any

_STEP_DIR = re.compile(r"step_(\d+)")

# Settings that make a different training run: resuming across them would be silently wrong.
RUN_SETTINGS = ("model", "batch", "seq_len", "num_pairs", "seed", "muon_lr", "adamw_lr")


def newest_step(directory: str) -> int | None:
    """The newest complete checkpoint's step in ``directory`` (rank 0 looks, every rank gets its answer)."""
    import torch.distributed as dist

    found = [_newest_on_disk(directory)]
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    return found[0]


def _newest_on_disk(directory: str) -> int | None:
    if not os.path.isdir(directory):
        return None
    steps = [int(m.group(1)) for name in os.listdir(directory) if (m := _STEP_DIR.fullmatch(name))
             and os.path.exists(os.path.join(directory, name, ".metadata"))]
    return max(steps, default=None)


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}")


def training_state(model, optimizer, names, step: int, losses: list[float], settings: dict) -> dict[str, Any]:
    """What a checkpoint holds; also the template a load fills in place (in this world size's layout)."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.dcp_state_dict(names),
        "step": step,
        "losses": json.dumps(losses),
        "settings": json.dumps(settings, sort_keys=True),
    }


def save(directory: str, step: int, state: dict[str, Any], rank: int) -> str:
    """Every rank writes its own shards; rank 0 publishes the directory once DCP's metadata is written."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = step_dir(directory, step)
    partial = final + ".tmp"
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # what a killed save left behind
    if dist.is_initialized():
        dist.barrier()
    with _quiet_dcp():
        dcp.save(state, checkpoint_id=partial)  # returns on every rank once .metadata exists
    if rank == 0:
        os.replace(partial, final)
    if dist.is_initialized():
        dist.barrier()
    return final


def load(directory: str, step: int, template: dict[str, Any], settings: dict) -> dict[str, Any]:
    """Fill ``template`` from checkpoint ``step``; refuse one written by a run with other settings."""
    import torch.distributed.checkpoint as dcp

    path = step_dir(directory, step)
    with _quiet_dcp():
        dcp.load(template, checkpoint_id=path)
    saved = json.loads(template["settings"])
    differ = {k: (saved.get(k), settings[k]) for k in settings if saved.get(k) != settings[k]}
    if differ:
        details = ", ".join(f"{k} {old!r} there, {new!r} here" for k, (old, new) in differ.items())
        raise ValueError(f"the checkpoint {path} is from a different run ({details}); "
                         "use another --checkpoint-dir or the same settings")
    template["losses"] = json.loads(template["losses"])
    return template


class _quiet_dcp(warnings.catch_warnings):
    """Two warnings DCP gives on every save and load, about choices made here on purpose.

    It assumes one process when no process group exists (W = 1, intended),
    and it calls ShardedTensor deprecated in favour of DTensor, whose row
    layout is not ShardedMuon's (model_zoo.muon.checkpoint).
    """

    def __enter__(self):
        result = super().__enter__()
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor",
                                category=FutureWarning)
        return result
