"""The demo's ShardedMuon step as StableHLO: one module for every rank, exported from W local ranks.

    laplace-passes export tiny --stablehlo DIR --muon --world-size 4
    # DIR/manifest.json ("muon_step": ...), DIR/muon_step/inference_0.mlir, .mlirbc, manifest.json

The step is the demo's (`demo.train`'s parameter groups: Muon for the
hidden matrices, AdamW for the rest) over the named model's parameters.
W ranks are started on this machine with gloo (`launch_local`); each
traces and lowers its own step, since the collectives need a process group
of W ranks to be traced at all, and the modules must come out the same on
every rank: that is the branch-free plan's promise (no rank constant, no
cond), checked here before anything is written. Only the gradients' shapes
matter to the export, so they are random.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

STEP_DIR = "muon_step"


def demo_muon_step(model_name: str, seed: int = 0) -> tuple[Callable, tuple]:
    """Inside a process group: (the demo's ShardedMuon shard step, this rank's arguments) for `model_name`."""
    import model_zoo
    from laplace_passes.demo.train import _param_groups
    from model_zoo.muon import ShardedMuon

    torch.manual_seed(seed)  # the same weights and gradients on every rank
    model = model_zoo.build(model_name)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer = ShardedMuon(_param_groups(model), lr=0.02, weight_decay=0.0, backend=None)
    return optimizer.shard_step_call()


def export_rank(model_name: str, target: str, out_dir: str) -> dict[str, str]:
    """One rank: join the launcher's process group, export the step into `out_dir`; {graph file: text}."""
    import laplace_passes
    from laplace_passes.demo.distributed import join_process_group

    join_process_group()
    step, args = demo_muon_step(model_name)
    exported = laplace_passes.export_stablehlo(step, *args, target=target, out_dir=out_dir)
    return {entry["file"]: (exported.out_dir / entry["file"]).read_text() for entry in exported.manifest["graphs"]}


def export_muon_step(model_name: str, *, world_size: int, target: str, out_dir: str | Path) -> dict:
    """Export the step from `world_size` local ranks into the new directory `out_dir`; its summary.

    Raises RuntimeError, writing nothing, when the ranks' modules differ.
    """
    from laplace_passes.demo.distributed import launch_local
    import json

    out_dir = Path(out_dir)
    scratch = Path(tempfile.mkdtemp(prefix="laplace_muon_export_"))
    try:
        rank_dirs = [str(scratch / f"rank{rank}") for rank in range(world_size)]
        texts = launch_local(world_size, _export_one_rank, model_name, target, rank_dirs)
        differ = [rank for rank, mine in enumerate(texts) if mine != texts[0]]
        if differ:
            raise RuntimeError(f"the Muon step's StableHLO differs between rank 0 and rank(s) {differ}: it is not "
                               "one program for every rank (see the report's muon_all_to_all entry)")
        shutil.move(rank_dirs[0], out_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    return {
        "dir": out_dir.name,
        "manifest": f"{out_dir.name}/manifest.json",
        "world_size": world_size,
        "same_on_every_rank": True,
        "graphs": [entry["name"] for entry in manifest["graphs"]],
        "collectives": {entry["name"]: entry["collectives"] for entry in manifest["graphs"]},
    }


def _export_one_rank(model_name: str, target: str, rank_dirs: list[str]) -> dict[str, str]:
    import torch.distributed as dist

    from laplace_passes.demo.distributed import launcher_rank_and_world

    rank, _ = launcher_rank_and_world()
    try:
        return export_rank(model_name, target, rank_dirs[rank])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
