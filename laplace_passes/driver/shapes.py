"""Graphs with symbolic sizes: compiled as they are, or once per concrete shape.

Dynamo hands the backend a graph with symbolic sizes when a dimension
changed between calls (automatic dynamic shapes), with `dynamic=True`, or
for a dimension marked with `torch._dynamo.mark_dynamic`. What happens to
it depends on what the compile is for:

* Inner compilers that take dynamic shapes (eager, inductor, a callable) on
  a target without a graph-size budget (cpu) get the graph as it is. GLA
  sites are still re-tiled; with a dynamic T the chunk-loop op stays a
  runtime loop over chunks (NOTE [dynamic T] in `laplace_passes.fx.retile`).
* Static-shape compiles (a target with `static_shapes`, trn2; an inner
  compiler with `static_shapes`, the lowering ones; or a graph-instruction
  budget, which is measured on static shapes) get one static compile per
  concrete shape, made at the first call with that shape: see NOTE
  [specialising per shape]. That is what TorchNeuron does itself (it
  rejects dynamic=True and recompiles per shape), and each shape runs the
  same code as a static compile would: unrolled, sized, partitioned.
  So is a graph that scans over a dynamic length, on any target
  (`scan_over_dynamic_length`, NOTE [scans over a dynamic length]).

Either way the report names the dynamic dimensions (`Report.dynamic_dims`),
counts the shapes specialised (`Report.specialised`) and, for Neuron
targets, says how to compile once instead.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch
import torch._dynamo
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from laplace_passes.driver.config import CompileConfig
from laplace_passes.fx.algebra_terms import SYMBOLIC_SIZE
from laplace_passes.infra.report import RecurrenceRecord, Report
from laplace_passes.infra.fx_helpers import (
    COND, SCAN, WHILE_LOOP, dynamic_dims, fake_value, is_static, replace_uses, subgraph, tensor_values,
)
from laplace_passes.lowering.neuron import NEURON_ADVICE

# Dynamo keeps a node's fake value under this key (AOT graphs: "val").
_DYNAMO_KEY = "example_value"


def static_shapes_reason(config: CompileConfig) -> str:
    """Why this compile needs static shapes ("" when it does not)."""
    if config.target.static_shapes:
        return f"target {config.target.name} compiles static shapes only"
    if config.inner.static_shapes:
        return f"inner compiler {config.inner.name} takes static shapes only"
    if config.max_graph_instructions is not None:
        return "the graph-instruction budget is measured, and graphs cut, at static shapes"
    return ""


def scan_over_dynamic_length(gm: torch.fx.GraphModule) -> str:
    """Why `gm` itself needs static shapes whatever the compile ("" when it does not).

    NOTE [scans over a dynamic length]: AOT Autograd fails on a `scan` whose scanned length is a symbol
    ("scan might be aliasing the input or the output", torch 2.13, with any backend), which is what Dynamo
    hands over once a model that scans over its tokens (`plain-tiny`) is called with a second length. Such
    a graph is compiled once per shape, as for a static-shape target: each length is a static scan that
    recognition re-tiles (or, when it is not a GLA, that AOT Autograd traces)."""
    for scan in gm.graph.find_nodes(op="call_function", target=SCAN):
        length = _scanned_length(scan)
        if length is not None:
            return (f"{scan.name} scans over a dynamic length ({length}), which torch's AOT Autograd cannot "
                    "trace; at a static length the passes can recognise and re-tile it")
    return ""


def _scanned_length(scan: torch.fx.Node) -> torch.SymInt | None:
    """The symbolic length a scan node runs over (its inputs' leading size); None when it is static."""
    xs = scan.args[2] if len(scan.args) > 2 else []
    for x in xs:
        value = fake_value(x)
        if isinstance(value, torch.Tensor) and value.dim() and not is_static(value.shape[0]):
            return value.shape[0]
    return None


def loops_declined_at_symbolic_sizes(report: Report, graph: str) -> list[RecurrenceRecord]:
    """The loops of `graph` that recognition declined because a size was symbolic
    (NOTE [loops declined at symbolic sizes])."""
    return [r for r in report.recurrences
            if r.graph == graph and r.status == "declined" and f": {SYMBOLIC_SIZE}" in (r.reason or "")]


def sizes_left_to_dynamo(gm: torch.fx.GraphModule) -> bool:
    """Whether Dynamo chose the graph's symbolic sizes itself (automatic dynamic shapes, after a second
    shape), not the user: no `dynamic=True`, no input marked with `torch._dynamo.mark_dynamic`.

    NOTE [loops declined at symbolic sizes]: recognition reads loops of static sizes only. A model with a
    GLA written as a token loop or a scan, trained at batch 32 and then given one batch of 20 (an epoch's
    last), gets from Dynamo a graph with a symbolic batch, whose loops recognition declines; that graph
    then serves every later batch, 32 included, so training would go on with the loop un-tiled. Where the
    symbolic sizes were Dynamo's choice, the backend compiles such a graph once per shape instead (NOTE
    [specialising per shape]), each shape's loops re-tiled, and says so in the report's notes. Where the
    user asked for a dynamic graph, the graph stays one graph and its loops are declined with the reason.
    """
    if not torch._dynamo.config.assume_static_by_default:  # torch.compile(dynamic=True)
        return False
    for node in gm.graph.find_nodes(op="placeholder"):
        grapharg = node.meta.get("grapharg")
        example = getattr(grapharg, "_example", None)
        example = example() if callable(example) else example  # a weak reference to the user's tensor
        if isinstance(example, torch.Tensor) and getattr(example, "_dynamo_dynamic_indices", None):
            return False
    return True


def report_dynamic_dims(gm: torch.fx.GraphModule, config: CompileConfig) -> list[str]:
    """Record the graph's dynamic dimensions in the report (and, for Neuron, what to do); return every
    symbolic size.

    The report leaves out sizes Dynamo traced as symbols and then specialised to one value (a token loop's
    `range(T)` fixes T): they take no other value in this graph. They are still symbols in it, so they are
    returned, and a static-shape compile still goes through the per-shape compiler.
    """
    report = config.report
    shown = dynamic_dims(gm, include_specialised=False)
    report.dynamic_dims += [d for d in shown if d not in report.dynamic_dims]
    if shown and _neuron(config) and NEURON_ADVICE not in report.notes:
        report.notes.append(NEURON_ADVICE)
    return dynamic_dims(gm)


def _neuron(config: CompileConfig) -> bool:
    return config.target.static_shapes or config.inner.for_neuron


class PerShapeCompiler:
    """The backend's callable for a graph with symbolic sizes on a static-shape compile.

    NOTE [specialising per shape]
    Before (what Dynamo hands over after a second length, trn2):

        def forward(self, s70: "Sym(s70)", l_input_ids_: "i64[1, s70]", ...):
            view: "f32[1, s70, 2, 32]" = linear.view(1, s70, 2, 32)
            gla_default = torch.ops.laplace.gla.default(view, ...)

    After: nothing is compiled yet. At each call the inputs' shapes are
    looked up; a new shape gets a copy of the graph whose fake values are
    recomputed from the call's inputs in a fake mode without symbols, so
    every size is an int, and that copy goes through the whole pipeline
    like a graph Dynamo traced with static shapes:

        call with l_input_ids_ [1, 48]:   view: "f32[1, 48, 2, 32]"   1 chunk of 128, unrolled
        call with l_input_ids_ [1, 300]:  view: "f32[1, 300, 2, 32]"  3 chunks, unrolled

    Each compiled shape is kept and listed in the report. Dynamo's
    recompile limit does not apply (this is one Dynamo graph), so once a
    graph has more shapes than that limit (`torch._dynamo.config.recompile_limit`,
    8 by default) a `UserWarning` says so, once, with the way to fewer
    compiles: each shape is a compile of its own (a neuronx-cc run on Neuron).
    """

    def __init__(self, gm: torch.fx.GraphModule, compile_static: Callable, config: CompileConfig,
                 reason: str) -> None:
        self.gm = gm
        self.compile_static = compile_static  # (static graph module, example inputs) -> callable
        self.config = config
        self.reason = reason  # why static shapes (`static_shapes_reason`)
        self.compiled: dict[tuple, Callable] = {}
        # Inputs that are numbers (sizes, floats Dynamo made dynamic): constants in each specialised graph.
        self.is_number = [_is_number_input(n) for n in gm.graph.find_nodes(op="placeholder")]

    def __call__(self, *args: Any) -> Any:
        key = tuple(_number(a) if number else _shape_key(a) for a, number in zip(args, self.is_number, strict=True))
        compiled = self.compiled.get(key)
        if compiled is None:
            static = specialise(self.gm, list(args))
            self.config.report.specialised.append(_describe(self.gm, args))
            compiled = self.compiled[key] = self.compile_static(static, self._without_numbers(args))
            if len(self.compiled) == torch._dynamo.config.recompile_limit + 1:
                self._warn_many_shapes()
        return compiled(*self._without_numbers(args))

    def _warn_many_shapes(self) -> None:
        """Too many static compiles of one graph: say so in the report and as a warning."""
        dims = "; ".join(dynamic_dims(self.gm, include_specialised=False))
        message = (
            f"laplace_passes: one graph has now been compiled for {len(self.compiled)} shapes, more than "
            f"torch._dynamo.config.recompile_limit ({torch._dynamo.config.recompile_limit}), each a static "
            f"compile of its own ({self.reason}); dynamic dimensions: {dims}. "
            "Pad token inputs to a few lengths (laplace_passes.compile(model, seq_buckets=[...])) "
            "or keep the changing dimension static"
        )
        self.config.report.notes.append(message)
        warnings.warn(message, stacklevel=2)

    def _without_numbers(self, args: tuple) -> list:
        return [a for a, number in zip(args, self.is_number, strict=True) if not number]


def specialise(gm: torch.fx.GraphModule, args: list) -> torch.fx.GraphModule:
    """A copy of Dynamo's graph `gm` for the inputs `args` (real inputs): every size static.

    Numbers Dynamo passes as inputs (a size, `Sym(s70)`; with dynamic=True
    a float attribute, as a 0-d tensor read by `.item()`) become
    constants, and their placeholders go: the copy takes only the other
    inputs. Fake values are recomputed from `args` in a
    fake mode without symbols. Parameters and submodules are shared with
    `gm`; only the graph and the fake values are new.
    """
    static = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    static.meta = dict(gm.meta)
    kept = []
    for node, arg in zip(list(static.graph.find_nodes(op="placeholder")), args, strict=True):
        if not _is_number_input(node):
            kept.append(arg)
        else:
            _replace_by_constant(node, _number(arg))
    static.recompile()
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # no ShapeEnv: sizes are ints
    FakeTensorProp(static, mode).propagate(*kept)
    _take_values(static.graph, gm.graph)
    _specialise_bodies(static, mode)
    leftover = [n.name for n in static.graph.nodes if not is_static(fake_value(n))]
    if leftover:  # a data-dependent size: fake values alone cannot make it static
        raise RuntimeError(f"specialising a graph per shape left symbolic sizes on {leftover[:5]}")
    return static


def _specialise_bodies(gm: torch.fx.GraphModule, mode: FakeTensorMode) -> None:
    """The loop bodies and branches `gm` calls, copied and given static fake values from their operands'.

    A scan's body keeps the fake values Dynamo traced it with (the batch symbolic, say); the unroll pass
    copies them with the body's nodes, and recognition reads static sizes only. Copies, so that `gm`'s
    original graph (shared submodules) keeps its own."""
    for node in list(gm.graph.nodes):
        for attr, values in _body_calls(node):
            original = subgraph(gm, attr)
            body = copy.deepcopy(original)
            setattr(gm, attr.target, body)
            FakeTensorProp(body, mode).propagate_dont_convert_inputs(*values)
            _take_values(body.graph, original.graph)
            _specialise_bodies(body, mode)


def _body_calls(node: torch.fx.Node) -> list[tuple[torch.fx.Node, list]]:
    """(get_attr node of a body, the fake values the body is called with) for a loop or a cond; [] for any
    other node. A scanned or mapped input's value in the body is its first slice."""
    def values(operands):
        return [fake_value(x) if isinstance(x, torch.fx.Node) else x for x in operands]

    def first_slices(operands):
        return [fake_value(x)[0] for x in operands]

    if node.op != "call_function":
        return []
    args = node.args
    if node.target is SCAN:  # scan(combine_fn, init, xs, additional_inputs)
        return [(args[0], [*values(args[1]), *first_slices(args[2]), *values(args[3])])]
    if node.target is WHILE_LOOP:  # while_loop(cond_fn, body_fn, carried_inputs, additional_inputs)
        return [(fn, values([*args[2], *args[3]])) for fn in args[:2]]
    if node.target is COND:  # cond(pred, true_fn, false_fn, operands)
        return [(fn, values(args[3])) for fn in args[1:3]]
    if node.target is torch.ops.higher_order.map_impl:  # map_impl(f, xs, pos_args)
        return [(args[0], [*first_slices(args[1]), *values(args[2])])]
    return []


def _take_values(static: torch.fx.Graph, original: torch.fx.Graph) -> None:
    """Put the fake values FakeTensorProp left under "val" where Dynamo's graphs keep them, marked as
    requiring grad where the original graph's values were: FakeTensorProp keeps detached values, and the
    passes read from `requires_grad` whether gradients flow through a value (a GLA site's form)."""
    requiring = {node.name for node in original.nodes
                 if any(t.requires_grad for t in tensor_values(node.meta.get(_DYNAMO_KEY)))}
    for node in static.nodes:
        value = node.meta[_DYNAMO_KEY] = node.meta.pop("val", None)
        if node.name in requiring:
            for tensor in tensor_values(value):
                if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
                    tensor.requires_grad_(True)


def _replace_by_constant(node: torch.fx.Node, value: int | float) -> None:
    """Every use of the input `node` reads `value` instead (its `.item()` calls too); `node` goes."""
    for user in [u for u in node.users if _is_item(u)]:
        user.replace_all_uses_with(node)
        node.graph.erase_node(user)
    replace_uses(node, value)
    node.graph.erase_node(node)


def _is_number_input(node: torch.fx.Node) -> bool:
    """A size input, or a 0-d tensor input read only by `.item()` (a float Dynamo made dynamic)."""
    if isinstance(fake_value(node), torch.SymInt):
        return True
    value = fake_value(node)
    return (isinstance(value, torch.Tensor) and value.dim() == 0 and bool(node.users)
            and all(_is_item(u) for u in node.users))


def _is_item(node: torch.fx.Node) -> bool:
    return node.op == "call_method" and node.target == "item"


def _number(value: Any) -> int | float:
    return value.item() if isinstance(value, torch.Tensor) else value


def _shape_key(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, str(value.device))
    return ("value", value)


def _describe(gm: torch.fx.GraphModule, args: tuple) -> str:
    """The shapes of the inputs with dynamic sizes, e.g. "l_input_ids_ [1, 48]"."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    parts = [
        f"{node.name} {list(arg.shape)}" for node, arg in zip(placeholders, args)
        if isinstance(arg, torch.Tensor) and not all(is_static(t) for t in tensor_values(fake_value(node)))
    ]
    return ", ".join(parts) or "the same shapes, other strides"
