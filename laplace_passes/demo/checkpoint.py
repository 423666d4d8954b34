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
RUN_SETTINGS = ("model", "shift_keys", "batch", "seq_len", "num_pairs", "seed", "muon_lr", "adamw_lr")


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


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: another run's, or damaged. The message names it and the fix."""


def check_resumable(directory: str, steps: int, settings: dict) -> int | None:
    """The newest checkpoint's step in ``directory`` (None: none), once it is known to load into this run.

    Reads its ``.metadata``, the sizes of its data files and its run settings, never the model or
    optimizer state: a checkpoint of another run is refused by its settings (naming them), not by
    the first missing weight, and a damaged one by the file at fault.
    """
    step = _newest_on_disk(directory)
    if step is None:
        return None
    if step > steps:
        raise CheckpointError(f"the newest checkpoint in {directory} is at step {step}, past steps={steps}: "
                              "ask for more --steps, or use another --checkpoint-dir")
    _check_intact_and_same_run(step_dir(directory, step), settings)
    return step


def load(directory: str, step: int, template: dict[str, Any], settings: dict) -> dict[str, Any]:
    """Fill ``template`` from checkpoint ``step``; refuse one written by a run with other settings, or damaged."""
    import torch.distributed.checkpoint as dcp

    path = step_dir(directory, step)
    _check_intact_and_same_run(path, settings)  # before any state is loaded
    try:
        with _quiet_dcp():
            dcp.load(template, checkpoint_id=path)
    except Exception as error:  # DCP's own errors (a missing key, a bad pickle) carry no file or fix
        raise CheckpointError(f"cannot load the checkpoint {path} ({_first_line(error)}): "
                              f"{_REMOVE_IT.format(path=path)}") from error
    template["losses"] = json.loads(template["losses"])
    return template


_REMOVE_IT = "remove {path} to resume from the checkpoint before it, or use another --checkpoint-dir"


def _check_intact_and_same_run(path: str, settings: dict) -> None:
    metadata = _read_metadata(path)
    _check_data_files(path, metadata)
    _check_same_run(path, metadata, settings)


def _read_metadata(path: str):
    from torch.distributed.checkpoint import FileSystemReader

    try:
        with _quiet_dcp():
            return FileSystemReader(path).read_metadata()
    except Exception as error:  # a truncated or overwritten pickle fails in many ways
        raise CheckpointError(f"the checkpoint's {os.path.join(path, '.metadata')} is damaged "
                              f"({_first_line(error)}): {_REMOVE_IT.format(path=path)}") from None


def _check_data_files(path: str, metadata) -> None:
    """Every data file the metadata lists is there, and as long as the last entry it holds ends."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < length:
            state = "is missing" if size is None else f"is truncated ({size:,} of {length:,} bytes)"
            raise CheckpointError(f"the checkpoint's data file {file} {state}: {_REMOVE_IT.format(path=path)}")


def _check_same_run(path: str, metadata, settings: dict) -> None:
    """Load the saved run settings alone and compare them with this run's."""
    import torch.distributed.checkpoint as dcp

    if "settings" not in metadata.state_dict_metadata:
        raise CheckpointError(f"{path} is not a checkpoint of laplace-passes demo (it holds no run settings): "
                              "use another --checkpoint-dir")
    saved = {"settings": ""}
    try:
        with _quiet_dcp():
            dcp.load(saved, checkpoint_id=path)
        saved = json.loads(saved["settings"])
        if not isinstance(saved, dict):
            raise TypeError(f"a JSON {type(saved).__name__}, not an object")
    except Exception as error:
        raise CheckpointError(f"cannot read the run settings of the checkpoint {path} ({_first_line(error)}): "
                              f"{_REMOVE_IT.format(path=path)}") from None
    differ = {k: (saved.get(k), settings[k]) for k in settings if saved.get(k) != settings[k]}
    if differ:
        details = ", ".join(f"{k} {old!r} there, {new!r} here" for k, (old, new) in differ.items())
        raise CheckpointError(f"the checkpoint {path} is from a different run ({details}); "
                              "use another --checkpoint-dir or the same settings")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


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
