"""`export_stablehlo`: every ATen graph of a model as a StableHLO file, with a manifest.

    exported = laplace_passes.export_stablehlo(model, ids, target="trn2", out_dir="hlo/")
    # hlo/forward_0.mlir, hlo/forward_0.mlirbc, hlo/backward_0.mlir, ..., hlo/manifest.json

The graphs are exactly those inner="stablehlo" lowers: the laplace passes,
AOT Autograd with torch-mlir's decompositions, the lowering passes
(gate checks become clamps, see `laplace_passes.lowering.legalize`), the
clean-up for neuronx-cc (`clean_stablehlo`: no f64, no arith, no
dynamic_iota). Each graph is written as text (`.mlir`) and as MLIR
bytecode (`.mlirbc`, what TorchNeuron hands neuronx-cc). The manifest
lists, per graph: its name and kind, both files, its inputs and outputs
(name, shape, dtype, and for forward and inference graphs the user's name for it, "args[0][3]",
"self.lm_head.weight"), its op counts by op name and its collectives, and for Trainium targets
the neuronx-cc command (`neuronx_cc_command`: the target's --lnc and
--auto-cast, then $NEURON_CC_FLAGS) on the bytecode. For those targets the
Neuron preflight's checks (`laplace_passes.preflight`) run on the graphs as
they are lowered, and their findings are the manifest's `neuron_preflight`
list and `StableHLOExport.findings` (empty: nothing found); no second
capture is needed to check an export.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx
from functorch.compile import make_boxed_func

from laplace_passes.driver.compile_fx import capture_graphs, check_callable
from laplace_passes.driver.config import CompileConfig, entry_point_options
from laplace_passes.driver.output_roles import OutputLayout
from laplace_passes.driver.preflight import graph_break_findings, preflight_records
from laplace_passes.infra.files import check_output_dir, staged_directory
from laplace_passes.lowering._deps import torch_mlir_fx
from laplace_passes.lowering.neuron import NEURON_TARGETS, format_command, neuronx_cc_command
from laplace_passes.lowering.stablehlo import LoweredGraph, StableHLOCompiler, lowered_graph
from laplace_passes.infra.report import Report
from laplace_passes.infra.targets import HardwareTarget

MANIFEST = "manifest.json"
STABLEHLO_COLLECTIVES = ("stablehlo.all_to_all", "stablehlo.all_gather", "stablehlo.reduce_scatter",
                         "stablehlo.all_reduce", "stablehlo.collective_permute", "stablehlo.collective_broadcast")
MANIFEST_FORMAT = "laplace_passes.stablehlo_export/1"


@dataclass
class StableHLOExport:
    out_dir: Path
    manifest: dict
    report: Report

    @property
    def findings(self) -> list:
        """The Neuron preflight's findings on the exported graphs (`laplace_passes.preflight`'s checks, run on
        the graphs as lowered); [] when clean or when the target is not a Neuron target."""
        return _preflight_findings(self.report)

    def path(self, graph: str) -> Path:
        for entry in self.manifest["graphs"]:
            if entry["name"] == graph:
                return self.out_dir / entry["file"]
        raise LookupError(f"no graph {graph!r}; exported: {', '.join(g['name'] for g in self.manifest['graphs'])}")


def export_stablehlo(
    model_or_fn: Callable, *example_inputs: Any, target: Any = "trn2", out_dir: str | Path, overwrite: bool = False,
    **options: Any,
) -> StableHLOExport:
    """Lower every graph of `model_or_fn(*example_inputs)` and write one .mlir per graph plus manifest.json.

    `out_dir` is written whole or not at all; a non-empty one is refused
    unless `overwrite=True`, which replaces it (NOTE [output directories] in
    `laplace_passes.infra.files`). Everything is checked before the graphs are captured.
    """
    # Checked here, not first inside the compile, where Dynamo would wrap the install hint in its own error.
    torch_mlir_fx("export_stablehlo")
    check_callable(model_or_fn)
    _refuse_meta_tensors(model_or_fn, example_inputs)
    check_output_dir(out_dir, overwrite)
    compiler = _ExportCompiler()
    config = CompileConfig.from_options(entry_point_options("export_stablehlo", options, target=target, inner=compiler))
    if config.target.logical_cores is not None:  # a Neuron target: check what neuronx-cc would reject
        compiler.preflight = "report"
    report = capture_graphs(model_or_fn, example_inputs, config)
    captured = compiler.captured
    with staged_directory(out_dir, overwrite) as staging:
        manifest = _write_export(staging, report, config.target, captured, compiler.layouts)
    return StableHLOExport(Path(out_dir), manifest, report)


def _preflight_findings(report: Report) -> list:
    """Every graph's preflight findings in `report`, in order (`preflight_records`), then the graph breaks'."""
    return [f for record in preflight_records(report) for f in record.findings] + graph_break_findings(report)


def _refuse_meta_tensors(model_or_fn: Callable, example_inputs: tuple) -> None:
    """A meta-device model has no weights to lower: torch-mlir would fail on some op, naming only the op."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if isinstance(model_or_fn, torch.nn.Module):
        tensors += [*model_or_fn.parameters(), *model_or_fn.buffers()]
    if any(t.device.type == "meta" for t in tensors):
        raise ValueError("export_stablehlo: the model (or an input) lives on the meta device (no weights to lower); "
                         "build it on a real device, or use laplace_passes.inspect to see its graphs and sizes")


def _write_export(out_dir: Path, report: Report, target: HardwareTarget, captured: list[tuple[str, LoweredGraph]],
                  layouts: list[OutputLayout | None]) -> dict:
    """Write each graph's .mlir and manifest.json into `out_dir`; return the manifest."""
    entries = [
        _write_graph(out_dir, name, kind, lowered, target)
        for name, (kind, lowered) in zip(_graph_names(report, len(captured)), captured, strict=True)
    ]
    for entry, (kind, lowered), layout in zip(entries, captured, layouts, strict=True):
        _label_outputs(entry, kind, lowered, layout)
    _name_input_sources(entries, report)
    manifest = {
        "format": MANIFEST_FORMAT,
        "target": report.target,
        "versions": _versions(),
        "notes": _notes(report, entries, captured),
        "graphs": entries,
    }
    if target.logical_cores is not None:
        manifest["neuron_preflight"] = [str(f) for f in _preflight_findings(report)]
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _notes(report: Report, entries: list[dict], captured: list[tuple[str, LoweredGraph]]) -> list[str]:
    """What a reader of the manifest must know about these modules; only what applies to them."""
    notes = []
    if any(site.status == "retiled" and site.gates.startswith("checked at run time") for site in report.sites):
        notes.append("laplace::check_gates is lowered as clamp(gk, max=0): lowered graphs do not refuse positive "
                     "gates (see laplace_passes.lowering.legalize)")
    if report.traffic:
        notes.append("collectives are StableHLO collectives over replica groups, the same module on every rank: "
                     "compile it for W replicas (laplace_passes.lowering.collectives)")
    in_f64 = [entry["name"] for entry, (_, lowered) in zip(entries, captured) if _computes_in_f64(lowered)]
    if in_f64:
        notes.append(f"{', '.join(in_f64)} compute in float64 (the model holds float64 tensors or ops): "
                     "neuronx-cc has no FP64; cast the model and its inputs to float32 or bfloat16 "
                     "(laplace_passes.preflight names the nodes)")
    if report.graph_breaks:
        dynamo_graphs = report.count("dynamo")
        notes.append(f"Dynamo compiled the function as {dynamo_graphs} graph{'s' * (dynamo_graphs != 1)}, with "
                     f"code outside them at {len(report.graph_breaks)} kind(s) of graph break: "
                     f"{'; '.join(report.graph_breaks)}. That code (a branch taken the example inputs' way, an op "
                     "run eagerly) is in none of these modules")
    return notes


def _computes_in_f64(lowered: LoweredGraph) -> bool:
    """Whether f64 is left in the module: the clean-up removes the lowering's own (constants, index
    arithmetic), so what is left is the model's."""
    return "f64" in lowered.text


class _ExportCompiler(StableHLOCompiler):
    """inner="stablehlo" that also keeps each graph's lowering (kind, LoweredGraph), in compile order."""

    def __init__(self) -> None:
        self.captured: list[tuple[str, LoweredGraph]] = []
        self.layouts: list[OutputLayout | None] = []  # what each graph's outputs are, in the same order

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str):
        self.captured.append((kind, lowered_graph(gm, example_inputs)))
        self.layouts.append(OutputLayout.of_compile())
        return make_boxed_func(gm.forward)


def _graph_names(report: Report, compiled: int) -> list[str]:
    """The report's name of each graph the inner compiler got, in compile order.

    A graph the budget pass cut into partitions reaches the inner compiler
    partition by partition: forward_0_partition_0, forward_0_partition_1, ...
    """
    names = []
    for record in report.graphs:
        if record.kind == "dynamo":
            continue
        size = getattr(record, "size", None)
        partitions = len(size.partitions) if size is not None else 0
        names += [f"{record.name}_partition_{i}" for i in range(partitions)] if partitions else [record.name]
    if len(names) != compiled:
        raise RuntimeError(f"the inner compiler got {compiled} graphs but the report lists {names}")
    return names


def _label_outputs(entry: dict, kind: str, lowered: LoweredGraph, layout: OutputLayout | None) -> None:
    """Each output's role (`output_roles`); a partition's outputs, whose layout is its cut's, get none."""
    roles = None if layout is None or "_partition_" in entry["name"] else \
        layout.roles(kind, lowered.output_positions, lowered.output_count)
    for spec, role in zip(entry["outputs"], roles or []):
        if role.get("role") == "updated input":
            role = {"role": "updated input", "updates_input": entry["inputs"][role["input"]]["name"]}
        spec.update(role)


def _name_input_sources(entries: list[dict], report: Report) -> None:
    """Give each input of a forward or inference module the user's name for it ("args[0][3]", "ids").

    Those graphs take their Dynamo graph's inputs in the same order (AOT Autograd flattens them); a
    backward graph takes saved values and tangents, a partition its cut's values: no user names.
    """
    sources = {g.name.removeprefix("dynamo_"): g.input_sources for g in report.graphs if g.kind == "dynamo"}
    for entry in entries:
        kind, _, index = entry["name"].partition("_")
        names = sources.get(index, [])
        if kind in ("forward", "inference") and len(names) == len(entry["inputs"]):
            for spec, source in zip(entry["inputs"], names):
                spec["source"] = source


def _write_graph(out_dir: Path, name: str, kind: str, lowered: LoweredGraph, target: HardwareTarget) -> dict:
    file, bytecode = f"{name}.mlir", f"{name}.mlirbc"
    (out_dir / file).write_text(lowered.text)
    (out_dir / bytecode).write_bytes(lowered.bytecode)
    entry = {"name": name, "kind": kind, "file": file, "bytecode": bytecode, **lowered.to_dict(),
             "collectives": {op: n for op, n in sorted(lowered.op_counts.items()) if op in STABLEHLO_COLLECTIVES}}
    if target.name in NEURON_TARGETS:
        entry["neuronx_cc"] = format_command(neuronx_cc_command(bytecode, target=target))
    return entry


def _versions() -> dict:
    versions = {"torch": torch.__version__}
    for package in ("torch-mlir", "laplace_passes"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions
