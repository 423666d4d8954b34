"""A recognised loop and its GLA call, run side by side on random inputs before the graph is rewritten.

The canonical form (NOTE [canonical tensor algebra]) says what a loop
computes; this checks it. The loop's first few steps are copied into a
graph of their own, whose inputs are the loop's sources (the tensors it
reads its q, k, v and gates from, its initial state, anything else it reads
that is not a constant), beside the GLA call `GlaBuilder` makes of those
same sources for those steps. Both run on random sources (constants, such as
a zero initial state, keep their values) and must agree within the rounding
of the precision the loop computes in (the lowest of its values' dtypes: a
bf16 op inside a step, or one autocast runs in bf16), readouts and final
state alike; a loop that does not is left unchanged, and the report gives
the error measured. The GLA form runs with autocast off, in float32 as the
GLA ops compute, so a float64 loop is kept as written before any comparison.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from laplace_passes.fx.gla_build import GlaBuilder
from laplace_passes.fx.per_step import constant_value
from laplace_passes.fx.token_loop import TokenLoop
from laplace_passes.fx.unlike_steps import COMPARISONS
from laplace_passes.infra.fx_helpers import ancestors, fake_tensor
from laplace_passes.infra.pass_base import Declined
from laplace_passes.ops.gla import gla_recurrence

Node = torch.fx.Node

# Relative error (Frobenius) allowed between the loop and its GLA call, by the dtype the loop computes in.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 1e-2}


def reference_gla(q, k, v, gk, initial_state, scale, origin):
    """The token recurrence without the gate check (random gates may be positive), autocast off.

    The compile may run under the caller's autocast, which would compute the reference's readout matmuls in
    bf16 while the loop's elementwise products stay in float32: the difference would be autocast's, not the
    loop's. The loop's own low-precision ops are accounted for by the tolerance instead (`_tolerance`).
    """
    with torch.autocast(q.device.type, enabled=False):
        return gla_recurrence(q, k, v, gk, initial_state, scale)


def check_on_random_inputs(gm: torch.fx.GraphModule, loop, memo: dict, steps: int) -> None:
    """Raise Declined (with the error measured) when the computation's first `steps` steps and GLA disagree.

    `loop` is a TokenLoop or a quadratic form: it names its results over those steps (`results(steps)`),
    the nodes it reads (`source_nodes()`), and builds GLA's results in their layouts (`gla_results`).
    """
    old = loop.results(steps)
    _check_compute_dtype(old)
    sources = loop.source_nodes()
    region = reading_region(old, sources)
    externals = sorted({i for n in region for i in n.all_input_nodes if i not in region} | sources,
                       key=graph_order(gm.graph))
    graph, env = _copy_of_the_loop(gm, externals, region)
    builder = GlaBuilder(graph, loop, steps, memo, env=lambda n: env[n])
    new = loop.gla_results(builder, old, target=reference_gla)
    conditions = [c for c in _conditions(loop, steps) if c.nodes[0] in region]
    graph.output(tuple([env[n] for n in old] + new + [env[n] for c in conditions for n in c.nodes]))
    module = torch.fx.GraphModule(gm, graph)
    with unset_fake_temporarily(), torch.no_grad():
        loop_alone = functools.partial(_loop_alone, gm, externals, region, old)  # built on an error only
        results = _run_until_the_selects_act(module, loop_alone, externals, loop, conditions)
    _compare(results[: len(old)], results[len(old): len(old) + len(new)], old, _tolerance(region | set(old)))


@dataclass
class Condition:
    """A select's condition at each step checked, and the steps whose values must include either outcome."""

    role: str
    nodes: list[Node]
    from_step: int  # a reset at step 0 of a zero state changes nothing: its resets must come later


def _conditions(loop, steps: int) -> list[Condition]:
    """The conditions computed from masks and ids alone, which the draws are made to turn both ways. One
    computed from values (`x[:, t].abs().sum(-1) > 0`, padding told by its zeros) may keep one value on
    random inputs, as before the draws were checked: its select is then left to the tests of its form."""
    if not isinstance(loop, TokenLoop):
        return []
    return [Condition(role, f.nodes[:steps], int(role == "reset")) for role in ("skip", "reset")
            for f in loop.roles.get(role, []) if all(_drawn_as_ids(n, loop) for n in loop.sources_of(f.nodes[0]))]


DRAWS = 4  # random inputs drawn at most, until each select's condition is true and false within the steps
MIN_OUTCOMES = 4  # a condition of fewer values checked (one sequence, two steps) may keep one value on any draw


def _copy_of_the_loop(gm: torch.fx.GraphModule, externals: list[Node], region: set[Node]):
    """A graph of the loop's first steps as the user wrote them, its inputs `externals`; and the map from the
    loop's nodes to the copy's."""
    graph = torch.fx.Graph()
    env = {n: graph.placeholder(f"input_{i}") for i, n in enumerate(externals)}
    for node in gm.graph.nodes:
        if node in region or _switches_autocast(node):
            env[node] = graph.node_copy(node, lambda n: env[n])
    return graph, env


def _loop_alone(gm: torch.fx.GraphModule, externals: list[Node], region: set[Node], old: list[Node]):
    """The loop's first steps alone, for telling its own errors from ours."""
    graph, env = _copy_of_the_loop(gm, externals, region)
    graph.output(tuple(env[n] for n in old))
    return torch.fx.GraphModule(gm, graph)


def _run_until_the_selects_act(module, loop_alone: Callable, externals: list[Node], loop, conditions: list) -> tuple:
    """The loop and its GLA form run on random inputs (NOTE [random sources of a select's condition]): drawn
    again while a select's condition takes one value only, which would leave its rewrite unchecked."""
    for draw in range(DRAWS):
        generator = torch.Generator().manual_seed(draw)  # the user's random state untouched, the check repeatable
        inputs = [_input_value(n, loop, generator) for n in externals]
        try:
            results = module(*inputs)
        except (IndexError, RuntimeError) as error:
            _raise_the_loops_own(error, loop_alone, inputs)
            raise
        values = results[len(results) - sum(len(c.nodes) for c in conditions):]
        idle = _idle_condition(conditions, values)
        if idle is None:
            return results
    raise Declined(f"on {DRAWS} draws of random inputs the condition of its {idle.role} select "
                   f"({idle.nodes[0].name}) took one value only within the first {len(idle.nodes)} steps, so the "
                   "rewrite of that select could not be checked")


def _raise_the_loops_own(error: Exception, loop_alone: Callable, inputs: list) -> None:
    """Decline when the user's loop (`loop_alone()` builds it) raises on the random inputs by itself: ids drawn
    for a comparison that index a table (`flags[ids[:, t]]`) may fall outside it. An error of the GLA form's
    is left to raise."""
    module = loop_alone()
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # torch.fx's print of the failing line: not the user's
            module(*inputs)
    except (IndexError, RuntimeError):
        message = (str(error).splitlines() or [""])[0][:200]
        raise Declined(f"its first steps raised on random ids ({type(error).__name__}: {message}), so its rewrite "
                       "could not be checked") from error


def _idle_condition(conditions: list[Condition], values: tuple) -> Condition | None:
    """The first condition that is not both true and false somewhere within its steps; None when each is."""
    at = 0
    for condition in conditions:
        taken = values[at + condition.from_step: at + len(condition.nodes)]
        at += len(condition.nodes)
        outcomes = [bool(v) for value in taken for v in value.bool().flatten().tolist()]
        if len(outcomes) >= MIN_OUTCOMES and set(outcomes) != {True, False}:
            return condition
    return None


def _check_compute_dtype(results: list[Node]) -> None:
    """Decline a float64 loop before comparing: the GLA ops compute in float32, so its rewrite would lose the
    precision the loop was written for (and could not meet a float64 tolerance), though it may well be GLA."""
    wide = next((n for n in results if _dtype(n) == torch.float64), None)
    if wide is not None:
        raise Declined(f"it computes in torch.float64 ({wide.name}) and the GLA ops compute in float32 (they "
                       "take no float64), so a float64 loop is kept as written")


def _dtype(node: Node) -> torch.dtype | None:
    value = fake_tensor(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def _tolerance(nodes: set[Node]) -> tuple[float, torch.dtype]:
    """The tolerance of the lowest precision the loop computes in, and that dtype.

    The nodes' dtypes are those traced, under the autocast the graph runs in (a matmul or einsum autocast
    computes in bf16 has a bf16 value), so a loop that rounds to bf16 inside a step gets bf16's tolerance
    even when its inputs and results are float32; a loop computing in float32 throughout keeps float32's.
    """
    dtypes = {_dtype(n) for n in nodes} & set(TOLERANCE)
    lowest = max(dtypes, key=TOLERANCE.__getitem__) if dtypes else torch.float32
    return TOLERANCE[lowest], lowest


# A `with torch.autocast(...)` inside the compiled function: Dynamo's graph enters and leaves it with these.
_AUTOCAST_SWITCHES = (torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast)


def _switches_autocast(node: Node) -> bool:
    """The loop's copy runs under the autocast its graph runs it under: its ops' traced dtypes (and which
    mixed-dtype ops it may call) are those of that autocast."""
    return node.op == "call_function" and node.target in _AUTOCAST_SWITCHES


def graph_order(graph: torch.fx.Graph):
    """A sort key putting a graph's nodes in the order the graph runs them."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: position[n]


def reading_region(outputs: list[Node], sources: set[Node]) -> set[Node]:
    """The nodes that compute `outputs` from the sources (ancestors of the outputs that read a source)."""
    candidates = ancestors(outputs) - sources
    position = graph_order(outputs[0].graph)
    reads_source: dict[Node, bool] = {}
    for node in sorted(candidates, key=position):
        reads_source[node] = any(i in sources or reads_source.get(i, False) for i in node.all_input_nodes)
    return {n for n, reads in reads_source.items() if reads}


def _input_value(node: Node, loop, generator: torch.Generator):
    constant = constant_value(node)
    if constant is not None:
        return constant
    value = fake_tensor(node)
    if value is None:
        raise Declined(f"the loop reads {node.name}, which is not a tensor of known shape")
    if _drawn_as_ids(node, loop):
        return random_ids(value, _numbers_compared(node), generator)
    if value.dtype.is_floating_point and _compared_and_read(node, loop):
        return _half_ids(node, value, generator)
    if not value.dtype.is_floating_point:
        # A mask kept as a buffer or passed in: its values are not in the graph (nothing says it stays causal),
        # and random values would not be a mask. One built in the graph from sizes is a constant, read above.
        raise Declined(f"it reads {node.name}, a {value.dtype} tensor that comes from the graph's inputs (a mask "
                       "held in a buffer or passed in?): random inputs cannot stand for it and the graph does not "
                       "show its values; a causal mask built inside forward from its sizes (torch.ones(T, T, "
                       "dtype=torch.bool).tril()) is read as the constant it is")
    shape = [int(d) for d in value.shape]
    low, high = random_range(node, loop.gate_sources(), getattr(loop, "gate_ranges", GATE_RANGES))
    return torch.empty(shape, dtype=value.dtype).uniform_(low, high, generator=generator)


def _drawn_as_ids(node: Node, loop) -> bool:
    """A token loop's bool and integer inputs, and the float ones a select's condition reads (gates aside;
    constants keep their values): NOTE [random sources of a select's condition]. A token loop reads them a
    token at a time (a condition, `S * keep[:, t]` in a decay), so any values are values it may see. A
    quadratic form's T x T mask is not drawn: its values are what makes it causal."""
    value = fake_tensor(node)
    if not isinstance(loop, TokenLoop) or value is None or constant_value(node) is not None:
        return False
    if value.dtype == torch.bool or not (value.dtype.is_floating_point or value.dtype.is_complex):
        return True
    return _compared(node, loop) and node not in loop.value_sources()


def _compared(node: Node, loop: TokenLoop) -> bool:
    """A float that a select's condition reads, not a gate."""
    gates = loop.gate_sources()
    return node in loop.mask_sources() and random_range(node, gates, getattr(loop, "gate_ranges", GATE_RANGES)) \
        == (-1.0, 1.0)


def _compared_and_read(node: Node, loop) -> bool:
    """A float that a select's condition reads and the loop reads as a value too (`k` in `k.abs().sum(-1) > 0`,
    positions that scale k)."""
    return isinstance(loop, TokenLoop) and constant_value(node) is None and _compared(node, loop) \
        and node in loop.value_sources()


def _half_ids(node: Node, value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Uniform values with half of them ids (NOTE [random sources of a select's condition]), never negative:
    positions that scale k (`(pos + 1).rsqrt()`) stay finite, and `pos == 0` fires somewhere."""
    uniform = torch.empty(value.shape, dtype=value.dtype).uniform_(-1.0, 1.0, generator=generator)
    ids = random_ids(value, _numbers_compared(node), generator).clamp_min(0)
    return torch.where(torch.rand(value.shape, generator=generator) < 0.5, ids, uniform)


# NOTE [random sources of a select's condition]
# Which steps a select skips or which states it resets (NOTE [steps a select skips]) comes from a condition
# on a tensor the loop reads: a mask, or ids compared with a number (`positions[:, t] == 0`, `ids[:, t] !=
# -100`, `mask[:, t] < 0` of an additive mask). Any values are values the loop may see, so random ones stand
# for them, but only values that make each condition true somewhere and false elsewhere check the rewrite
# of the select: uniform floats never equal 0, so a reset by `positions == 0` would go unchecked.
# * A mask is drawn True at 3 of 4 places.
# * Integer ids and positions, and float ones only a condition reads, are "ids": whole numbers from 0 to 3
#   and around each number the comparisons reading them name, or add on the way (-1 for an additive
#   mask's `< 0`, 10 for `(pos - 10) == 0`). An integer mask that scales the decay (`S * mask[:, t]`) is
#   drawn so too, never negative where no comparison asks for it.
# * A float that a condition reads and the loop reads as a value too (`k` in `k.abs().sum(-1) > 0`, or
#   positions that scale k) is drawn uniform, half of it replaced by ids that are not negative, so that
#   `(pos + 1).rsqrt()` stays finite.
# The check then reads each condition computed from ids alone over the steps it ran: one that took a single
# value (a reset that fired at no step after the first) is drawn again from another seed, and after DRAWS
# the loop is declined, saying which select went unchecked; a condition read from values is left to the
# tests of its form, as before ids were drawn. A loop that raises by itself on random ids (ids that index a
# table of fewer entries) is declined, saying so. The draws come from generators of their own, seeded by
# the draw: a compile leaves the user's random state as it was, and the check gives the same verdict.
SMALL_IDS = (0, 1, 2, 3)


def random_ids(value: torch.Tensor, numbers: set, generator: torch.Generator) -> torch.Tensor:
    """Random values of a mask or ids (NOTE [random sources of a select's condition]), around the `numbers`
    a condition compares them with."""
    shape = [int(d) for d in value.shape]
    if value.dtype == torch.bool:
        return torch.rand(shape, generator=generator) < 0.75
    candidates = sorted(set(SMALL_IDS) | {n + d for n in numbers for d in (-1, 0, 1)})
    if not value.dtype.is_floating_point:
        info = torch.iinfo(value.dtype)
        candidates = [c for c in candidates if c == int(c) and info.min <= c <= info.max]
    picks = torch.randint(0, len(candidates), shape, generator=generator)
    return torch.tensor(candidates, dtype=torch.float64)[picks].to(value.dtype)


COMPARED_WITHIN = 6  # ops from ids to a select's condition: an index, a cast, a comparison, a broadcast


# Ops whose numbers say which ids make a comparison true: the comparison's own, and those added or taken
# on the way to it (`(pos - 10) == 0` fires at 10).
_NUMBERED = COMPARISONS | {operator.add, operator.sub, torch.add, torch.sub, "add", "sub"}


def _numbers_compared(source: Node) -> set:
    """The numbers that comparisons reading `source` (within COMPARED_WITHIN ops) compare with (`== 0`), and
    those added or taken on the way."""
    found, frontier, seen = set(), [source], {source}
    for _ in range(COMPARED_WITHIN):
        frontier = [u for n in frontier for u in n.users if u not in seen]
        seen.update(frontier)
        for user in frontier:
            if user.op in ("call_function", "call_method") and user.target in _NUMBERED:
                found |= {a for a in user.args if isinstance(a, (int, float)) and not isinstance(a, bool)
                          and math.isfinite(a)}
    return found


# Where random gates are drawn, by kind, unless the computation checked asks for others (`gate_ranges`).
GATE_RANGES = {"log": (-1.0, -0.05), "decay": (0.1, 0.9)}


def random_range(node: Node, gates: dict[str, set[Node]], ranges: dict = GATE_RANGES) -> tuple[float, float]:
    """Where a random input is drawn from: log-gates in (-1, -0.05), decays in (0.1, 0.9) (or `ranges`), anything
    else (-1, 1).

    `gates` holds the nodes of each kind ("log", "decay"); an input is of a kind when it is read only on the
    way to that kind, or when the kind's per-step values are this input's own, selected (`A[:, t]`, whatever
    else reads A: HGRN2's key 1 - A[:, t] too): its values are then gates and must be in the gates' range.
    """
    for kind, low_high in ranges.items():
        nodes = gates.get(kind, set())
        if node in nodes or (node.users and all(_feeds_only(u, nodes) for u in node.users)) \
                or _selected_as(node, nodes):
            return low_high
    return -1.0, 1.0


# Ops that select or rearrange a tensor's values without changing them (per-step reads of a whole tensor).
_SELECTIONS = frozenset({operator.getitem, torch.select, torch.narrow, torch.unbind, torch.unsqueeze, torch.squeeze,
                         torch.reshape, torch.permute, torch.transpose, torch.movedim, torch.flatten})
_SELECTION_METHODS = frozenset({"select", "narrow", "unbind", "unsqueeze", "squeeze", "view", "reshape", "permute",
                                "transpose", "movedim", "flatten", "expand", "contiguous", "float"})


def _selected_as(node: Node, targets: set[Node], depth: int = 4) -> bool:
    """Whether a node of `targets` is `node`'s values selected (indexing and view ops only, within `depth`)."""
    if depth == 0:
        return False
    for user in node.users:
        selects = user.target in _SELECTION_METHODS if user.op == "call_method" else \
            user.op == "call_function" and user.target in _SELECTIONS
        if selects and (user in targets or _selected_as(user, targets, depth - 1)):
            return True
    return False


def _feeds_only(node: Node, targets: set[Node], depth: int = 4) -> bool:
    if node in targets:
        return True
    if depth == 0 or not node.users:
        return False
    return all(_feeds_only(u, targets, depth - 1) for u in node.users)


def _compare(expected: tuple, found: tuple, nodes: list[Node], tolerance: tuple[float, torch.dtype]) -> None:
    tolerance, dtype = tolerance
    for e, f, node in zip(expected, found, nodes):
        if e.shape != f.shape:
            raise Declined(f"its GLA form gives {node.name} the shape {list(f.shape)}, not {list(e.shape)}")
        e64, f64 = e.double(), f.double()
        if not torch.equal(e64.isnan(), f64.isnan()):
            raise Declined(f"on random inputs its GLA form gives NaN where the loop does not ({node.name})")
        finite = ~e64.isnan()
        error = (e64[finite] - f64[finite]).norm() / e64[finite].norm().clamp_min(1e-30)
        if not error <= tolerance:
            raise Declined(f"on random inputs its GLA form differs from the loop at {node.name} by a relative "
                           f"{float(error):.2g} (more than {tolerance:g} for a loop computing in {dtype}): not the GLA "
                           "recurrence")
