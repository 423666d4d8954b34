"""laplace_passes: torch.fx passes that re-tile GLA for Trainium2, and more.

Public API:
    gla, chunked_gla           the GLA op (reference recurrence) and its chunked form
    compile, inspect           compile with the passes; report what they did
    targets, get_target        hardware targets (trn2, cpu)
    Report, last_report        what a compile did
    export_stablehlo           every ATen graph as StableHLO, with a manifest (laplace_passes.lowering)
    preflight                  what neuronx-cc / TorchNeuron would reject, found on any machine
    fla                        flash-linear-attention models without Triton (laplace_passes.fla.install)
    keep_freed_memory          glibc keeps freed memory: large CPU tensors reused without page faults
"""

import sys

from laplace_passes.infra import targets
from laplace_passes.driver.api import compile, inspect
from laplace_passes.ops.chunked import chunk_plan, chunked_gla
from laplace_passes.ops.gla import gla
from laplace_passes.driver.export import export_stablehlo
from laplace_passes.driver.preflight import preflight
from laplace_passes.infra.allocator import keep_freed_memory
from laplace_passes.infra.report import Report, last_report
from laplace_passes.infra.targets import HardwareTarget, get_target

__version__ = "0.1.0"

# `laplace_passes.targets` is public under that name: importable as a module too
# (`from laplace_passes.targets import TRN2`), not only reached as an attribute.
sys.modules[f"{__name__}.targets"] = targets

__all__ = [
    "HardwareTarget",
    "Report",
    "chunk_plan",
    "chunked_gla",
    "compile",
    "export_stablehlo",
    "get_target",
    "gla",
    "inspect",
    "keep_freed_memory",
    "last_report",
    "preflight",
    "targets",
]
