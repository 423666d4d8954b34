"""The readouts of a chain of states: o_t = c * q_t . S_t, the state summed over its key dimension.

`attach_readouts` finds, for each step of a chain (`laplace_passes.fx.recurrence`), the node nearest to
its state of that form, or says why the chain has none GLA could give: a state read out twice, some
states read out and others not, a state used outside the recurrence.

NOTE [readouts before the update]
A loop may read each state out before its update, o_t = q_t . S_{t-1} (RWKV's readout, and a causal
linear attention that excludes the current token): the first token then reads the state the loop starts
from, and the last state is returned, not read out. Such a chain's readouts are listed per token (the
initial state's first) and marked `read_before_update`. That is GLA on k, v and the decay one token late
(token t's state is then S_{t-1}), and the final state one update further (`laplace_passes.fx.gla_build`).
A loop that resets the state at some tokens (NOTE [states a select resets] in `laplace_passes.fx.update_tops`)
and reads out the state after the reset, `S = where(start_t, 0, S); o_t = q_t . S; S = a_t S + k_t v_t`,
has readouts of the selects (`reads_reset_states`): in the late sequence the reset then acts on token t's
own state, the gate -inf and the late k zero there, and the final update decays by the last token's own gate.

NOTE [a readout's bonus term]
A readout may add terms that do not read the state: RWKV's o_t = r_t . (S_{t-1} + diag(u) k_t (x) v_t) is
the readout r_t . S_{t-1} plus (r_t . (u * k_t)) v_t, a product of the token's own inputs. Such terms are
kept with the readout (`Readout.bonus`), in the state's indices (a term's one summed index, written apart
from the state's, `(r * u * k).sum(-1)`, is the key's), and the GLA site adds them to its output per token.
Only terms inside the readout's own sum are read so: a term added to a readout afterwards (`q . S_t + z_t`,
the bonus summed apart among them) may be anything, another loop's readout or a running sum, and stays
as written, per token.

NOTE [k and v's dimensions chosen by the readout]
An update whose decay reads neither of the state's two feature dimensions (one decay per head, as
Mamba-2's `h = h * exp(dt A) + (dt x) (x) B`, or none) reads the same either way round: which factor is k
and which is v is then the readout's to say, by the dimension it sums the state over (Mamba-2's `y = h C`
sums over B's). The update's reading tries the usual [..., K, V] order first; when the states' readouts do
not sum over that K, the chain is read again with the two swapped, and kept so when its readouts then fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx

from laplace_passes.fx.algebra import Expr, Factor, NotAlgebraic, Term, read
from laplace_passes.fx.per_step import is_fill
from laplace_passes.infra.fx_helpers import fake_tensor

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
    bonus: tuple = ()  # terms that do not read the state (NOTE [a readout's bonus term]), in S_t's indices


def attach_readouts(chain, memo: dict) -> None:
    """`chain.readouts`, or `chain.mismatch`; k and v swapped when the readouts say so (NOTE [k and v's
    dimensions chosen by the readout])."""
    _attach_readouts(chain, memo)
    if not chain.mismatch:
        return
    either_way = all(_either_way(s) for s in chain.steps)
    first = chain.mismatch, chain.readouts, chain.read_before_update, chain.reads_reset_states
    _swap_key_and_value(chain)
    chain.mismatch, chain.readouts, chain.read_before_update, chain.reads_reset_states = "", [], False, False
    _attach_readouts(chain, memo)
    if chain.mismatch or not either_way:  # the usual reading, and its reason
        read_out_the_other_way = not chain.mismatch
        _swap_key_and_value(chain)
        chain.mismatch, chain.readouts, chain.read_before_update, chain.reads_reset_states = first
        if read_out_the_other_way:
            chain.mismatch = _decay_over_the_kept_dimension(chain.first)


def _decay_over_the_kept_dimension(step) -> str:
    """Why a chain whose states are read out over the dimension its decay does not read is not GLA's (a
    decay over the value dimension, `S * exp(g_t)[..., None, :]`, the readout summing over the key)."""
    rank = len(step.shape)
    return (f"its decay reads dimension {step.key_axis % rank} of the state, which its readout keeps (the "
            f"readout sums over dimension {step.value_axis % rank}): GLA's decay is per key, the dimension the "
            "readout sums over (S_t = diag(a_t) S_{t-1} + k_t (x) v_t, read out as q . S)")


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
    after_resets = _readouts_of_reset_states(chain, chain_nodes, memo) if not any(readouts) else None
    if after_resets is not None:  # NOTE [readouts before the update]: a reset before the readout
        chain.readouts, chain.read_before_update, chain.reads_reset_states = after_resets, True, True
        checked = [*after_resets[1:], None]  # what reads each state besides its update: the next token's readout
    else:
        if readouts[-1] is not None and all(r is None for r in readouts[:-1]):
            # Only the final state is read out (a classifier's last token): a loop that returns its final state,
            # whose readout then reads the GLA call's final state like any other use of it.
            readouts[-1] = None
        before = _initial_readout(chain, readouts, chain_nodes, memo)
        if before is None and any(r is None for r in readouts) and any(r is not None for r in readouts):
            missing = next(s.node.name for s, r in zip(chain.steps, readouts) if r is None)
            chain.mismatch = f"some states are read out and others ({missing}) are not"
            return
        # NOTE [readouts before the update]: token t reads the state token t - 1 left, the first the initial one.
        chain.readouts = [before, *readouts[:-1]] if before is not None else [r for r in readouts if r is not None]
        chain.read_before_update = before is not None
        checked = readouts
    for step, following, readout in zip(chain.steps[:-1], chain.steps[1:], checked):
        extra = _other_uses(step, following, readout)
        if extra:
            used, user = extra
            state = step.node.name if used is step.node else f"{step.node.name} (reset by {used.name})"
            key_dim = step.key_axis % len(step.shape)
            chain.mismatch = (f"the state {state} is also used by {user.name}, outside the recurrence "
                              f"(not a readout q . S summed over the key dimension, {key_dim}: the one its decay "
                              "and k read)")
            return
    if chain.reads_reset_states and any(s.skip is not None for s in chain.steps):
        chain.mismatch = ("a select skips some of its updates and another resets the state its readouts read: a "
                          "skipped token keeps the state from before the reset, which GLA's late sequence cannot "
                          "hold (NOTE [readouts before the update])")


def _readouts_of_reset_states(chain, chain_nodes: set, memo: dict) -> list[Readout] | None:
    """Per token, the readout of the state its update reads after the select that resets it, when every step
    has one and each such state is read out once: packed documents, the state reset at each one's first
    token, then read out and updated (RWKV's order)."""
    if any(s.reset is None for s in chain.steps):
        return None
    found = []
    for step in chain.steps:
        reset = dataclasses.replace(step, node=step.reset.select)
        readouts = _readouts_of(reset, step.node, chain_nodes, memo)
        if len(readouts) != 1:
            return None
        found.append(readouts[0])
    return found


def _initial_readout(chain, readouts: list, chain_nodes: set, memo: dict) -> Readout | None:
    """The readout of the state the loop starts from, when every state but the last is read out and that one
    is too: a loop that reads each state before its update (NOTE [readouts before the update])."""
    start = chain.first.prev
    if start is None or readouts[-1] is not None or any(r is None for r in readouts[:-1]):
        return None
    found = _readouts_of(dataclasses.replace(chain.first, node=start), chain.first.node, chain_nodes, memo)
    return found[0] if len(found) == 1 else None


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
        elif isinstance(readout, Readout) and _bonus_of_the_token(readout, chain_nodes):
            found.append(_extended(readout, step, memo))
    return found


def _bonus_of_the_token(readout: Readout, chain_nodes: set) -> bool:
    """A bonus term is the token's own inputs' (RWKV's u * k_t (x) v_t): not a running sum of the loop's
    readouts (`total = total + q . S`, which reaches the loop's states), a fill it starts from, or a value of
    the state's size (another loop's state)."""
    size = fake_tensor(readout.state).numel()
    for node in {f.node for term in readout.bonus for f in term.factors}:
        value = fake_tensor(node)
        if is_fill(node) or value is None or value.numel() >= size or _reaches_any(chain_nodes, node):
            return False
    return True


def _reaches_any(targets: set, node: Node) -> bool:
    """Whether `node` reads one of `targets` within 11 ops: a bonus term's factors are a token's inputs a few
    ops away (`u * k[:, t]`), and a readout a running sum adds reaches the state in three or four."""
    return _within(targets, node, levels=12)


def _as_readout(node: Node, step, memo: dict):
    """A Readout, "continue" (S_t read whole so far: a product not yet summed), or None."""
    state = step.node
    try:
        expr = read(node, lambda n: n is state, memo.setdefault(("readout", state, node), {}))
    except NotAlgebraic:
        return None
    reading = [t for t in expr.terms if any(f.node is state for f in t.factors)]
    if len(reading) != 1:
        return None
    (term,) = reading
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
    bonus = _bonus_terms(expr, [t for t in expr.terms if t is not term], key, batch | {key, value})
    if bonus is None:
        return None
    return Readout(node, state, expr, queries, term.coef, state_axes, bonus)


def _bonus_terms(expr: Expr, others: list, key, state_indices: set) -> tuple | None:
    """A readout's terms that do not read the state, in the state's indices (their one summed index, if any,
    renamed to the key's); None when one reads other dimensions than the state's."""
    bonus = []
    for term in others:
        summed = expr.summed(term)
        if len(summed) > 1 or any(i.size != key.size for i in summed):
            return None
        rename = {i: key for i in summed}
        factors = tuple(Factor(f.node, tuple(rename.get(a, a) for a in f.axes)) for f in term.factors)
        term = Term(term.coef, factors)
        if term.indices() - state_indices or not factors:
            return None
        bonus.append(term)
    return tuple(bonus)


def _extended(readout: Readout, step, memo: dict) -> Readout:
    """Through the readout's one user while that is still a readout of the state (a scale, a transpose)."""
    while len(readout.node.users) == 1:
        (user,) = readout.node.users
        if user.op != "call_function" and user.op != "call_method":
            break
        longer = _as_readout(user, step, memo)
        # Not through a term added after the readout (`q . S_t + z_t`): z_t may be anything, another loop's
        # readout or state among them; a bonus summed apart stays as written, per token.
        if not isinstance(longer, Readout) or len(longer.bonus) != len(readout.bonus):
            break
        readout = longer
    return readout


def _other_uses(step, following, readout: Readout | None) -> tuple[Node, Node] | None:
    """(the state or the select that resets it for the next update, its user) for a user outside that update's
    ops and the readout's own ops."""
    allowed = _between(step.node, following.node)
    if readout is not None:
        allowed |= _between(step.node, readout.node)
    used = [step.node] + ([following.reset.select] if following.reset is not None else [])
    return next(((n, u) for n in used for u in n.users if u not in allowed), None)


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
    """Whether `node` reads `start` within `limit` ops."""
    return _within({start}, node, levels=limit + 1)


def _within(targets: set, node: Node, levels: int) -> bool:
    """Whether one of `targets` is among `node` and its inputs up to `levels` - 1 ops back."""
    frontier, seen = [node], set()
    for _ in range(levels):
        if any(n in targets for n in frontier):
            return True
        seen |= set(frontier)
        frontier = [i for n in frontier for i in n.all_input_nodes if i not in seen]
    return False
