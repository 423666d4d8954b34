"""The Neuron preflight's checks: one function per thing neuronx-cc or TorchNeuron rejects.

Each takes an ATen graph (fake values in meta["val"]) and the target and
returns `Finding`s that name the node, say what is wrong and how to fix it.
`check_graph` runs them all; `laplace_passes.lowering.preflight` runs
`check_graph` as a pass and as a function users call.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import asdict
from typing import Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

from laplace_passes.infra.fx_helpers import (
    COND,
    fake_tensor,
    fake_value,
    hop_name,
    is_collective,
    is_loop,
    is_static,
    resolve_process_group,
)
from laplace_passes.infra.op_facts import op_name
from laplace_passes.lowering.collectives import LOWERED, CollectiveLoweringError
from laplace_passes.lowering.diagnose import LoweringError, lower_each_op
from laplace_passes.lowering.finding import Finding
from laplace_passes.lowering.hlo_checks import check_stablehlo
from laplace_passes.lowering.stablehlo import lower_to_stablehlo
from laplace_passes.infra.pass_base import Declined
from laplace_passes.infra.strict import strict_mode
from laplace_passes.infra.targets import HardwareTarget, runtime_target
from laplace_passes.unroll.partition import plan_partitions
from laplace_passes.unroll.size import SizeModel

FLOAT64 = (torch.float64, torch.complex128)


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
                            f"{_shape(node)}; neuronx-cc compiles static shapes only",
                            "compute a fixed-size result instead: keep every element and mask it (torch.where, "
                            "a multiplied 0/1 mask), or pad to a fixed upper bound")]
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


def check_control_flow(gm: torch.fx.GraphModule, target: HardwareTarget) -> list[Finding]:
    """A `cond` left in the graph, on a target whose compiler takes no control flow."""
    if target.control_flow:
        return []
    return [
        Finding("control-flow", n.name, "higher_order.cond", f"a cond is left in the graph; {target.name}'s "
                "compiler does not implement control flow and torch-mlir's FX importer does not import cond",
                "compute both branches and pick with torch.where, or branch in Python on a value known at "
                "compile time (for a Muon step: let the all-to-all rewrite take its branch-free plan)")
        for n in gm.graph.nodes if n.op == "call_function" and n.target is COND
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


F64_FIX = ("cast the model to float32/bfloat16: model.float() or model.to(torch.bfloat16), and pass float32 "
           "inputs (token ids stay integer: .long())")


def check_float64_entries(model_or_fn: object, example_inputs: tuple) -> list[Finding]:
    """float64 parameters, buffers and inputs, named before anything is traced.

    Checked ahead of the graphs because an op may refuse float64 outright
    (laplace's GLA does): its TypeError would stop the capture, and a finding
    that names the parameter says more than a graph placeholder would.
    """
    findings = []
    if isinstance(model_or_fn, torch.nn.Module):
        for kind, named in (("parameter", model_or_fn.named_parameters()), ("buffer", model_or_fn.named_buffers())):
            found = _f64_named(named)
            if found:
                findings.append(_f64_entry(found[0][0], kind, f"{len(found)} {kind}(s) ({_first_names(found)})"))
    flat, _ = pytree.tree_flatten_with_path(example_inputs)
    for path, value in flat:
        if _is_f64(value):
            name = f"input{pytree.keystr(path)}"
            findings.append(_f64_entry(name, "input", f"{name} {value.dtype} {list(value.shape)}"))
    return findings


def float64_refusal(error: BaseException) -> Finding | None:
    """An op's refusal of float64 (laplace's GLA: "q must have dtype in (...), got torch.float64") as a finding."""
    if not (isinstance(error, TypeError) and str(error).endswith(("got torch.float64", "got torch.complex128"))):
        return None
    return _f64_entry("(traced)", "op", f"an op refused a float64 tensor computed inside the model ({error})")


def _f64_named(named) -> list[tuple[str, torch.Tensor]]:
    return [(name, value) for name, value in named if _is_f64(value)]


def _first_names(found: list[tuple[str, torch.Tensor]], shown: int = 3) -> str:
    names = ", ".join(name for name, _ in found[:shown])
    return names + (f" and {len(found) - shown} more" if len(found) > shown else "")


def _f64_entry(node: str, op: str, what: str) -> Finding:
    return Finding("f64", node, op, f"float64: {what}; neuronx-cc has no FP64 (Trainium has no f64 arithmetic)",
                   F64_FIX)


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


def check_collectives(gm: torch.fx.GraphModule, target: HardwareTarget) -> list[Finding]:
    """Collectives the StableHLO lowering has no form for, group sizes the target's runtime refuses, and
    all-to-alls with unequal splits (in either direction)."""
    findings = []
    for node in gm.graph.nodes:
        if not is_collective(node):
            continue
        name = node.target.overloadpacket.__name__.split(".")[-1]
        args = collective_arguments(node)
        if name not in LOWERED:
            findings.append(Finding(
                "collective", node.name, op_name(node),
                f"laplace_passes has no StableHLO form for {name} (it lowers {', '.join(LOWERED[:-1])})",
                "express it with those collectives (a broadcast is an all_gather of the source's tensor and a "
                "select; a list all_gather is all_gather_into_tensor and a view)"))
        if name == "all_to_all_single":
            findings += _unequal_splits(node, args, target)
        size = _group_size(args)
        if size is not None and size > 1 and not target.collectives.group_size_supported(size):
            findings.append(Finding(
                "collective-group-size", node.name, op_name(node),
                f"the {name} spans a group of {size} ranks; {target.name} supports groups of "
                f"{_supported_sizes(target.collectives)}",
                "run it over a process group of a supported size (e.g. sub-groups of 4, 8 or 16 ranks "
                "starting at a multiple of the group size)"))
    return findings


def collective_arguments(node: torch.fx.Node) -> dict:
    """A functional collective's arguments by schema name (input, group_size, group_name, ...)."""
    schema = node.target._schema
    values = dict(zip((a.name for a in schema.arguments), node.args))
    values.update(node.kwargs)
    return values


def _unequal_splits(node: torch.fx.Node, args: dict, target: HardwareTarget) -> list[Finding]:
    findings = []
    for which in ("input_split_sizes", "output_split_sizes"):
        splits = args.get(which)
        if not splits:
            continue
        if any(isinstance(s, torch.fx.Node) for s in splits):
            findings.append(Finding(
                "all-to-all-splits", node.name, op_name(node),
                f"its {which.replace('_', ' ')} are computed at run time; {target.name}'s all-to-all accepts "
                "equal splits only and StableHLO's all_to_all has no split sizes",
                "pad every shard to one fixed size so that the splits are equal constants"))
        elif len(set(splits)) > 1:
            findings.append(Finding(
                "all-to-all-splits", node.name, op_name(node),
                f"{which.replace('_', ' ')} {list(splits)} are unequal; {target.name}'s all-to-all accepts "
                "equal splits only",
                "pad every shard to the largest split with zero rows so that all splits are equal "
                "(laplace's Muon all-to-all rewrite pads shards this way)"))
    return findings


def check_lowering(gm: torch.fx.GraphModule, target: HardwareTarget) -> list[Finding]:
    """Try the lowering to StableHLO; name each node it cannot lower, or check what it produced.

    A graph that lowers gets the StableHLO checks (`hlo_checks`: element
    types, dynamic dimensions, ops, custom calls, control flow, integer
    matmuls, the HBM estimate) on the module neuronx-cc would receive.

    Loops, conds and collectives without a StableHLO form are other checks'
    findings, and the importer fails on them as a whole: with any of them in
    the graph, every other op is lowered on its own instead.
    """
    if any(_not_lowered(n) or is_loop(n) or n.target is COND for n in gm.graph.nodes):
        failures = lower_each_op(gm, skip=is_collective)
    else:
        try:
            lowered = lower_to_stablehlo(gm)
            return check_stablehlo(lowered.text, target)
        except LoweringError as error:
            if isinstance(error.__cause__, CollectiveLoweringError):
                return [Finding("collective", "(graph)", "", str(error), "see the collective's message: equal "
                                "all-to-all splits, a process group whose replica groups are known")]
            failures = error.unlowerable
            if not failures:
                return [Finding("unlowerable-op", "(graph)", "", f"torch-mlir could not lower the graph, though "
                                f"each op lowers on its own ({error})", "report it with the exported graph")]
    return [
        Finding("unlowerable-op", u.node, u.op, f"torch-mlir cannot lower this op ({u.detail})", _lowering_fix(u.op))
        for u in failures
    ]


def _not_lowered(node: torch.fx.Node) -> bool:
    """A collective without a StableHLO form (check_collectives names it)."""
    return is_collective(node) and node.target.overloadpacket.__name__.split(".")[-1] not in LOWERED


def check_graph(
    gm: torch.fx.GraphModule, target: str | HardwareTarget = "trn2", graph_name: str = "",
    partition_budget: int | None = None,
) -> list[Finding]:
    """Every check over one ATen graph (with fake values in meta["val"]); see the module docstring.

    A Neuron target is checked at the runtime's logical NeuronCore config
    (NEURON_LOGICAL_NC_CONFIG, when set: `targets.runtime_target`). A check
    that fails inside is itself a finding that names it; the others still run.
    """
    target = runtime_target(target)
    run = functools.partial(_run_check, gm, target)
    dynamic, aten_f64 = run(check_dynamic_shapes), run(check_float64)
    lowered = run(check_lowering)
    # The ATen finding names the node where f64 or a symbol enters; the lowered module's say no more
    # (a symbolic graph's module is full of shape arithmetic: tensor.dim, arith.index_cast).
    if dynamic:  # and a graph-level failure of the lowering is the symbol's doing too
        lowered = [f for f in lowered if f.check == "internal-error" or (f.check == "unlowerable-op"
                                                                          and f.node != "(graph)")]
    collectives = run(check_collectives)
    said = {"stablehlo-dtype": bool(aten_f64), "collective": bool(collectives)}
    findings = [
        *dynamic,
        *run(check_loops),
        *run(check_control_flow),
        *aten_f64,
        *run(check_instruction_budget, partition_budget),
        *collectives,
        *[f for f in lowered if not said.get(f.check)],
    ]
    return [Finding(**{**asdict(f), "graph": graph_name}) for f in findings]


def _run_check(gm: torch.fx.GraphModule, target: HardwareTarget, check: Callable, *args) -> list[Finding]:
    """`check`'s findings; an exception inside it becomes a finding that names the check (strict: raised)."""
    try:
        return check(gm, target, *args)
    except Exception as error:  # noqa: BLE001  the preflight reads; it never stops the user's work
        if strict_mode():
            raise
        return [Finding("internal-error", "(graph)", check.__name__,
                        f"the {check.__name__} check failed inside ({type(error).__name__}: {error}); its finding(s), "
                        "if any, are missing and the other checks ran",
                        "report it to laplace_passes with the graph (report.graph('after', name).code)")]


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


def _group_size(args: dict) -> int | None:
    """Ranks in a collective's group: its group_size argument, one split per rank, else the process group's."""
    if isinstance(args.get("group_size"), int):
        return args["group_size"]
    splits = args.get("input_split_sizes") or args.get("output_split_sizes")
    if splits:
        return len(splits)
    process_group = resolve_process_group(args.get("group_name"))
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
