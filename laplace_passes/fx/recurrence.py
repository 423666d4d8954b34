"""Token recurrences in a graph, by what they compute: chains of states and the readouts of each state.

A step is a node whose canonical form (NOTE [canonical tensor algebra] in
`laplace_passes.fx.algebra`) is

    S_t = c1 * S_{t-1} (.) d_t  +  c2 * k_t (x) v_t          (d_t: the decay's factors, none or several)

with S_{t-1} a node of S_t's shape read whole, the decay reading only the
state's batch dimensions and its key dimension, and the input one product of
factors that read the key dimension (k) or the value dimension (v) but not
both. A readout of S_t is a node of the form `c * q_t . S_t` summed over the
key dimension (`laplace_passes.fx.readouts`). `find_chains` links steps through their previous states into
chains (one per loop, however the loop was written) and finds their readouts;
a step that carries a state but is not of this form is kept with the reason
(`Chain.mismatch`), so the report can say why such a loop was left alone. A
loop whose update the algebra cannot read at all (an in-place write, a
reshape that merges dimensions, an op it does not know) is found by its
states instead, nodes of one shape read out and carried to the next step
(`_opaque_steps`), and kept with what the algebra could not read.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx

from laplace_passes.fx.algebra import UNREAD, Expr, Factor, Index, NotAlgebraic, Term, read, why_unread
from laplace_passes.fx.in_place_writes import storage_of, written_operands
from laplace_passes.fx.readouts import attach_readouts, reaches
from laplace_passes.fx.per_step import ELEMENTWISE, ELEMENTWISE_METHODS, is_fill, pattern, step_index
from laplace_passes.fx.steps import Chain, Step
from laplace_passes.fx.update_tops import (
    ResetSelect, broadcast_product, is_masked_fill, is_update_node, next_steps, reset_select, selects_against,
    skip_select, why_kept, within_an_update, without_read_out_sums,
)
from laplace_passes.infra.fx_helpers import fake_tensor
from laplace_passes.infra.guards import same_shape

Node = torch.fx.Node
aten = torch.ops.aten


def _state_like(node: Node, shape: tuple) -> bool:
    """A node of the state's shape that a step reads as its previous state rather than through: a value used
    twice (read out and updated), or an update (`is_update_node`) unless its one user is an update of the same
    shape: `S * a + k v + b` is one update written as two sums, `(S + k v) * a` one written as a sum and a
    product (NOTE [a decay after the sum] in `laplace_passes.fx.update_tops`)."""
    value = fake_tensor(node)
    if value is None or not same_shape(value.shape, shape):
        return False
    if len(node.users) > 1:
        return True
    if not is_update_node(node):
        return False
    (user,) = node.users if node.users else (None,)
    return not (user is not None and within_an_update(user) and same_shape(_shape(user), shape))


def read_step(node: Node, memo: dict) -> Step | None:
    """`node` as a state update; None when it carries no state (no term reads a node of its shape whole)."""
    value = fake_tensor(node)
    if value is None or value.dim() < 2 or not is_update_node(node) or not value.dtype.is_floating_point:
        return None
    shape = tuple(value.shape)
    if not _state_like(node, shape):
        return None  # a partial sum of a longer update
    select = skip_select(node)
    update = select.update if select is not None else node  # NOTE [steps a select skips]
    read_update = _read_update(node, update, shape, memo)
    if read_update is None:
        return None
    expr, carried, unread = read_update
    prev_nodes = {f.node for _, f in carried}
    prev, reset, through = _state_read_through(carried[0][1].node, unread, shape) if len(prev_nodes) == 1 else \
        (carried[0][1].node, None, None)
    step = Step(node, prev, expr, unread=unread, skip=select, reset=reset, through=through)
    if select is not None and select.kept is not step.prev:
        step.mismatch = why_kept(node, select.kept, step.prev, reset)
        return step
    if len(prev_nodes) > 1:
        step.mismatch = f"its update reads {len(prev_nodes)} earlier states ({', '.join(n.name for n in prev_nodes)})"
        return step
    _classify(step)
    if step.reset is not None and step.rows is not None and not step.mismatch:
        step.mismatch = f"its chunked update reads a state that the select {step.reset.select.name} resets"
    return step


def _read_update(node: Node, update: Node, shape: tuple, memo: dict, through: frozenset = frozenset()):
    """(the update's form, its terms' factors that read a state of its shape whole, why the algebra took nodes
    for leaves), or None when no factor carries a state. Of several such states, the products of smaller
    tensors (`through`) are read through when one other state is left: RWKV's `kv = k[..., None] * v[...,
    None, :]` is used twice, by the update and the readout's bonus, yet is the step's input, not a state."""
    key = ("step", node) if not through else ("step, through", node)
    try:
        expr = read(update, lambda n: n is not update and n not in through and _state_like(n, shape),
                    memo.setdefault(key, {}))
    except NotAlgebraic:
        return None
    # The update itself as a leaf (`S * a + k v + 0.5`: a number added) is no step; its loop is found by its
    # states instead (`_opaque_steps`), with what the algebra could not read.
    carried = [(t, f) for t in expr.terms for f in t.factors
               if f.axes == expr.axes and same_shape(_shape(f.node), shape) and f.node is not update]
    states = [(t, f) for t, f in carried if _state_like(f.node, shape)]
    products = frozenset(f.node for _, f in states if broadcast_product(f.node, math.prod(shape)))
    if not through and len({f.node for _, f in states} - products) == 1 and products:
        return _read_update(node, update, shape, memo, products)
    carried = states or (carried if len({f.node for _, f in carried}) == 1 else [])
    return (expr, carried, memo[key].get(UNREAD, {})) if carried else None


def _state_read_through(carried: Node, unread: dict, shape: tuple) -> tuple[Node, ResetSelect | None, Node | None]:
    """(the step's previous state, the select that resets it, S_{t-1} read through an op) for the node an
    update reads whole as its state: the state a select resets (NOTE [states a select resets]); for an op the
    algebra does not read applied to one node of the state's shape (`torch.tanh(S) * a + k v`), that op, and
    the node it reads (`_through_chains`); else the node itself."""
    reset = reset_select(carried)
    if reset is not None:
        return reset.state, reset, None
    inputs = [i for i in carried.all_input_nodes if same_shape(_shape(i), shape)]
    return carried, None, inputs[0] if carried in unread and len(inputs) == 1 else None


def _shape(node: Node) -> tuple | None:
    value = fake_tensor(node)
    return tuple(value.shape) if value is not None else None


def _classify(step: Step) -> None:
    """Fill in decay, keys and values, or `mismatch` with the reason."""
    expr, prev = step.expr, step.state_read
    decays = [t for t in expr.terms if any(f.node is prev and f.axes == expr.axes for f in t.factors)]
    inputs = [t for t in expr.terms if t not in decays]
    if len(decays) > 1:
        step.mismatch = "its decay is a sum of terms (S * a + S * b)"
        return
    decay = decays[0]
    rest = [f for f in decay.factors if not (f.node is prev and f.axes == expr.axes)]
    if len(rest) != len(decay.factors) - 1:
        step.mismatch = "its update multiplies the state by itself"
        return
    if any(f.node is prev for t in inputs for f in t.factors):
        step.mismatch = ("its update reads the previous state other than through the decay (a step that "
                         "depends on the previous output)")
        return
    if len(inputs) != 1:
        step.mismatch = (f"its update adds {len(inputs)} terms besides the decayed state; GLA adds one outer "
                         "product k_t (x) v_t (an extra additive term)" if inputs else
                         "its update adds nothing to the decayed state")
        return
    _assign_axes(step, decay.coef, tuple(rest), inputs[0])


ROWS = -1  # in a chunked step's reads: the rows of the chunk, summed over by the update


def _assign_axes(step: Step, decay_coef: float, decay: tuple[Factor, ...], term) -> None:
    """Which factors are k (read the key dimension), v (the value dimension), and the decay's.

    An update may sum over one more index, the rows of a chunk (S_n = a_n S_{n-1} + K_n^T V_n, a user's
    own chunked algorithm): factors may then read those rows too (`Step.rows`).
    """
    expr = step.expr
    summed = expr.summed(term)
    if len(summed) > 1:
        step.mismatch = "its update sums over more than one index of the step's inputs"
        return
    position = {axis: p for p, axis in enumerate(expr.axes) if axis is not None} | {i: ROWS for i in summed}

    def reads(factors) -> set[int]:
        return {position[i] for f in factors for i in f.indices()}

    per_factor = [reads([f]) for f in term.factors]
    for key_axis, value_axis in _axis_pairs(len(expr.axes), position):
        batch = set(range(len(expr.axes))) - {key_axis, value_axis} | {ROWS}
        keys = [f for f, r in zip(term.factors, per_factor) if r <= batch | {key_axis} and key_axis in r]
        values = [f for f, r in zip(term.factors, per_factor) if r <= batch | {value_axis} and value_axis in r]
        shared = [f for f, r in zip(term.factors, per_factor) if r <= batch]
        if not keys or not values or len(keys) + len(values) + len(shared) != len(term.factors):
            continue
        if not reads(decay) <= (batch - {ROWS}) | {key_axis}:
            continue
        step.decay, step.decay_coef = decay, decay_coef
        step.keys, step.values, step.input_coef = tuple(keys + shared), tuple(values), term.coef
        step.key_axis, step.value_axis = key_axis, value_axis
        step.rows = next(iter(summed), None)
        return
    step.mismatch = _unread_input(step, term) or _why_not_outer(expr, term, decay, per_factor, reads)


def _unread_input(step: Step, term) -> str:
    """Why the update's input term is not a product of the step's inputs when the algebra could not read one
    of its factors (an op it does not read, or a spelling of one it does that it cannot): that, not a guess.
    A step's own input (k[:, t]) and an elementwise op of one (exp(g_t)) are leaves as they should be."""
    for factor in term.factors:
        node, why = factor.node, step.unread.get(factor.node)
        if why is not None and not _plain_leaf(node):
            return f"its update adds {node.name}, which the algebra does not read as a product: {why}"
    return ""


def _plain_leaf(node: Node) -> bool:
    if step_index(node, {}) is not None or node.target is operator.getitem:
        return True
    return node.target in ELEMENTWISE_METHODS if node.op == "call_method" else node.target in ELEMENTWISE


def _axis_pairs(n: int, position: dict[Index, int]) -> list[tuple[int, int]]:
    """(key, value) dimension pairs to try, the last two first (the usual [..., K, V] layout)."""
    named = sorted(p for p in position.values() if p != ROWS)
    pairs = [(i, j) for i in named for j in named if i != j]
    return sorted(pairs, key=lambda p: (p != (n - 2, n - 1), p != (n - 1, n - 2), p))


def _why_not_outer(expr: Expr, term, decay, per_factor, reads) -> str:
    shape = [a.size if a is not None else 1 for a in expr.axes]
    if len([a for a in expr.axes if a is not None]) < 2:
        return f"its state {shape} has fewer than two dimensions to hold k (x) v"
    if any(len(r) == len(expr.axes) for r in per_factor) or len(per_factor) == 1:
        return "its update adds a term that is not an outer product of the step's inputs"
    if decay and any(reads([f]) - reads(term.factors) for f in decay):
        return "its decay reads a dimension that neither k nor v writes"
    broadcast = next((f.node for f in decay if _of_a_broadcast(f.node)), None)
    if broadcast is not None:
        return (f"its decay {broadcast.name} is computed on a value broadcast to the state's shape, which the "
                "algebra reads as varying over every dimension, the value dimension included (broadcast after "
                "it: `g.exp()[..., None]`, not `g[..., None].expand_as(S).exp()`)")
    return ("its decay reads the value dimension (GLA's decay is per key: S_t = diag(a_t) S_{t-1} + k_t (x) v_t)"
            if decay else "its update adds a term that is not an outer product of the step's inputs")


_EXPANDS = frozenset({"expand", "expand_as", aten.expand.default})


def _of_a_broadcast(node: Node) -> bool:
    """`node` an elementwise op of an expand (`g[..., None].expand_as(S).exp()`): a leaf of the state's
    shape though it varies over fewer dimensions."""
    if not _plain_leaf(node) or node.target is operator.getitem or not node.args or not isinstance(node.args[0], Node):
        return False
    source = node.args[0]
    return source.op in ("call_method", "call_function") and source.target in _EXPANDS


def find_chains(graph: torch.fx.Graph, min_steps: int = 2) -> list[Chain]:
    """Every chain of at least `min_steps` steps, in graph order, with its readouts (or its mismatch)."""
    memo: dict = {}
    steps = {}
    for node in graph.nodes:
        step = read_step(node, memo)
        if step is not None:
            steps[node] = step
    chains = _split_at_some_resets(_link(steps, memo), memo)
    chains += _through_chains(steps, chains, min_steps, memo)
    chains += _chains_through_selects(steps, chains, min_steps, memo)
    chains = [c for c in chains if len(c.steps) >= min_steps and (not c.mismatch or _over_positions(c, memo))]
    for chain in chains:
        if not chain.mismatch:
            chain.mismatch = _written_after_its_update(chain, graph)
        if not chain.mismatch and chain.first.rows is None:  # a chunked chain's outputs: fx/chunk_loop.py
            attach_readouts(chain, memo)
    # A chain's state before its first step is the loop's too: its first update, when read apart (below).
    chained = {s.node for c in chains for s in c.steps} | {c.first.prev for c in chains if c.first.prev is not None}
    opaque = [_without_its_start(c, memo) for c in _link(_opaque_steps(graph, steps, chained), memo)]
    chains += [c for c in opaque if len(c.steps) >= min_steps and _over_positions(c, memo)]
    for chain in chains:
        chain.unlinked = chain.unlinked or _unlinked_first_step(chain, memo)  # or set with the steps dropped
    order = {n: i for i, n in enumerate(graph.nodes)}
    return sorted(chains, key=lambda c: order[c.first.node])


def _split_at_some_resets(chains: list[Chain], memo: dict) -> list[Chain]:
    """A chain whose state a select resets at some steps only (a cached state reset once before the loop, a
    reset at one step) read as before resets were: each such select a state the loop starts from, the chain
    cut there (NOTE [states a select resets] needs one at every step). A chain reset at every step after its
    first few (`if t > 0:`) is the loop from its first reset on, on the state the steps before leave."""
    out = []
    for chain in chains:
        _from_the_first_reset(chain, memo)
        cut = [s.reset is not None for s in chain.steps]
        if all(cut) or not any(cut):
            # Or where some of the selects are read by more than their update (a reset state also returned):
            # a loop that reads out every reset state (NOTE [readouts before the update]) is cut nowhere.
            cut = [s.reset is not None and len(s.reset.select.users) > 1 for s in chain.steps]
            if all(cut) or not any(cut):
                out.append(chain)
                continue
        for step, at in zip(chain.steps, cut):
            if at:
                step.prev, step.reset = step.reset.select, None
        out += _link({s.node: s for s in chain.steps}, memo)
    return out


def _from_the_first_reset(chain: Chain, memo: dict) -> None:
    """Drop the few steps before the first reset when every later step (more of them) resets, `if t > 0:`:
    they stay as written, counted as the loop's (`Chain.unlinked`); a reason that was theirs is read again.
    A longer run before the resets is a loop of its own, cut from them (`_split_at_some_resets`)."""
    resets = [s.reset is not None for s in chain.steps]
    before = resets.index(True) if True in resets else 0
    if before == 0 or not all(resets[before:]) or len(resets) - before < max(2, before + 1):
        return
    dropped, chain.steps = chain.steps[:before], chain.steps[before:]
    chain.unlinked = before + _unlinked_first_step(Chain(dropped), memo)
    if chain.mismatch in {s.mismatch for s in dropped}:
        chain.mismatch = _chain_reason(chain)


def _through_chains(steps: dict[Node, Step], chains: list[Chain], min_steps: int, memo: dict) -> list[Chain]:
    """Loops whose every update reads the state through an op the algebra does not read (`torch.tanh(S) * a + k
    v`, `S.detach()`): linked step to step through that op, so that the loop gets a row that says so. Only
    such steps are linked with each other: one op of a state elsewhere (a readout `tanh(S) + b`, a detach every
    10 steps) leaves the chains it touches as they were."""
    chained = {s.node for c in chains if len(c.steps) >= min_steps for s in c.steps}
    through = {}
    for node, step in steps.items():
        if step.through is not None and node not in chained:
            reason = f"its update reads its previous state through {step.prev.name} ({step.unread[step.prev]})"
            through[node] = dataclasses.replace(step, prev=step.through, mismatch=reason)
    return [c for c in _link(through, memo) if len(c.steps) >= min_steps]


def _chains_through_selects(steps: dict[Node, Step], chains: list[Chain], min_steps: int, memo: dict) -> list:
    """Loops whose updates read the state through selects that neither reset it to 0 nor skip a step
    (`torch.where(starts, h0, S)`; two reset selects one after the other): linked step to step through them,
    so that the loop gets a row that says why, where it had none. One reset select is a step's own (the
    steps it links are a chain's, or a readout's sum and the step before a chain)."""
    chained = {s.node for c in chains if len(c.steps) >= min_steps for s in c.steps}
    loose = {n: s for n, s in steps.items() if n not in chained and s.through is None}
    linked = {}
    for node, step in loose.items():
        found = _earlier_through_selects(step.state_read, loose, MAX_UPDATE_DEPTH)
        if found is not None and not (len(found[1]) == 1 and reset_select(found[1][0]) is not None):
            earlier, selects = found
            linked[node] = dataclasses.replace(step, prev=earlier, reset=None, mismatch=_why_selects(selects, earlier))
    firsts = {s.prev for s in linked.values()} - set(linked)  # each from the state before the loop, through
    linked |= {n: dataclasses.replace(loose[n], prev=None) for n in firsts if n in loose}  # its selects
    return [c for c in _link(linked, memo) if len(c.steps) >= min_steps and _over_positions(c, memo)]


def _earlier_through_selects(node: Node | None, steps: dict, depth: int) -> tuple[Node, list[Node]] | None:
    """(the step `node` reads through selects, those selects, latest first), or None. A select between two
    states (a skip whose update is read out too; at the first step, between the update and the zeros the loop
    starts from) is not one: its own reason is found as an opaque loop's."""
    branches = _select_branches(node) if node is not None and depth > 0 else []
    if len(branches) > 1 and all(b in steps or _select_branches(b) or is_fill(b) for b in branches):
        return None
    for branch in branches:
        if branch in steps:
            return branch, [node]
        found = _earlier_through_selects(branch, steps, depth - 1)
        if found is not None:
            return found[0], [node, *found[1]]
    return None


def _select_branches(node: Node) -> list[Node]:
    """A `torch.where`'s branches of its shape, or `S.masked_fill(mask, x)`'s S; [] for any other node."""
    if node.op == "call_function" and node.target is torch.where and len(node.args) == 3:
        return [a for a in node.args[1:] if isinstance(a, Node) and same_shape(_shape(a), _shape(node))]
    return [node.args[0]] if is_masked_fill(node) and isinstance(node.args[0], Node) else []


def _why_selects(selects: list[Node], earlier: Node) -> str:
    if len(selects) > 1 and all(reset_select(s) is not None for s in selects):
        names = ", ".join(s.name for s in reversed(selects))
        return (f"selects reset its state one after the other ({names}): one select on either condition "
                "(`torch.where(c1 | c2, 0, S)`) is read")
    select = selects[0]
    followed = selects[1] if len(selects) > 1 else earlier
    other = next((a for a in select.args[1:] if isinstance(a, Node) and a is not followed), None)
    return (f"its update reads its previous state through the select {select.name}, which puts "
            f"{other.name if other is not None else 'a number'} in its place where it acts: a reset restarts "
            "GLA's state from 0, and a skip keeps it")


def _written_after_its_update(chain: Chain, graph: torch.fx.Graph) -> str:
    """Why the chain is not the loop's when a later node writes one of its states in place (`S.mul_(0.5)`
    after the last update, or through a view of S): its readouts and the state it returns hold what that
    write leaves, which the updates' algebra does not say. Writes that build the state (`S = S * a; S +=
    k v`: the sum writes the product's memory) come before or at its update, not after."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    states = {storage: s.node for s in chain.steps if (storage := storage_of(s.node)) is not None}
    for node in graph.nodes:
        if order[node] <= order[chain.first.node]:
            continue
        for written in written_operands(node):
            state = states.get(storage_of(written)) if isinstance(written, Node) else None
            if state is not None and order[node] > order[state]:
                return (f"its state {state.name} is written in place by {node.name} after its update (what the "
                        "loop reads out or returns is what that write leaves)")
    return ""


def _without_its_start(chain: Chain, memo: dict) -> Chain:
    """An opaque chain without its first "step" when that is the state the loop starts from (`torch.zeros`:
    read twice, by the first update's two terms, but computed from no position): its row counts updates."""
    first = chain.steps[0]
    if len(chain.steps) > 1 and first.prev is None and not pattern(first.node, memo.setdefault("patterns", {})).varies:
        chain.steps.pop(0)
        chain.mismatch = _chain_reason(chain) if chain.mismatch == first.mismatch else chain.mismatch
    return chain


def _unlinked_first_step(chain: Chain, memo: dict) -> int:
    """1 when the first step's previous state is computed from the loop's inputs at one position: the
    loop's first step, written so that it was not read as a step (S_1 = k_1 (x) v_1 in another spelling)."""
    prev = chain.first.prev
    if prev is None or prev.op not in ("call_function", "call_method"):
        return 0
    return int(pattern(prev, memo.setdefault("patterns", {})).varies)


# -- loops whose updates the algebra does not read ----------------------------------------------------------

MAX_UPDATE_DEPTH = 6  # ops between a state and the next: S * a, a reshape, the update, a reshape back


def _opaque_steps(graph: torch.fx.Graph, steps: dict[Node, Step], chained: set[Node]) -> dict[Node, Step]:
    """The updates of loops that carry a state through ops the algebra does not read as a sum (an in-place
    write, a reshape that merges heads into the batch and back, an op it does not know), so that the report
    still lists such a loop, with the reason. A state here is a node read twice (read out and updated),
    whose previous state is the nearest earlier such node of its shape; the last state is read once."""
    found: dict[Node, Step] = {}
    for node in graph.nodes:
        if node in steps or not _state_candidate(node) or len(node.users) < 2:
            continue
        prev = _previous_state(node, steps, chained)
        if prev is not False:
            found[node] = _opaque_step(node, prev)
    carried = {s.prev for s in found.values()}
    for node in [n for n in found if n not in carried]:
        last = _next_update(node)
        if last is not None and last not in steps and last not in found \
                and _previous_state(last, steps, chained) is not False:  # not a view of a loop already read
            found[last] = _opaque_step(last, node)
    return {s.node: s for s in found.values() if s.mismatch}


def _state_candidate(node: Node) -> bool:
    value = fake_tensor(node)
    return node.op in ("call_function", "call_method") and value is not None and value.dim() >= 2 \
        and value.dtype.is_floating_point


def _previous_state(node: Node, steps: dict, chained: set[Node]):
    """The nearest earlier state of `node`'s shape (None: none, the loop's first step), or False when `node`
    is part of a loop already read (it reaches one of its steps)."""
    shape = _shape(node)

    def verdict(n: Node):
        if n in chained:
            return False
        state = same_shape(_shape(n), shape) and n not in steps and (len(n.users) > 1 or n.op == "placeholder")
        return n if state else None

    return _nearest(node.all_input_nodes, lambda n: n.all_input_nodes, verdict)


def _next_update(node: Node) -> Node | None:
    """The loop's last update after the state `node`: the nearest later node of its shape and op."""
    shape = _shape(node)

    def verdict(n: Node):
        return n if n.op == node.op and n.target == node.target and same_shape(_shape(n), shape) else None

    return _nearest(list(node.users), lambda n: list(n.users), verdict)


def _nearest(frontier: list[Node], neighbours, verdict):
    """Breadth first from `frontier` through `neighbours`, up to MAX_UPDATE_DEPTH levels: the first verdict
    that is not None (None when none is)."""
    seen: set[Node] = set()
    for _ in range(MAX_UPDATE_DEPTH):
        following = []
        for n in frontier:
            if n in seen:
                continue
            seen.add(n)
            found = verdict(n)
            if found is not None:
                return found
            following += neighbours(n)
        frontier = following
    return None


def _opaque_step(node: Node, prev: Node | None) -> Step:
    """A step whose "form" is one product of what it reads besides its state (the nodes between the two),
    for `_over_positions`: the state itself reads every earlier position, the step's inputs its own."""
    inputs, frontier = [], list(node.all_input_nodes)
    for _ in range(MAX_UPDATE_DEPTH):
        frontier = [n for n in frontier if n is not prev and n not in inputs]
        inputs += frontier
        frontier = [i for n in frontier for i in n.all_input_nodes]
    expr = Expr((), (Term(1.0, tuple(Factor(n, ()) for n in inputs)),))
    return Step(node, prev, expr, mismatch=_why_opaque(node, prev))


def _why_opaque(node: Node, prev: Node | None) -> str:
    for user in node.users:
        if any(w is node for w in written_operands(user)):
            return f"its state {node.name} is written in place by {user.name}, which the algebra does not read"
    memo: dict = {}

    def stop(n: Node) -> bool:  # a first update reads the state the loop starts from (`torch.zeros`): no reason
        return n is prev or (prev is None and is_fill(n))

    try:
        read(node, stop, memo)
    except NotAlgebraic as error:
        return f"its update {node.name} is not read as a sum of products: {error}"
    frontier, select = [node], None
    for _ in range(MAX_UPDATE_DEPTH):
        for n in frontier:  # an op on the state's path (as many elements as the state): a gate's exp is a leaf
            if why_unread(memo, n) is None or _numel(n) != _numel(node):
                continue
            if not selects_against(n, prev):
                return f"its update is not a sum of products the algebra reads ({n.name}: {why_unread(memo, n)})"
            # A select that may skip the step: an op inside its branches is the reason, if there is one.
            select = select or n
            for branch in (a for a in n.args[1:] if isinstance(a, Node)):  # where(c, S, 0.0): a number
                try:
                    read(branch, stop, memo)
                except NotAlgebraic:  # its own reason, if it computes anything, is found below
                    pass
        frontier = [i for n in frontier for i in n.all_input_nodes if prev is None or reaches(prev, i)]
    if select is not None:  # the branches read, the select itself not (its update is read out too, say)
        return f"its update is not a sum of products the algebra reads ({select.name}: {why_unread(memo, select)})"
    return f"its update {node.name} is not of GLA's form S_t = a_t (.) S_{{t-1}} + k_t (x) v_t"


def _numel(node: Node) -> int | None:
    value = fake_tensor(node)
    return value.numel() if value is not None else None


def first_step(node: Node, memo: dict) -> Step | None:
    """`node` as the first update of a recurrence from a zero state, S_1 = c2 * k_1 (x) v_1; else None."""
    value = fake_tensor(node)
    if value is None or value.dim() < 2 or not value.dtype.is_floating_point:
        return None
    shape = tuple(value.shape)
    try:
        expr = read(node, lambda n: n is not node and _state_like(n, shape), memo.setdefault(("step", node), {}))
    except NotAlgebraic:
        return None
    if len(expr.terms) != 1 or any(same_shape(_shape(f.node), shape) for f in expr.terms[0].factors):
        return None
    step = Step(node, None, expr)
    _assign_axes(step, 1.0, (), expr.terms[0])
    return None if step.mismatch else step


def _over_positions(chain: Chain, memo: dict) -> bool:
    """Whether the chain's steps read their inputs at a position that changes with the step: a loop over
    tokens. A residual stream (x + f(x) layer after layer) carries a state too, but reads no position, or
    one now and then (a per-layer parameter `bounds[layer]`): it is not reported as a declined recurrence."""
    patterns = memo.setdefault("patterns", {})
    read = [{p for t in s.expr.terms for f in t.factors for p in pattern(f.node, patterns).steps}
            for s in chain.steps]
    reading = [positions for positions in read if positions]
    return len(reading) >= max(2, len(chain.steps) - 1) and len(set().union(*reading)) >= 2


def _link(steps: dict[Node, Step], memo: dict) -> list[Chain]:
    steps = without_read_out_sums(steps)
    next_of = next_steps(steps)
    chains = []
    for step in steps.values():
        if step.prev is not None and step.prev in steps and not _branches(steps[step.prev], next_of):
            continue  # not a chain's first step
        if step.prev is None and step.node not in next_of:
            continue  # a lone product, no recurrence
        chain = Chain([step])
        head = first_step(step.prev, memo) if step.prev is not None and step.prev not in steps else None
        if head is not None and len(step.prev.users) <= 2:
            chain.steps.insert(0, head)
        while len(next_of.get(chain.last.node, [])) == 1:
            chain.steps.append(next_of[chain.last.node][0])
        if len(next_of.get(chain.last.node, [])) > 1:
            chain.mismatch = f"the state {chain.last.node.name} is updated by two different steps"
        if not chain.mismatch:
            chain.mismatch = _chain_reason(chain)
        chains.append(chain)
    return chains


def _chain_reason(chain: Chain) -> str | None:
    """The reason most steps give; the first step's when each names its own node."""
    reasons = [s.mismatch for s in chain.steps if s.mismatch]
    return max(reasons, key=reasons.count) if reasons else None


def _branches(step: Step, next_of: dict) -> bool:
    return len(next_of.get(step.node, [])) > 1
