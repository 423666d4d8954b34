"""Unrolling `torch._higher_order_ops.scan` and `while_loop` with a static trip count.

NOTE [unrolling scan: before and after]
Before (Dynamo graph of `scan(combine, init, xs)` over 3 steps):

    scan = torch.ops.higher_order.scan(self.scan_combine_fn_0, [init], [xs], [w])
    carry = scan[0]; ys = scan[1]

After: one copy of the combine function per step, reading xs[t] from one unbind of xs:

    unbind = aten.unbind.int(xs, 0)
    getitem = unbind[0]; mul = child * w; c2 = mul + getitem; ...               # step 0
    getitem_1 = unbind[1]; ...                                                  # step 1
    getitem_2 = unbind[2]; ...                                                  # step 2
    stack = aten.stack.default([y0, y1, y2])
    carry = c2_2; ys = stack

`scan(..., dim=d, reverse=True)` reaches the graph as movedim/flip around a
scan over dim 0, so only dim 0 needs unrolling. The trip count is xs's
length: static whenever the shape is.

NOTE [unrolling while_loop: the trip count]
`while_loop(cond, body, carried, additional)` has a static trip count when
the values `cond` reads can be computed at compile time: the loop's control
slice. It is found by dependence: the carried values `cond` reads, closed
under "body output i reads carried j" (a loop counter reads only itself).
Their initial values must be constants of the host graph (a literal, or a
small computation with no graph input, e.g. `torch.tensor(0)`), and so must
any additional input they read. The slice is then run concretely, cond then
body, until cond is false: that count is the trip count. Anything the slice
reads that is a graph input (`i < n` with `n` an argument) makes the count
data-dependent: the loop is declined with that reason and left to run as a
loop.

Before:  while_loop = torch.ops.higher_order.while_loop(self.cond_fn_0, self.body_fn_0, (i, x), ())
After:   five copies of body_fn_0, chained through their carried values.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from laplace_passes.infra.fx_helpers import (
    SCAN,
    UNROLLABLE_LOOP_OPS,
    ancestors,
    fake_tensor,
    is_loop,
    new_node,
    output_values,
    provenance_of,
    subgraph,
)
from laplace_passes.infra.pass_base import Declined
from laplace_passes.unroll.inline import inline_graph, replace_tuple_result

# Beyond this many trips a loop is declined: the pass itself would slow down
# more than any graph-size budget would let the result through.
MAX_TRIPS = 10_000
# Constant cones larger than this are not evaluated at compile time.
_MAX_CONSTANT_NODES = 64


def is_hop_loop(node: torch.fx.Node) -> bool:
    return is_loop(node, UNROLLABLE_LOOP_OPS)


def loop_kind(node: torch.fx.Node) -> str:
    return "scan" if node.target is SCAN else "while_loop"


# -- scan ----------------------------------------------------------------------


def scan_trip_count(node: torch.fx.Node) -> int:
    """The scanned length; Declined when it is not a static, positive size."""
    _, _, xs, _ = node.args
    if not xs:
        raise Declined("scan over no inputs")
    value = fake_tensor(xs[0])
    if value is None:
        raise Declined("no shape information on the scanned input")
    length = value.shape[0]
    if not isinstance(length, int):
        raise Declined(f"the scanned length {length} is dynamic")
    if length == 0:
        raise Declined("scan over zero steps (its outputs' shapes come only from the body)")
    return length


def unroll_scan(gm: torch.fx.GraphModule, node: torch.fx.Node, trips: int) -> None:
    combine, init, xs, additional = node.args
    body = subgraph(gm, combine)
    # The recognition pass names loops by how they were written (laplace_passes.fx.recognise).
    graph, provenance = gm.graph, {**provenance_of(node), "laplace_unrolled_from": "scan"}
    carries, steps = list(init), []
    with graph.inserting_before(node):
        # One unbind per scanned input, each trip reading its row: the rows' fake values come from one
        # op run on fake tensors, not one per trip and input (a select each: most of a long scan's unroll).
        unbound = [new_node(graph, torch.ops.aten.unbind.int, (x, 0), provenance=provenance) for x in xs]
        for t in range(trips):
            slices = [new_node(graph, operator.getitem, (rows, t), provenance=provenance) for rows in unbound]
            outputs = inline_graph(gm, body, [*carries, *slices, *additional], provenance)
            carries, ys = outputs[: len(init)], outputs[len(init):]
            steps.append(ys)
        stacked = [
            new_node(graph, torch.ops.aten.stack.default, ([step[j] for step in steps], 0), provenance=provenance)
            for j in range(len(steps[0]))
        ]
    replace_tuple_result(graph, node, [*carries, *stacked])


# -- while_loop ------------------------------------------------------------------


def while_trip_count(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[int, dict]:
    """(trip count, {carried index: concrete value per trip}); Declined when it is not static."""
    cond_arg, body_arg, carried, additional = node.args
    cond, body = subgraph(gm, cond_arg), subgraph(gm, body_arg)
    n_carried = len(carried)
    host_inputs = [*carried, *additional]

    control = _control_slice(cond, body, n_carried)
    constants: dict[int, Any] = {}
    for index in sorted(control | _additional_reads(cond, body, control, n_carried)):
        try:
            constants[index] = host_constant(host_inputs[index])
        except Declined as why:
            what = f"carried value {index}" if index < n_carried else f"additional input {index - n_carried}"
            name = host_inputs[index].name if isinstance(host_inputs[index], torch.fx.Node) else host_inputs[index]
            raise Declined(f"trip count is data-dependent: the loop condition reads {what} ({name}), {why.reason}")

    # history[i][t]: carried value i entering trip t; its last entry is the value leaving the loop.
    values = dict(constants)
    history: dict[int, list] = {i: [values[i]] for i in control}
    test = _Interpreter(cond, [output_values(cond)[0]])
    step = _Interpreter(body, [output_values(body)[i] for i in sorted(control)])
    try:
        for trips in range(MAX_TRIPS + 1):
            if not bool(test.run(values)[0]):
                return trips, history
            values.update(zip(sorted(control), step.run(values)))
            for i in control:
                history[i].append(values[i])
    except (_NotSimulated, RuntimeError, TypeError, ValueError) as error:
        raise Declined(f"the trip count could not be simulated at compile time: {error}") from error
    raise Declined(f"more than {MAX_TRIPS} trips")


class _NotSimulated(Exception):
    """A node of the loop's control the compile-time simulation cannot run."""


def unroll_while(gm: torch.fx.GraphModule, node: torch.fx.Node, trips: int, history: dict) -> None:
    _, body_arg, carried, additional = node.args
    body = subgraph(gm, body_arg)
    graph, provenance = gm.graph, {**provenance_of(node), "laplace_unrolled_from": "while_loop"}
    current = list(carried)
    # Python-number counters take their simulated value at every trip, so
    # the unrolled code holds constants, not chains of integer arithmetic.
    scalar_counters = [i for i in history if not isinstance(carried[i], torch.fx.Node)]
    with graph.inserting_before(node):
        for t in range(trips):
            for i in scalar_counters:
                current[i] = history[i][t]
            current = inline_graph(gm, body, [*current, *additional], provenance)
    for i in scalar_counters:
        current[i] = history[i][trips]
    replace_tuple_result(graph, node, current)


# -- dependence and concrete evaluation ------------------------------------------


def _placeholder_reads(gm: torch.fx.GraphModule, values: list) -> set[int]:
    """Indices of the placeholders that `values` (nodes of gm) depend on."""
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    return {index[n] for n in ancestors(values) if n in index}


def _control_slice(cond, body, n_carried: int) -> set[int]:
    control = {i for i in _placeholder_reads(cond, output_values(cond)) if i < n_carried}
    outputs = output_values(body)
    while True:
        grown = control | {i for j in control for i in _placeholder_reads(body, [outputs[j]]) if i < n_carried}
        if grown == control:
            return control
        control = grown


def _additional_reads(cond, body, control: set[int], n_carried: int) -> set[int]:
    outputs = output_values(body)
    reads = _placeholder_reads(cond, output_values(cond))
    for j in control:
        reads |= _placeholder_reads(body, [outputs[j]])
    return {i for i in reads if i >= n_carried}


def host_constant(value) -> Any:
    """The concrete value of a host-graph value computed from no input; Declined (why not) otherwise."""
    if not isinstance(value, torch.fx.Node):
        return value
    cone, stack = set(), [value]
    while stack:  # depth first, stopping at the first node that is not a constant's
        node = stack.pop()
        if node in cone:
            continue
        if node.op != "call_function":
            raise Declined("which is a graph input" if node.op == "placeholder" else f"which reads {node.op} {node.target}")
        if _is_random(node.target):
            raise Declined(f"which is random ({node.target})")
        cone.add(node)
        if len(cone) > _MAX_CONSTANT_NODES:
            raise Declined("which is computed by too large a subgraph to evaluate at compile time")
        stack.extend(node.all_input_nodes)
    return _Interpreter(value.graph.owning_module, [value]).run({})[0]


def _is_random(target) -> bool:
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or "rand" in getattr(target, "__name__", "")


class _Interpreter:
    """Concrete values of `wanted` (nodes of gm), computing only what they read.

    What to run is found once: a while_loop's control runs once per trip.
    """

    def __init__(self, gm: torch.fx.GraphModule, wanted: list) -> None:
        self.gm = gm
        self.wanted = wanted
        needed = ancestors(wanted)
        self.order = [n for n in gm.graph.nodes if n in needed]
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def run(self, inputs: dict[int, Any]) -> list:
        """`inputs`: placeholder index -> value; a placeholder the wanted values read must be given."""
        env: dict = {self.placeholders[i]: v for i, v in inputs.items()}
        with unset_fake_temporarily(), torch.no_grad():
            for node in self.order:
                if node not in env:
                    env[node] = self._evaluate(node, env)
        return [env[w] if isinstance(w, torch.fx.Node) else w for w in self.wanted]

    def _evaluate(self, node: torch.fx.Node, env: dict) -> Any:
        if node.op == "get_attr":
            return operator.attrgetter(node.target)(self.gm)
        args = torch.fx.node.map_arg(node.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":  # Dynamo keeps tensor methods: i.lt(3), i.add(1)
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        raise _NotSimulated(f"cannot evaluate the {node.op} node {node.name} of the loop's control")
