"""The Neuron preflight's checks: one function per thing neuronx-cc or TorchNeuron rejects.

Each takes an ATen graph (fake values in meta["val"]) and the target and
returns `Finding`s that name the node, say what is wrong and how to fix it.
`check_graph` runs them all; `laplace_passes.lowering.preflight` runs
`check_graph` as a pass and as a function users call.
"""

from __future__ import annotations

import operator
from dataclasses import asdict

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import (
    fake_tensor,
    fake_value,
    hop_name,
    is_loop,
    is_static,
    resolve_process_group,
)
from laplace_passes.infra.op_facts import op_name
from laplace_passes.lowering.diagnose import LoweringError, lower_each_op
from laplace_passes.lowering.finding import Finding
from laplace_passes.lowering.hlo_checks import check_stablehlo
from laplace_passes.lowering.stablehlo import lower_to_stablehlo
from laplace_passes.infra.pass_base import Declined
from laplace_passes.infra.targets import HardwareTarget, runtime_target
from laplace_passes.unroll.partition import plan_partitions
from laplace_passes.unroll.size import SizeModel

FLOAT64 = (torch.float64, torch.complex128)
ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default


def check_dynamic_shapes(gm: torch.fx.GraphModule, target: HardwareTarget) -> list[Finding]:
    """Inputs with symbolic sizes; else the first node whose size is symbolic (data-dependent)."""
    fix = ("compile with static shapes: dynamic=False (laplace_passes.compile's default) and no "
           "torch._dynamo.mark_dynamic; pad variable lengths to a few fixed buckets")
    findings = [
        Finding("dynamic-shape", n.name, "input", f"{_what_is_symbolic(n)}; neuronx-cc compiles static "
                "shapes only (TorchNeuron rejects dynamic=True)", fix)
        for n in gm.graph.find_nodes(op="placeholder") if not is_static(fake_value(n))
    ]
    if findings:
        return findings
    for node in gm.graph.nodes:
        if node.op == "call_function" and not is_static(fake_value(node)):
            return [Finding("dynamic-shape", node.name, op_name(node), f"produces a data-dependent shape "
                            f"{_shape(node)}; neuronx-cc compiles static shapes only", fix)]
    return []


def check_loops(gm: torch.fx.GraphModule, target: HardwareTarget) -> list[Finding]:
    return [
        Finding("loop", n.name, f"higher_order.{hop_name(n)}", f"a {hop_name(n)} loop is left in the graph; "
                "torch-mlir's FX importer does not import it and neuronx-cc accepts only loops unrolled "
                "with a static trip count",
                "unroll it before lowering: a Python loop over range(n) with a static n, or laplace's "
                "unroll passes for chunk-sequential scans")
        for n in gm.graph.nodes if is_loop(n)
    ]


def check_float64(gm: torch.fx.GraphModule, target: HardwareTarget) -> list[Finding]:
    """Each place f64 enters the graph (inputs, constants, and ops producing f64 from non-f64 inputs)."""
    findings = []
    for node in gm.graph.nodes:
        value = _value(gm, node)
        if node.op not in ("placeholder", "get_attr", "call_function") or not _is_f64(value):
            continue
        if any(_is_f64(_value(gm, arg)) for arg in node.all_input_nodes):
            continue  # f64 flowing on: the finding is where it came from
        op = {"placeholder": "input", "get_attr": "constant"}.get(node.op) or op_name(node)
        findings.append(Finding(
            "f64", node.name, op, f"produces {value.dtype} {list(value.shape)}; Trainium has no f64 "
            "arithmetic and TorchNeuron silently demotes f64 to f32, so results differ from what you tested",
            "compute in float32 or bfloat16: cast inputs and parameters (.float()), avoid dtype=torch.float64 "
            "and torch.set_default_dtype(torch.float64)"))
    return findings


def _value(gm: torch.fx.GraphModule, node: torch.fx.Node):
    """A node's (fake) value; for an attribute read (a tensor constant) the attribute itself."""
    value = fake_value(node)
    if value is None and node.op == "get_attr":
        try:
            value = operator.attrgetter(node.target)(gm)
        except AttributeError:
            return None
    return value


def check_instruction_budget(
    gm: torch.fx.GraphModule, target: HardwareTarget, partition_budget: int | None = None
) -> list[Finding]:
    """Over the target's budget by the unroll issue's SizeModel, and not cut to fit by the budget pass.

    `partition_budget` is the compile's max_graph_instructions: the budget
    pass (laplace_passes.unroll.FitGraphToBudget) cuts a graph over it into
    partitions compiled one by one, so such a graph is a finding only when
    no cut fits, or when partitions may pass the target's own limit.
    """
    limit = target.max_graph_instructions
    if limit is None:
        return []
    size = SizeModel.for_target(target).measure(gm)
    if size.instructions <= limit:
        return []
    if partition_budget is None:
        why = "the budget pass is off (max_graph_instructions=None), so it is compiled whole"
    elif partition_budget > limit:
        why = f"max_graph_instructions={partition_budget:,} lets partitions pass it"
    else:
        try:
            plan_partitions(gm, size.per_node, partition_budget, refine=False)
            return []  # the budget pass will cut it into partitions that fit
        except Declined as declined:
            why = f"no cut fits it: {declined.reason}"
    heaviest = sorted(((n, c) for n, c in size.per_node.items() if c), key=lambda item: -item[1])[:3]
    listed = ", ".join(f"{node.name} {count:,}" for node, count in heaviest)
    node = heaviest[0][0]
    return [Finding(
        "instruction-budget", node.name, op_name(node),
        f"the graph's estimated {size.instructions:,} instructions pass {target.name}'s budget of {limit:,} "
        f"(neuronx-cc: [XTP002] Number of instructions is over the threshold) and {why}; largest: {listed}",
        "let the budget pass cut the graph (max_graph_instructions at most the target's budget), split the "
        "largest ops (shorter sequences or fewer layers per graph)")]


def check_all_to_all(gm: torch.fx.GraphModule, target: HardwareTarget) -> list[Finding]:
    rules = target.collectives
    findings = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not ALL_TO_ALL:
            continue
        _, output_splits, input_splits, group_name = node.args[:4]
        splits = [s for s in (input_splits, output_splits) if s]
        if rules.all_to_all_equal_splits_only and any(len(set(s)) > 1 for s in splits):
            uneven = next(s for s in splits if len(set(s)) > 1)
            findings.append(Finding(
                "all-to-all-splits", node.name, op_name(node),
                f"split sizes {list(uneven)} are unequal; {target.name}'s all-to-all accepts equal splits only",
                "pad every shard to the largest split with zero rows so that all splits are equal "
                "(laplace's Muon all-to-all rewrite pads shards this way)"))
        size = _group_size(group_name, splits)
        if size is not None and not rules.group_size_supported(size):
            findings.append(Finding(
                "all-to-all-group-size", node.name, op_name(node),
                f"the all-to-all spans a group of {size} ranks; {target.name} supports groups of "
                f"{_supported_sizes(rules)}",
                "run the all-to-all over a process group of a supported size (e.g. sub-groups of 4, 8 or 16 "
                "ranks starting at a multiple of the group size)"))
    return findings


def check_lowering(gm: torch.fx.GraphModule, target: HardwareTarget) -> list[Finding]:
    """Try torch-mlir's lowering; name each node it cannot lower, or check what it produced.

    A graph that lowers gets the StableHLO checks (`hlo_checks`: element
    types, dynamic dimensions, ops, custom calls, loops, integer matmuls,
    the HBM estimate) on the module neuronx-cc would receive.

    Loops are check_loops' findings, and torch-mlir's importer fails on them
    as a whole; collectives are lowered by TorchNeuron's own legalization,
    not by upstream torch-mlir. With either in the graph, every other op is
    lowered on its own instead of the graph as a whole.
    """
    if any(_lowered_elsewhere(n) or is_loop(n) for n in gm.graph.nodes):
        failures = lower_each_op(gm, skip=_lowered_elsewhere)
    else:
        try:
            lowered = lower_to_stablehlo(gm)
            return check_stablehlo(lowered.text, target)
        except LoweringError as error:
            failures = error.unlowerable
            if not failures:
                return [Finding("unlowerable-op", "(graph)", "", f"torch-mlir could not lower the graph, though "
                                f"each op lowers on its own ({error})", "report it with the exported graph")]
    return [
        Finding("unlowerable-op", u.node, u.op, f"torch-mlir cannot lower this op ({u.detail})", _lowering_fix(u.op))
        for u in failures
    ]


def _lowered_elsewhere(node: torch.fx.Node) -> bool:
    """Collectives: TorchNeuron legalizes them itself (its collective_legalization pass)."""
    return node.op == "call_function" and op_name(node).startswith("_c10d_functional.")


def check_graph(
    gm: torch.fx.GraphModule, target: str | HardwareTarget = "trn2", graph_name: str = "",
    partition_budget: int | None = None,
) -> list[Finding]:
    """Every check over one ATen graph (with fake values in meta["val"]); see the module docstring.

    A Neuron target is checked at the runtime's logical NeuronCore config
    (NEURON_LOGICAL_NC_CONFIG, when set: `targets.runtime_target`).
    """
    target = runtime_target(target)
    dynamic, aten_f64 = check_dynamic_shapes(gm, target), check_float64(gm, target)
    lowered = check_lowering(gm, target)
    # The ATen finding names the node where f64 or a symbol enters; the lowered module's say no more
    # (a symbolic graph's module is full of shape arithmetic: tensor.dim, arith.index_cast).
    if dynamic:
        lowered = [f for f in lowered if f.check == "unlowerable-op"]
    said = {"stablehlo-dtype": bool(aten_f64)}
    findings = [
        *dynamic,
        *check_loops(gm, target),
        *aten_f64,
        *check_instruction_budget(gm, target, partition_budget),
        *check_all_to_all(gm, target),
        *[f for f in lowered if not said.get(f.check)],
    ]
    return [Finding(**{**asdict(f), "graph": graph_name}) for f in findings]


def _what_is_symbolic(node: torch.fx.Node) -> str:
    if fake_tensor(node) is not None:
        return f"has symbolic shape {_shape(node)}"
    return f"is a symbolic size ({fake_value(node)}) passed in as an input"


def _shape(node: torch.fx.Node) -> str:
    value = fake_value(node)
    if isinstance(value, torch.Tensor):
        return "[" + ", ".join(str(s) for s in value.shape) + "]"
    return str(value)


def _is_f64(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in FLOAT64


def _group_size(group_name, splits: list) -> int | None:
    """Ranks in the all-to-all's group: one split per rank, else the process group's size when it exists."""
    if splits:
        return len(splits[0])
    process_group = resolve_process_group(group_name)
    return None if process_group is None else process_group.size()


def _supported_sizes(rules) -> str:
    sizes = ", ".join(str(s) for s in rules.all_to_all_group_sizes)
    multiple = rules.all_to_all_group_size_multiple
    return f"{sizes} or a multiple of {multiple}" if multiple else sizes


def _lowering_fix(op: str) -> str:
    if op.startswith("laplace.gla"):
        return ("the re-tiling pass declined this GLA site (the report's GLA sites say why, e.g. a dynamic "
                "sequence length): make its shapes static so it becomes chunked GLA in standard ops")
    if op.startswith("laplace.chunked_gla"):
        return ("the unroll pass left this chunk-loop op in the graph (the report's unroll entry says why): "
                "it must become straight-line ATen code before lowering")
    if op.startswith("laplace."):
        return "replace this laplace op by standard ATen ops before lowering"
    return ("add a decomposition of this op into ops torch-mlir lowers (the decompositions of the inner "
            "compiler), or rewrite the model code that produces it")
