"""What a state update is written with at its top: the ops `laplace_passes.fx.recurrence` reads as a step.

A step of a recurrence is found by its last op, the one that produces the next state: a sum (`S * a + k v`,
`torch.add`, the fused multiply-adds), or a product of such a sum (`(S + k v) * a`, NOTE [a decay after the
sum]), or a select that skips the update (`torch.where(c, S * a + k v, S)`, NOTE [steps a select skips]).
The canonical algebra (`laplace_passes.fx.algebra`) then reads the whole update from there. A select may
also reset the state the update reads (`torch.where(r, 0, S) * a + k v`, NOTE [states a select resets]).

NOTE [a decay after the sum]
`S_t = (S_{t-1} + k_t (x) v_t) * a_t` decays the token's own term too. Multiplied out it is

    S_t = a_t (.) S_{t-1} + (a_t (.) k_t) (x) v_t

GLA's form with the key scaled by the decay, so when a_t reads only the state's batch and key dimensions
(a decay per key or per head, which is all GLA's decay may read), the step is GLA's and the algebra's
reading of the product says so: the decay's factor lands in the input term beside k, where `_assign_axes`
counts it with the key. The same graph also reads as the usual `S * a + k v` with the sums as states, each
decayed by the next step's product; the two readings differ only where the loop starts and ends. So such a
product is taken as an update only where it is read as a state is, by more than one user (read out and
carried to the next step, or read out and returned). A readout `(q[..., None] * S).sum(-2)` is a product
of the state's shape too, but has one user, its sum. A loop of this spelling whose products have one user
each (only the final state returned, or the last state read out and not returned) keeps the other reading,
in which its first or last step differs from the rest: it is declined with that reason, numbers unchanged.

NOTE [steps a select skips]
`S_t = torch.where(c_t, a_t (.) S_{t-1} + k_t (x) v_t, S_{t-1})` (padding tokens, or documents of several
lengths in one batch, that leave the state as it was) is GLA's step with, where c_t is false, the gate 0
(decay 1), k_t = 0 and v_t = 0: exactly S_{t-1} again, and no gradient to that token's a, k or v, as the
select gives none. So a select between an update and the state it updates is a step: the update (a sum,
or a product of one, NOTE [a decay after the sum]) is read as any other, and `Step.skip` keeps the condition, which the GLA call's inputs then apply
(`laplace_passes.fx.gla_build`). The condition must be a bool tensor that chooses per sequence or per
head, not per key or value channel (it would not be one GLA step then: the token's term would be kept in
some channels of the state and not others); `torch.where(c, S, update)` keeps the state where c is true.
v is zeroed too, not only k, so that a non-finite v at a skipped token stays out of the state, as the
select keeps it out.

NOTE [states a select resets]
`S_t = a_t (.) torch.where(r_t, 0, S_{t-1}) + k_t (x) v_t` (documents packed into one sequence: the state
starts again at each document's first token) is GLA's step with the gate -inf where r_t is true: a decay of
exactly 0, which every GLA form takes as a reset, with no gradient to the earlier state or that token's gate,
as the select passes none (NOTE [resets in a trained decay] in `laplace_passes.fx.gla_build`). The update
reads the select where it would read the state; the select's other branch is 0 (a number or a zero fill) and
its first branch the state itself, so the step's previous state is that branch (`Step.reset`), and the
select's condition, bool and per sequence or head as a skip's, sets the gates. `torch.where(keep, S, 0)`
resets where `keep` is false. The zero is a number or a zero fill that only selects read (one written in
place holds what that wrote). A select at some steps only (a cached state reset once before the loop, a reset
at one step) is read as before: a state the loop starts from, the chain cut there
(`recurrence._split_at_some_resets`). One difference remains for non-finite values: a state that holds inf or NaN
before a reset is multiplied by the decay 0 in GLA's forms (NaN after the reset), where the select drops it.

NOTE [a sum only a readout reads]
RWKV's readout r_t . (S_{t-1} + u * k_t (x) v_t) adds to the state too, and `S + u * kv` reads like a second
update of S_{t-1}, beside the real one, `S * a + kv`. Where a state has several such updates and exactly one
of them goes on to later steps, the others, which go nowhere, are parts of a readout, not steps
(`without_read_out_sums`). At the last state none goes on: there the one written like the updates that
went on (the same number of factors in each term) stays a step. The outer product `kv`, used by both, is
computed from the token's inputs: the update reads through it (`broadcast_product`) when it would
otherwise read two previous states.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from laplace_passes.fx.per_step import is_fill
from laplace_passes.infra.fx_helpers import fake_tensor
from laplace_passes.infra.guards import same_shape
from laplace_passes.infra.op_facts import base_op_name

Node = torch.fx.Node
aten = torch.ops.aten

# A sum, or a fused multiply-add that the canonical algebra reads as one (addcmul, baddbmm, addmm, addbmm,
# addr: beta * S + alpha * k v).
_ADDS = frozenset({operator.add, operator.sub, torch.add, torch.sub, aten.add.Tensor, aten.sub.Tensor,
                   operator.iadd, operator.isub, torch.addcmul, torch.baddbmm, torch.addmm, torch.addbmm,
                   torch.addr, aten.addcmul.default, aten.baddbmm.default, aten.addmm.default,
                   aten.addbmm.default, aten.addr.default})
# In-place sums too: the algebra reads them where they write to a temporary (NOTE [in-place writes to temporaries]).
_ADD_METHODS = frozenset({"add", "sub", "addcmul", "baddbmm", "addmm", "addbmm", "addr",
                          "add_", "sub_", "addcmul_", "__iadd__", "__isub__"})
IN_PLACE_SUM_METHODS = frozenset(m for m in _ADD_METHODS if m.endswith("_") and not m.endswith("__"))
_PRODUCTS = frozenset({operator.mul, torch.mul, aten.mul.Tensor})
_SELECTS = frozenset({torch.where, aten.where.self})


@dataclass(frozen=True)
class SkipSelect:
    """`torch.where(condition, update, kept)` (or with the two swapped, `updates_when` False): NOTE [steps a
    select skips]."""

    condition: Node
    update: Node
    kept: Node
    updates_when: bool = True


@dataclass(frozen=True)
class ResetSelect:
    """`torch.where(condition, 0, state)` (or the two swapped, `resets_when` False): NOTE [states a select
    resets]."""

    select: Node
    condition: Node
    state: Node
    resets_when: bool = True


def reset_select(node: Node) -> ResetSelect | None:
    """`node` as a select between a state and 0, or None. What else reads it besides the update (a readout
    of the state after the reset) is the readouts' to allow (`readouts._other_uses`)."""
    if is_masked_fill(node) and len(node.args) + len(node.kwargs) == 3 and set(node.kwargs) <= {"mask", "value"}:
        # S.masked_fill(starts, 0), or with its mask and value named
        state, condition, fill = (*node.args, *(node.kwargs[k] for k in ("mask", "value") if k in node.kwargs))
        resets = isinstance(condition, Node) and _is_bool(condition) and _is_zero(fill) and isinstance(state, Node)
        return ResetSelect(node, condition, state) if resets and same_shape(_shape(state), _shape(node)) else None
    if node.op != "call_function" or node.target not in _SELECTS or len(node.args) != 3 or node.kwargs:
        return None
    condition, first, second = node.args
    if not isinstance(condition, Node) or not _is_bool(condition):
        return None
    readings = [(zero, state, resets_when) for zero, state, resets_when in ((first, second, True), (second, first, False))
                if _is_zero(zero) and isinstance(state, Node) and same_shape(_shape(state), _shape(node))]
    # Both branches zero (at a loop's zero first state): the 0 is the one made from the other, `zeros_like(S)`.
    readings.sort(key=lambda r: not (isinstance(r[0], Node) and r[1] in r[0].all_input_nodes))
    return ResetSelect(node, condition, readings[0][1], readings[0][2]) if readings else None


def is_masked_fill(node: Node) -> bool:
    return node.op == "call_method" and node.target == "masked_fill" or \
        node.op == "call_function" and node.target in (torch.masked_fill, aten.masked_fill.Scalar)


def _is_zero(value) -> bool:
    """0, or a zero fill that only selects read: a fill written in place (`z.fill_(0.5)`) holds what that
    wrote, which the graph between the two would not show."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    return isinstance(value, Node) and base_op_name(value) in _ZERO_FILLS and \
        all(u.op == "call_function" and u.target in _SELECTS for u in value.users)


_ZERO_FILLS = frozenset({"zeros", "zeros_like", "new_zeros"})


def is_sum_node(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in _ADD_METHODS
    return node.op == "call_function" and node.target in _ADDS


def is_update_node(node: Node) -> bool:
    """A sum, a product of a sum that only it reads, read as a state is (NOTE [a decay after the sum]), or a
    select that skips an update (NOTE [steps a select skips])."""
    return is_sum_node(node) or _decayed_sum(node) or skip_select(node) is not None


def within_an_update(node: Node) -> bool:
    """An update, or the part of one that a select then chooses (`(S + k v) * a` in `torch.where(c, (S + k v)
    * a, S)`): a sum whose one user this is belongs to the same update."""
    if is_update_node(node):
        return True
    return _product_of_a_sum(node) and len(node.users) == 1 and skip_select(next(iter(node.users))) is not None


def skip_select(node: Node) -> SkipSelect | None:
    """`node` as a select between an update and the state it would update, or None."""
    if node.op != "call_function" or node.target not in _SELECTS or len(node.args) != 3 or node.kwargs:
        return None
    condition, first, second = node.args
    if not all(isinstance(a, Node) for a in node.args) or not _is_bool(condition):
        return None
    shape = _shape(node)
    for update, kept, updates_when in ((first, second, True), (second, first, False)):
        if same_shape(_shape(update), shape) and same_shape(_shape(kept), shape) and len(update.users) == 1 \
                and (is_sum_node(update) or _product_of_a_sum(update)):  # the update's one user: this select
            return SkipSelect(condition, update, kept, updates_when)
    return None


def why_kept(select: Node, kept: Node, prev: Node, reset: ResetSelect | None) -> str:
    """Why a select that skips an update is not GLA's skip: it keeps another state than the one the update
    decays (`prev`), or the state a reset select leaves, so that a skipped token still resets."""
    if reset is not None and kept is reset.select:
        return (f"its select {select.name} keeps the state its reset select {kept.name} leaves where it skips the "
                "update, so a skipped token still resets, which GLA's skip (the gate 0) does not")
    return f"its select {select.name} keeps {kept.name} where it skips the update, not the state the update " \
        f"decays ({prev.name})"


def selects_against(node: Node, state: Node | None) -> bool:
    """`node` is a select with `state` as one of its branches: a step that may be skipped, whatever its update."""
    return node.op == "call_function" and node.target in _SELECTS and state is not None and state in node.args[1:]


def _is_bool(node: Node) -> bool:
    value = fake_tensor(node)
    return value is not None and value.dtype == torch.bool


def _decayed_sum(node: Node) -> bool:
    return _product_of_a_sum(node) and len(node.users) > 1


def _product_of_a_sum(node: Node) -> bool:
    is_product = node.target in _PRODUCTS if node.op == "call_function" else \
        node.op == "call_method" and node.target == "mul"
    if not is_product:
        return False
    shape = _shape(node)
    return any(isinstance(a, Node) and is_sum_node(a) and len(a.users) == 1 and same_shape(_shape(a), shape)
               for a in node.args)


def broadcast_product(node: Node, numel: int) -> bool:
    """A value of `numel` elements computed from smaller tensors only (k_t (x) v_t in any spelling, `k[...,
    None] * v[..., None, :]`, `k.unsqueeze(-1) @ v.unsqueeze(-2)`, an einsum; RWKV's `kv`, used by the update
    and by a readout's bonus term): the step's input, computed anew at each step, not a carried state."""
    values = [fake_tensor(a) for a in node.all_input_nodes]
    return node.op in ("call_function", "call_method") and bool(values) and not is_fill(node) \
        and all(v is not None and v.numel() < numel for v in values)


def next_steps(steps: dict) -> dict[Node, list]:
    """Each previous state's updates (`laplace_passes.fx.steps.Step`s, by their `prev`)."""
    next_of: dict[Node, list] = {}
    for step in steps.values():
        if step.prev is not None:
            next_of.setdefault(step.prev, []).append(step)
    return next_of


def without_read_out_sums(steps: dict) -> dict:
    """`steps` without the sums that only a readout reads (NOTE [a sum only a readout reads])."""
    next_of = next_steps(steps)
    dropped, kept = set(), set()
    for nexts in next_of.values():
        going_on = [s for s in nexts if s.node in next_of]
        if len(nexts) > 1 and len(going_on) == 1:
            dropped |= {s.node for s in nexts if s.node not in next_of}
            kept.add(_written_as_sum(going_on[0]))
    for nexts in next_of.values():
        like = [s for s in nexts if _written_as_sum(s) in kept]
        if len(nexts) > 1 and not any(s.node in next_of for s in nexts) and len(like) == 1:
            dropped |= {s.node for s in nexts if s is not like[0]}
    return {n: s for n, s in steps.items() if n not in dropped}


def _written_as_sum(step) -> tuple:
    return tuple(sorted(len(t.factors) for t in step.expr.terms))


def _shape(node: Node) -> tuple | None:
    value = fake_tensor(node)
    return tuple(value.shape) if value is not None else None
