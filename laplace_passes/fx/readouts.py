"""The readouts of a chain of states: o_t = c * q_t . S_t, the state summed over its key dimension.

`attach_readouts` finds, for each step of a chain (`laplace_passes.fx.recurrence`), the node nearest to
its state of that form, or says why the chain has none GLA could give: a state read out twice, some
states read out and others not, a state used outside the recurrence.

NOTE [k and v's dimensions chosen by the readout]
An update whose decay reads neither of the state's two feature dimensions (one decay per head, as
Mamba-2's `h = h * exp(dt A) + (dt x) (x) B`, or none) reads the same either way round: which factor is k
and which is v is then the readout's to say, by the dimension it sums the state over (Mamba-2's `y = h C`
sums over B's). The update's reading tries the usual [..., K, V] order first; when the states' readouts do
not sum over that K, the chain is read again with the two swapped, and kept so when its readouts then fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from laplace_passes.fx.algebra import Expr, Factor, NotAlgebraic, read

Node = torch.fx.Node
# The chains and steps here are `laplace_passes.fx.recurrence`'s Chain and Step, which hold these readouts.
MAX_READOUT_DEPTH = 4  # ops between a state and its readout's contraction: [..., None], *, .sum, a scale


@dataclass
class Readout:
    node: Node  # o_t
    state: Node  # S_t
    expr: Expr
    queries: tuple[Factor, ...]
    coef: float
    state_axes: tuple  # S_t's indices in `expr`, one per state dimension


def attach_readouts(chain, memo: dict) -> None:
    """`chain.readouts`, or `chain.mismatch`; k and v swapped when the readouts say so (NOTE [k and v's
    dimensions chosen by the readout])."""
    _attach_readouts(chain, memo)
    if not chain.mismatch or not all(_either_way(s) for s in chain.steps):
        return
    first = chain.mismatch, chain.readouts
    _swap_key_and_value(chain)
    chain.mismatch, chain.readouts = "", []
    _attach_readouts(chain, memo)
    if chain.mismatch:  # neither way round: the usual reading and its reason
        _swap_key_and_value(chain)
        chain.mismatch, chain.readouts = first


def _either_way(step) -> bool:
    """The update reads the same with k and v swapped: its decay reads neither feature dimension."""
    features = {step.expr.axes[step.key_axis], step.expr.axes[step.value_axis]}
    return step.rows is None and not any(f.indices() & features for f in step.decay)


def _swap_key_and_value(chain) -> None:
    for step in chain.steps:
        step.keys, step.values = step.values, step.keys
        step.key_axis, step.value_axis = step.value_axis, step.key_axis


def _attach_readouts(chain, memo: dict) -> None:
    chain_nodes = {s.node for s in chain.steps}
    readouts = []
    for index, step in enumerate(chain.steps):
        following = chain.steps[index + 1].node if index + 1 < len(chain.steps) else None
        found = _readouts_of(step, following, chain_nodes, memo)
        if len(found) > 1:
            chain.mismatch = f"the state {step.node.name} is read out {len(found)} times"
            return
        readouts.append(found[0] if found else None)
    if readouts[-1] is not None and all(r is None for r in readouts[:-1]):
        # Only the final state is read out (a classifier's last token): a loop that returns its final state,
        # whose readout then reads the GLA call's final state like any other use of it.
        readouts[-1] = None
    if any(r is None for r in readouts) and any(r is not None for r in readouts):
        missing = next(s.node.name for s, r in zip(chain.steps, readouts) if r is None)
        chain.mismatch = f"some states are read out and others ({missing}) are not"
        return
    chain.readouts = [r for r in readouts if r is not None]
    for step, following, readout in zip(chain.steps[:-1], chain.steps[1:], readouts):
        extra = _other_uses(step, following, readout)
        if extra:
            key_dim = step.key_axis % len(step.shape)
            chain.mismatch = (f"the state {step.node.name} is also used by {extra.name}, outside the recurrence "
                              f"(not a readout q . S summed over the key dimension, {key_dim}: the one its decay "
                              "and k read)")
            return


def _readouts_of(step, following: Node | None, chain_nodes: set, memo: dict) -> list[Readout]:
    """The readouts of `step`'s state: the nodes nearest to it of the form c * q . S summed over the key."""
    state = step.node
    found, frontier, seen = [], [(u, 1) for u in state.users if u is not following], set()
    while frontier:
        node, depth = frontier.pop(0)
        if node in seen or node.op == "output" or node in chain_nodes:
            continue
        seen.add(node)
        readout = _as_readout(node, step, memo)
        if readout == "continue" and depth < MAX_READOUT_DEPTH:
            frontier += [(u, depth + 1) for u in node.users]
        elif isinstance(readout, Readout):
            found.append(_extended(readout, step, memo))
    return found


def _as_readout(node: Node, step, memo: dict):
    """A Readout, "continue" (S_t read whole so far: a product not yet summed), or None."""
    state = step.node
    try:
        expr = read(node, lambda n: n is state, memo.setdefault(("readout", state, node), {}))
    except NotAlgebraic:
        return None
    if len(expr.terms) != 1:
        return None
    (term,) = expr.terms
    reads = [f for f in term.factors if f.node is state]
    if len(reads) != 1:
        return None
    state_axes = reads[0].axes
    key, value = state_axes[step.key_axis], state_axes[step.value_axis]
    summed = expr.summed(term)
    free = {a for a in expr.axes if a is not None}
    batch = {a for i, a in enumerate(state_axes) if i not in (step.key_axis % len(state_axes),
                                                               step.value_axis % len(state_axes)) and a is not None}
    if key in free:
        return "continue"
    if key not in summed or value not in free or not batch <= free:
        return None
    queries = tuple(f for f in term.factors if f.node is not state)
    if any(f.indices() - (batch | {key}) for f in queries):
        return None
    return Readout(node, state, expr, queries, term.coef, state_axes)


def _extended(readout: Readout, step, memo: dict) -> Readout:
    """Through the readout's one user while that is still a readout of the state (a scale, a transpose)."""
    while len(readout.node.users) == 1:
        (user,) = readout.node.users
        if user.op != "call_function" and user.op != "call_method":
            break
        longer = _as_readout(user, step, memo)
        if not isinstance(longer, Readout):
            break
        readout = longer
    return readout


def _other_uses(step, following, readout: Readout | None) -> Node | None:
    """A user of an intermediate state outside the next update's ops and the readout's own ops."""
    allowed = _between(step.node, following.node)
    if readout is not None:
        allowed |= _between(step.node, readout.node)
    return next((u for u in step.node.users if u not in allowed), None)


def _between(start: Node, end: Node) -> set[Node]:
    """Nodes on a path from `start` to `end` (inclusive of `end`)."""
    found, stack = set(), [end]
    while stack:
        node = stack.pop()
        if node in found or node is start:
            continue
        found.add(node)
        stack.extend(n for n in node.all_input_nodes if reaches(start, n))
    return found


def reaches(start: Node, node: Node, limit: int = 12) -> bool:
    frontier, depth = [node], 0
    while frontier and depth <= limit:
        if start in frontier:
            return True
        frontier = [i for n in frontier for i in n.all_input_nodes]
        depth += 1
    return False
