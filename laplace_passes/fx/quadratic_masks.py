"""The masks on a quadratic form's decay matrix: which keys they keep, read off their constant values.

`laplace_passes.fx.quadratic` reads D from the ops that build it; these
helpers read the masks on it, whose values the graph holds (a mask built
inside forward from its sizes is a constant):
  * `zero_masked`, `keeps_earlier_keys`: a zero mask and whether it keeps
    exactly the keys before the query (a segment sum's, NOTE [a segment sum]);
  * `check_masks_keep_the_past`: a mask on D must keep every key at or
    before the query (a window of recent keys is declined: the random-input
    check could not see what it drops);
  * `with_zero_masks_read` (NOTE [a product masked as a whole]).

NOTE [a product masked as a whole]
fla's `naive_chunk_linear_attn` masks the scores themselves,
`(q @ k^T).masked_fill_(triu(ones, 1), 0) @ v`, so the masked scores read
as one leaf and the form has one summed index, not two. Such a factor, a
product zeroed by a constant mask (`masked_fill(y, m, 0)`, `where(m, y,
0)`), is read as y times the mask it keeps: a bool node (`m` itself, or
`logical_not(m)` added to the graph, erased again if the form is
declined), a constant D that `_constant_decay` then reads (the causal mask
alone: no decay).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.fx

from laplace_passes.fx.algebra import Expr, Factor, Index, NotAlgebraic, Term, read
from laplace_passes.fx.algebra_terms import fresh_sums, rename
from laplace_passes.fx.per_step import constant_value
from laplace_passes.infra.fx_helpers import ancestors, fake_tensor, new_node
from laplace_passes.infra.op_facts import base_op_name
from laplace_passes.infra.pass_base import Declined

Node = torch.fx.Node
CREATED_HERE = "laplace_quadratic_created"  # meta of a node reading a form added to the graph


def with_zero_masks_read(node: Node, expr: Expr) -> tuple[Expr, list[Node]] | None:
    """`expr` (one term) with each factor that zeroes a product by a constant mask read as that product times
    the mask it keeps (NOTE [a product masked as a whole]), and the nodes added for it; None when none is."""
    (term,) = expr.terms
    factors, created = [], []
    coef = term.coef
    for factor in term.factors:
        found = _masked_product(factor)
        if found is None:
            factors.append(factor)
            continue
        inner, mask, kept_where_true = found
        if not kept_where_true:
            with node.graph.inserting_before(node):
                mask = new_node(node.graph, torch.logical_not, (mask,))
            mask.meta[CREATED_HERE] = True
            created.append(mask)
        factors += [*inner.terms[0].factors, Factor(mask, _trailing(factor.axes, fake_tensor(mask).shape))]
        coef *= inner.terms[0].coef
    if not created and len(factors) == len(term.factors):
        return None
    return Expr(expr.axes, (Term(coef, tuple(factors)),)), created


def _masked_product(factor: Factor) -> tuple[Expr, Node, bool] | None:
    """(y read with `factor`'s indices, the mask node, whether it keeps where True) for a zero-masked product y."""
    node = factor.node
    masked = _masking(node)
    if masked is None or masked.number != 0:
        return None
    y, mask, kept_where_true = masked.x, masked.mask, masked.kept_where_true
    value, mask_value = fake_tensor(y), constant_value(mask)
    if value is None or mask_value is None or mask_value.dtype != torch.bool or value.shape != fake_tensor(node).shape:
        return None
    try:
        inner = fresh_sums(read(y, lambda n: False, {}))
    except NotAlgebraic:
        return None
    if len(inner.terms) != 1 or len(inner.terms[0].factors) < 2:
        return None  # a leaf masked (a mask on D itself) is `_gate`'s to read
    return rename(inner, {a: b for a, b in zip(inner.axes, factor.axes) if a is not None}), mask, kept_where_true


def _trailing(axes: tuple, shape) -> tuple:
    """A mask's indices: the product's last ones (it broadcasts from the right), none where its size is 1."""
    last = axes[len(axes) - len(shape):]
    return tuple(a if size != 1 else None for a, size in zip(last, shape))


def zero_masked(node: Node) -> tuple[Node, torch.Tensor | None]:
    """masked_fill(x, m, 0) or where(m, x, 0): x and where it is kept (a constant bool tensor), else (node, None)."""
    masked = _masking(node)
    if masked is None or masked.number != 0:
        return node, None
    value = constant_value(masked.mask)
    if value is None or value.dtype != torch.bool:
        return node, None
    return masked.x, value if masked.kept_where_true else ~value


def fill_other_than_zero(node: Node) -> float | None:
    """The number a masking of D (`where(m, x, 1.0)`, `masked_fill(x, m, 1)`) puts where it drops entries, when
    that number is known and not 0; None otherwise."""
    masked = _masking(node)
    number = masked.number if masked is not None else None
    return number if number is not None and number != 0 else None


def filled(node: Node, fill: float) -> Node | None:
    """x of masked_fill(x, m, fill), where(m, x, fill) or where(m, fill, x) (the mask either way round); else None.
    Which entries the mask keeps the callers check, or the random-input check does."""
    masked = _masking(node)
    return masked.x if masked is not None and masked.number == fill else None


def keeps_every_earlier_key(kept: torch.Tensor, shape, i_dim: int, j_dim: int) -> bool:
    """Whether a mask keeps every entry (i, j) with j < i, the others or not (meta masks have no values: no)."""
    if kept.device.type == "meta":
        return False
    kept = _over_query_and_key(kept, shape, i_dim, j_dim)
    earlier = torch.ones(shape[i_dim], shape[j_dim], dtype=torch.bool).tril(-1)
    return kept is not None and not (earlier & ~kept).any()


def keeps_earlier_keys(kept: torch.Tensor, shape, i_dim: int, j_dim: int) -> bool:
    """Whether a mask keeps entry (i, j) exactly when j < i (meta masks have no values: the random check decides)."""
    if kept.device.type == "meta":
        return True
    kept = _over_query_and_key(kept, shape, i_dim, j_dim)
    if kept is None:
        return False
    T = shape[i_dim]
    return torch.equal(kept, torch.ones(T, T, dtype=torch.bool).tril(-1).expand_as(kept))


def check_masks_keep_the_past(factor: Factor, i: Index, j: Index) -> None:
    """Decline a constant mask on D (0 after the exp, -inf before it) that drops a key j <= i: a window of
    recent keys is no recurrence, and the random-input check, whose decays leave little of a key some 20
    tokens back, would not see what it drops. Which future keys a mask drops the check does see."""
    value = fake_tensor(factor.node)
    if value is None or i not in factor.axes or j not in factor.axes:
        return
    node, dropping = factor.node, 0.0  # the fill that drops an entry: 0 after the exp, -inf inside it
    for _ in range(8):  # the masks, trils and exp between D and what it is built from
        name = base_op_name(node) if node.op in ("call_function", "call_method") else ""
        if name == "exp" and node.args and isinstance(node.args[0], Node):
            inner, dropping = node.args[0], -math.inf
        elif name == "tril" and node.args and isinstance(node.args[0], Node):
            inner = node.args[0]
        else:
            masked = _masking(node)
            if masked is None or masked.number is None:
                return
            inner, kept = masked.x, constant_value(masked.mask)
            if kept is None and _computed_from_values(masked.mask):
                raise Declined(f"its mask on D ({masked.mask.name}) is computed from the values of the graph's "
                               "inputs: random inputs cannot show which entries such a mask drops; a causal mask "
                               "built inside forward from its sizes is read as the constant it is")
            if masked.number == dropping and kept is not None and kept.dtype == torch.bool and kept.device.type != "meta":
                _check_kept(kept if masked.kept_where_true else ~kept, value.shape, factor.axes.index(i),
                            factor.axes.index(j))
        inner_value = fake_tensor(inner) if isinstance(inner, Node) else None
        if inner_value is None or inner_value.shape != value.shape:
            return
        node = inner


def _computed_from_values(mask: Node) -> bool:
    """Whether `mask` is computed in the graph from a floating-point input (`k.abs().amax(-1) > 1.5`); a bool mask
    passed in or held in a buffer is the random-input check's to name (validate.py)."""
    if mask.op not in ("call_function", "call_method"):
        return False
    return any(n.op in ("placeholder", "get_attr") and (v := fake_tensor(n)) is not None and v.dtype.is_floating_point
               for n in ancestors([mask]))


class _Masked(NamedTuple):
    x: Node
    mask: Node
    kept_where_true: bool  # the mask keeps x where it is True (masked_fill's: where it is False)
    fill: object  # what the other entries get, as written (a number, or a node)
    # The fill when it is a number (not a bool), or a node holding one number everywhere and computed from no
    # input's values (`torch.zeros_like(D)`): the fills the readers compare. Found once, in `_masked`.
    number: float | None


def _masked(x: Node, mask: Node, kept_where_true: bool, fill: object) -> _Masked:
    if isinstance(fill, Node):
        number = _uniform_fill(fill, (x, mask))
    else:
        number = None if isinstance(fill, bool) or not isinstance(fill, (int, float)) else fill
    return _Masked(x, mask, kept_where_true, fill, number)


def _uniform_fill(fill: Node, others: tuple[Node, ...]) -> float | None:
    """The one number a constant tensor `fill` holds, when it broadcasts into the shape of `others` (a fill that
    widened the select's result would not be a number in its place); None otherwise."""
    value, shapes = constant_value(fill), [fake_tensor(n) for n in others]
    if value is None or value.numel() == 0 or any(s is None for s in shapes):
        return None
    kept_shape = torch.broadcast_shapes(*(s.shape for s in shapes))
    try:
        if torch.broadcast_shapes(value.shape, kept_shape) != kept_shape:
            return None
    except RuntimeError:
        return None
    first = value.reshape(-1)[0]
    return float(first) if bool((value == first).all()) else None


def _masking(node: Node) -> _Masked | None:
    """masked_fill(x, m, fill), where(m, x, fill) or where(m, fill, x), with x and m nodes; None otherwise. The
    callers say which fills they take."""
    name = base_op_name(node) if node.op in ("call_function", "call_method") else ""
    args = node.args
    if len(args) != 3:
        return None
    if name in ("masked_fill", "masked_fill_") and isinstance(args[1], Node):
        masked = _masked(args[0], args[1], False, args[2])
    elif name == "where" and isinstance(args[0], Node) and isinstance(args[1], Node):
        masked = _masked(args[1], args[0], True, args[2])
        if isinstance(args[2], Node) and masked.number is None:  # where(m, zeros_like(x), x): the fill first
            flipped = _masked(args[2], args[0], False, args[1])
            masked = flipped if flipped.number is not None else masked
    elif name == "where" and isinstance(args[0], Node) and isinstance(args[2], Node):
        masked = _masked(args[2], args[0], False, args[1])  # where(m, fill, x)
    else:
        return None
    return masked if isinstance(masked.x, Node) else None


def _over_query_and_key(kept: torch.Tensor, shape, i_dim: int, j_dim: int) -> torch.Tensor | None:
    """A mask broadcast to D's shape, the query and key dimensions last; None when it does not broadcast."""
    try:
        return kept.broadcast_to(tuple(shape)).movedim((i_dim, j_dim), (-2, -1))
    except RuntimeError:
        return None


def _check_kept(kept: torch.Tensor, shape, i_dim: int, j_dim: int) -> None:
    kept = _over_query_and_key(kept, shape, i_dim, j_dim)
    if kept is None:
        return  # not a mask over D's dimensions: the random-input check decides
    past = torch.ones(kept.shape[-2], kept.shape[-1], dtype=torch.bool).tril()
    if not (past & ~kept).any():
        return
    if (~past & kept).any():
        raise Declined("its mask drops keys at or before the query and keeps later ones: not causal")
    raise Declined("its causal mask also drops keys at or before the query (a window of recent keys?), so it is "
                   "not a recurrence over every earlier token")
