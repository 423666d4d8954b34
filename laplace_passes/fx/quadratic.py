"""GLA's quadratic (parallel) form, o = (q k^T (.) D) v with D the causal decay matrix, found by what it computes.

NOTE [quadratic form: before and after]
Before (one head dimension of decay per step, G = cumsum(g), T x T tensors A and D):

    A = q @ k.transpose(-1, -2)                                   # [B, H, T, T]
    D = torch.exp(G[..., :, None] - G[..., None, :]).tril()       # exp(G_i - G_j), i >= j
    o = (A * D) @ v                                               # [B, H, T, V]

In the canonical form (NOTE [canonical tensor algebra]) `o` is one term,
q[b,h,i,k] k[b,h,j,k] D[b,h,i,j] v[b,h,j,v] summed over j and k: the query
position i is free and the key position j summed, q reads i and k, k reads
j and k, v reads j and v, and D reads i and j. The gates come from how D is
built: exp of a difference of one cumulative sum at i and at j (the gates
are what was summed), a ratio of one cumulative product at i and at j (the
gates are the log of what was multiplied), or a decay per head raised to
the power i - j (RetNet: its log, the same at every step). D's other
factors must be masks; the rewrite is checked on random inputs like a token
loop's (`laplace_passes.fx.validate`), so a mask that is not causal, or a D
that is not a decay matrix, leaves the graph unchanged. After: one
`laplace::gla` call, so no T x T tensor is computed or kept for backward.
A mask written before the exp as well as after it, `(G_i - G_j).tril().exp().tril()`
(fla's `naive_parallel_simple_gla`), reads as the same cumulative sum: the inner
tril only makes the entries above the diagonal exp(0) = 1, which the outer one
then zeroes, so it counts as no mask of its own.

NOTE [a constant decay matrix]
A D computed from no input at all is read off its values rather than its ops:
fla's `naive_retention` builds RetNet's from ranges, exp2((i - j) log2(gamma))
times (i >= j), with no gamma ** (i - j) node to read. Its values (float64,
the product of D's factors) must be 0 above the diagonal and 1 on it, and
then gamma = D[.., 1, 0] per head (or per key) must give every entry as
gamma ** (i - j) to a relative 1e-4 (D was rounded in its own dtype, an
error that grows with i - j; entries that underflowed there, 0 or
subnormal, to the dtype's smallest normal number). All ones below the
diagonal is the causal mask alone (linear attention, no decay). The gammas
become one new constant node in the form's dtype and on its device, the
decay of every step; if the rewrite is then declined, that node is erased
again. A constant D of any other kind is declined with what it is not.
Meta tensors have no values: such a D is taken for a mask, as any constant
was before, and the random-input check decides.

NOTE [a segment sum]
transformers' Mamba-2 builds D without a difference: `segment_sum(g)`
broadcasts the gates along the keys, g[.., i, None].expand(.., C, C), zeroes
the entries with j >= i (a constant bool mask), and sums cumulatively over i,
so entry (i, j) is g_(j+1) + .. + g_i = G_i - G_j for i >= j; a -inf mask
above the diagonal then goes into the exp. `_segment_sum_gate` reads that:
the cumsum's dimension must be the query position, the summed tensor one
factor that does not read the key position (those are the gates), and the
zero mask's values exactly j < i (a meta mask has none: the random-input
check decides). Another inner mask (one keeping the diagonal gives
G_i - G_(j-1)) is declined with the message that names the segment sum.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from laplace_passes.fx.algebra import Expr, Factor, Index, NotAlgebraic, read
from laplace_passes.fx.per_step import constant_value
from laplace_passes.fx.quadratic_masks import (
    CREATED_HERE, check_masks_keep_the_past, fill_other_than_zero, filled, keeps_earlier_keys, keeps_every_earlier_key,
    with_zero_masks_read, zero_masked,
)
from laplace_passes.fx.token_loop import ROW, TIME, RoleFactors
from laplace_passes.infra.fx_helpers import fake_tensor, new_node
from laplace_passes.infra.op_facts import base_op_name
from laplace_passes.infra.pass_base import Declined
from laplace_passes.infra.strict import strict_mode

Node = torch.fx.Node
aten = torch.ops.aten
# How far a constant decay matrix may be from gamma ** (i - j): it was computed in its dtype (exp2 of a product
# whose rounding grows with i - j, as RetNet's is), and random inputs check the rewrite's outputs anyway.
_CONSTANT_DECAY_RTOL = 1e-4

_CONTRACTIONS = frozenset({torch.matmul, operator.matmul, torch.bmm, torch.einsum, torch.functional.einsum,
                           torch.sum, aten.bmm.default, aten.mm.default, aten.sum.dim_IntList})
_CONTRACTION_METHODS = frozenset({"matmul", "bmm", "sum", "__matmul__"})


@dataclass
class QuadraticForm:
    """A node computing (q k^T (.) D) v, read into the roles a GLA call needs (the plan `GlaBuilder` takes)."""

    node: Node
    expr: Expr
    time: Index  # the query position i (free)
    batch: list[Index]
    key: Index
    value: Index
    roles: dict[str, list[RoleFactors]] = field(default_factory=dict)
    gate_kind: str = "none"  # "log" (the gates themselves), "decay" (their exp) or "none"
    coefs: dict[str, float] = field(default_factory=dict)
    offset: int = 0
    initial_state: Node | None = None
    form: str = ""
    created: list[Node] = field(default_factory=list)  # nodes reading it added (a constant decay): gone if declined

    @property
    def like(self) -> Node:
        return self.node

    @property
    def T(self) -> int:
        return self.time.size

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (*(b.size for b in self.batch), self.key.size, self.value.size)

    @property
    def batch_axes(self) -> list[int]:
        return list(range(len(self.batch)))

    @property
    def key_axis(self) -> int:
        return len(self.batch)

    @property
    def value_axis(self) -> int:
        return len(self.batch) + 1

    def gate_factors(self) -> tuple[str, list[RoleFactors]]:
        return self.gate_kind, self.roles.get("decay", [])

    def gate_sources(self) -> dict[str, set[Node]]:
        return {self.gate_kind: {n for f in self.roles.get("decay", []) for n in f.nodes}}

    def source_nodes(self) -> set[Node]:
        return {n for factors in self.roles.values() for f in factors for n in f.nodes}

    def results(self, steps: int) -> list[Node]:
        return [self.node]

    def output_positions(self) -> tuple:
        where = {index: p for p, index in enumerate(self.batch)} | {self.time: TIME, self.value: self.value_axis}
        return tuple(where.get(a) if a is not None else None for a in self.expr.axes)

    def gla_results(self, builder, old: list[Node], target) -> list[Node]:
        o, _ = builder.gla(self.form or "validation", target=target)
        return [builder.laid_out_whole(builder.outputs_over_steps(o), self.output_positions(), old[0])]


def find_quadratic_forms(graph: torch.fx.Graph) -> list[QuadraticForm | tuple[Node, str]]:
    """Every node of the quadratic form (its plan), or (node, why not) for near misses worth reporting."""
    memo: dict = {}
    found = []
    for node in graph.nodes:
        if not _is_contraction(node):
            continue
        try:
            expr = read(node, lambda n: False, memo)
        except NotAlgebraic:
            continue
        try:
            plan = _plan(node, expr)
        except Declined as declined:
            found.append((node, declined.reason))
            continue
        except Exception as error:  # noqa: BLE001 (a pass never breaks a user's compile: it declines)
            if strict_mode():
                raise
            found.append((node, f"an internal error while reading it: {type(error).__name__}: {error}"))
            continue
        if plan is not None:
            found.append(plan)
    return found


def _is_contraction(node: Node) -> bool:
    value = fake_tensor(node)
    if value is None or value.dim() < 2 or not value.dtype.is_floating_point:
        return False
    if node.op == "call_method":
        return node.target in _CONTRACTION_METHODS
    return node.op == "call_function" and (node.target in _CONTRACTIONS or base_op_name(node) in ("bmm", "mm"))


def _plan(node: Node, expr: Expr) -> QuadraticForm | None:
    """None when `node` is not shaped like the form at all; Declined when it is but something does not fit."""
    if len(expr.terms) != 1:
        return None
    plan = _plan_term(node, expr)
    masked = None if plan is not None else with_zero_masks_read(node, expr)  # NOTE [a product masked as a whole]
    if masked is None:
        return plan
    expr, created = masked
    try:
        plan = _plan_term(node, expr)
    finally:
        if plan is None:  # declined or not the form: the nodes added for it go
            for added in reversed(created):
                node.graph.erase_node(added)
    if plan is not None:
        plan.created += created
    return plan


def _plan_term(node: Node, expr: Expr) -> QuadraticForm | None:
    (term,) = expr.terms
    summed = expr.summed(term)
    free = {a for a in expr.axes if a is not None}
    if len(summed) != 2:
        return None
    for j, key in itertools.permutations(summed):
        roles = _assign(term, free, j, key)
        if roles is not None:
            return _with_gates(node, expr, term.coef, j, key, roles)
    return None


def _assign(term, free: set[Index], j: Index, key: Index):
    """The factors of q (key, not j), k (j and key), v (j and the value), D (i and j), if they fit."""
    reads = [(f, f.indices()) for f in term.factors]
    queries = [f for f, r in reads if key in r and j not in r]
    for i in {x for f in queries for x in f.indices() & free if x.size == j.size}:
        keys = [f for f, r in reads if j in r and key in r and i not in r]
        batch = set().union(*(r & free for f, r in reads if f in keys)) if keys else set()
        values_free = free - batch - {i}
        if not keys or i in batch or len(values_free) != 1:
            continue
        (value,) = values_free
        values = [f for f, r in reads if value in r]
        decays = [f for f, r in reads if f not in keys + queries + values]
        if any(f.indices() - (batch | {j, value}) for f in values) or any(i in f.indices() for f in values):
            continue
        if any(f.indices() - (batch | {i, j, key}) for f in decays):
            continue
        return {"q": queries, "k": keys, "v": values, "D": decays, "i": i, "batch": batch, "value": value}
    return None


def _with_gates(node: Node, expr: Expr, coef: float, j: Index, key: Index, roles: dict) -> QuadraticForm:
    i, value = roles["i"], roles["value"]
    batch = [a for a in expr.axes if a is not None and a in roles["batch"]]
    plan = QuadraticForm(node, expr, i, batch, key, value, coefs={"input": 1.0, "decay": 1.0, "scale": coef,
                                                                   "initial": 1.0})
    where = {index: p for p, index in enumerate(batch)} | {key: len(batch), value: len(batch) + 1}
    for name in ("q", "k", "v"):
        time = i if name == "q" else j
        plan.roles[name] = [RoleFactors([f.node], _positions(f.axes, {**where, time: TIME})) for f in roles[name]]
    if not roles["D"]:
        raise Declined("no causal mask: every query reads every key, so it is attention over the whole "
                       "sequence, not a recurrence")
    with node.graph.inserting_before(node):  # where a constant decay's node goes (`_constant_decay`)
        gate = _gate(roles["D"], i, j, {**where, i: TIME}, node)
    if gate is not None:
        plan.gate_kind, plan.roles["decay"] = gate
        plan.created = [n for f in gate[1] for n in f.nodes if n.meta.get(CREATED_HERE)]
    return plan


def _positions(axes: tuple, where: dict) -> tuple:
    if any(a is not None and a not in where for a in axes):
        raise Declined("a factor reads a dimension the form does not have")
    return tuple(where.get(a) if a is not None else None for a in axes)


def _gate(decays: list[Factor], i: Index, j: Index, where: dict, like: Node):
    """(kind, [RoleFactors]) of the gates D is built from; None for a D that is a mask only (no decay). `like`:
    the form's node."""
    masked = any(_unmasked(f.node) is not f.node or _masked_in_log_space(f.node) or constant_value(f.node) is not None
                 for f in decays)
    for factor in decays:
        check_masks_keep_the_past(factor, i, j)
    for factor in decays:
        inner, axes = _unmasked(factor.node), factor.axes
        for reader in (_cumsum_gate, _cumprod_gate, _power_gate):
            found = reader(inner, axes, i, j)
            if found is not None:
                if not masked:
                    raise Declined("its decay matrix has no causal mask (D_ij for every i and j): every query "
                                   "reads later keys too")
                kind, node, node_axes = found
                return kind, [RoleFactors([node], _positions(node_axes, where))]
    constants = [constant_value(f.node) for f in decays]
    if all(c is not None for c in constants):
        return _constant_decay(decays, constants, i, j, where, like)
    for factor in decays:
        if (fill := fill_other_than_zero(factor.node)) is not None:
            raise Declined(f"its decay matrix D is masked with {fill!r} where the mask drops entries, not 0: the "
                           "keys it drops keep a weight")
    raise Declined("its decay matrix D is not built from a cumulative sum (exp(G_i - G_j), or one segment sum "
                   "that keeps j < i), a ratio of cumulative products, or powers of a decay per head")


def _constant_decay(decays: list[Factor], values: list[torch.Tensor], i: Index, j: Index, where: dict, like: Node):
    """A D computed from no input (RetNet's, built from ranges): None for a causal mask of ones (no decay: linear
    attention), or gamma ** (i - j) tril with one gamma per head (or key), read off D's values (NOTE [a constant
    decay matrix]); the gammas' node has the dtype and device of `like`, the form's node."""
    if any(v.device.type == "meta" for v in values):
        return None  # no values to read: taken for a mask, which the random-input check then tries
    D, axes = _product_over_axes(decays, [v.cpu() for v in values])
    if i not in axes or j not in axes:
        raise Declined("its decay matrix is a constant that does not read both the query and the key position")
    others = [a for a in axes if a not in (i, j)]
    D = D.permute(*(axes.index(a) for a in others), axes.index(i), axes.index(j)).double()
    T = D.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if T < 2 or D.masked_select(~causal).any() or not torch.all(D.diagonal(dim1=-2, dim2=-1) == 1):
        raise Declined("its decay matrix is a constant that is not a causal mask of ones on the diagonal")
    gamma = D[..., 1, 0]
    if torch.all(gamma == 1) and torch.all(D.masked_select(causal) == 1):
        return None  # a causal mask of ones: no decay (linear attention)
    distance = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp(min=0).double()
    expected = gamma[..., None, None] ** distance * causal
    form = fake_tensor(like)
    # Entries that underflowed in D's dtype (a strong decay over many tokens) are 0 or subnormal: below `tiny`.
    if not (gamma > 0).all() or not torch.allclose(D, expected, rtol=_CONSTANT_DECAY_RTOL,
                                                   atol=torch.finfo(form.dtype).tiny):
        raise Declined("its decay matrix is a constant that is not one decay per head raised to the power i - j")
    node = new_node(like.graph, torch.tensor, (gamma.tolist(),), {"dtype": form.dtype, "device": form.device})
    node.meta[CREATED_HERE] = True
    return "decay", [RoleFactors([node], _positions(tuple(others), where))]


def _product_over_axes(decays: list[Factor], values: list[torch.Tensor]) -> tuple[torch.Tensor, list[Index]]:
    """The factors' product, one dimension per axis any of them reads (size-1 broadcast dimensions dropped)."""
    axes: list[Index] = []
    for factor in decays:
        axes += [a for a in factor.axes if a is not None and a not in axes]
    letters = {a: chr(ord("a") + n) for n, a in enumerate(axes)}
    operands, specs = [], []
    for factor, value in zip(decays, values):
        kept = [d for d, a in enumerate(factor.axes) if a is not None]
        operands.append(value.reshape([value.shape[d] for d in kept]).double())
        specs.append("".join(letters[factor.axes[d]] for d in kept))
    return torch.einsum(",".join(specs) + "->" + "".join(letters[a] for a in axes), *operands), axes


def _unmasked(node: Node) -> Node:
    """Through tril / masked_fill / where(mask, x, 0) to what is masked."""
    while node.op in ("call_function", "call_method"):
        name = base_op_name(node)
        if name == "tril" and node.args and isinstance(node.args[0], Node):
            if _tril_diagonal(node) != 0:
                raise Declined("its mask is tril with another diagonal: not the causal mask i >= j")
            node = node.args[0]
        elif name == "triu":
            raise Declined("its mask keeps the upper triangle (each query reads the keys after it): not causal")
        elif (masked := filled(node, 0.0)) is not None:  # masked_fill / where, the fill 0 on either side
            node = masked
        else:
            break
    return node


def _masked_in_log_space(node: Node) -> bool:
    """exp(masked_fill(x, mask, -inf)) or exp(where(mask, x, -inf)): a mask before the exp, its zeros exp(-inf)."""
    return base_op_name(node) == "exp" and isinstance(node.args[0], Node) and _log_unmasked(node.args[0]) is not node.args[0]


def _log_unmasked(node: Node) -> Node:
    """Through masked_fill(mask, -inf) / where(mask, x, -inf) / where(mask, -inf, x) to what is masked (which
    random inputs then check is the causal mask, as for a mask after the exp)."""
    return filled(node, -math.inf) or node


def _two_sided(node: Node, source_of, sign: float, i: Index, j: Index, axes: tuple):
    """node read as +X[.. i ..] - X[.. j ..] (sign 1) or X[.. i ..] / X[.. j ..] terms: X and its axes at i."""
    try:
        expr = read(node, lambda n: source_of(n) is not None, {})
    except NotAlgebraic:
        return None
    if len(expr.terms) != 2 or len(expr.axes) != len(axes):
        return None
    rename = {a: b for a, b in zip(expr.axes, axes) if a is not None}
    plus = [t for t in expr.terms if t.coef == 1.0 and len(t.factors) == 1]
    minus = [t for t in expr.terms if t.coef == sign and len(t.factors) == 1 and t not in plus]
    if len(plus) != 1 or len(minus) != 1 or plus[0].factors[0].node is not minus[0].factors[0].node:
        return None
    x = plus[0].factors[0]
    mapped, other = _renamed(x.axes, rename), _renamed(minus[0].factors[0].axes, rename)
    if i not in mapped or j not in other:
        return None
    return x.node, mapped


def _cumsum_gate(node: Node, axes: tuple, i: Index, j: Index):
    """exp(G_i - G_j) with G = cumsum(g, over the tokens): the gates are g."""
    if base_op_name(node) != "exp" or not isinstance(node.args[0], Node):
        return None
    inner = _log_unmasked(_through_zero_tril(node.args[0], axes, i, j))
    found = _two_sided(inner, _cumsum_source, -1.0, i, j, axes)
    if found is None:
        return _segment_sum_gate(inner, axes, i, j)
    cumsum, mapped = found
    gates = _cumsum_source(cumsum)
    # A slice of a cumsum (G[:, :, i] of a chunked G) reads as a leaf of its own: not the cumsum itself.
    return None if gates is None else ("log", gates, mapped)


def _segment_sum_gate(node: Node, axes: tuple, i: Index, j: Index):
    """The differences G_i - G_j as one cumulative sum (NOTE [a segment sum]): the gates are what it sums."""
    value = fake_tensor(node)
    if base_op_name(node) != "cumsum" or not isinstance(node.args[0], Node) or value is None or value.dim() != len(axes):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(dim, int) or axes[dim % value.dim()] is not i or j not in axes:
        return None
    unmasked, kept = zero_masked(node.args[0])
    if kept is None or not keeps_earlier_keys(kept, value.shape, axes.index(i), axes.index(j)):
        return None
    try:
        expr = read(unmasked, lambda n: False, {})
    except NotAlgebraic:
        return None
    if len(expr.terms) != 1 or len(expr.terms[0].factors) != 1 or expr.terms[0].coef != 1.0:
        return None
    factor = expr.terms[0].factors[0]
    rename = {a: b for a, b in zip(expr.axes, axes) if a is not None}
    mapped = _renamed(factor.axes, rename)
    return ("log", factor.node, mapped) if i in mapped and j not in mapped else None


def _renamed(axes: tuple, rename: dict) -> tuple:
    """A factor's axes in the names of the expression it was read for (None where a size-1 dimension is)."""
    return tuple(rename.get(a) if a is not None else None for a in axes)


def _through_zero_tril(node: Node, axes: tuple, i: Index, j: Index) -> Node:
    """exp((G_i - G_j).tril()).tril(), as fla's parallel simple GLA writes it: the differences above the diagonal
    are 0 before the exp (exp(0) = 1 there, so this tril is no mask: `_gate` still needs one after the exp).
    Any diagonal >= -1 zeroes only differences that are 0 (G_i - G_i) or that the mask after the exp drops; so
    does a zero fill (masked_fill / where) by a constant mask keeping every j < i."""
    if base_op_name(node) == "tril" and node.args and isinstance(node.args[0], Node):
        diagonal = _tril_diagonal(node)
        if isinstance(diagonal, int) and diagonal >= -1:
            return node.args[0]
    value, (unmasked, kept) = fake_tensor(node), zero_masked(node)
    if kept is not None and value is not None and value.dim() == len(axes) and i in axes and j in axes and \
            keeps_every_earlier_key(kept, value.shape, axes.index(i), axes.index(j)):
        return unmasked
    return node


def _tril_diagonal(node: Node):
    """The diagonal a tril keeps from, as written (`x.tril(1)`, `torch.tril(x, diagonal=1)`), 0 when not given."""
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)


def _cumsum_source(node: Node) -> Node | None:
    return node.args[0] if base_op_name(node) == "cumsum" and isinstance(node.args[0], Node) else None


def _cumprod_gate(node: Node, axes: tuple, i: Index, j: Index):
    """P_i / P_j with P = cumprod(a, over the tokens): the decays are a."""
    if base_op_name(node) not in ("div", "truediv") or len(node.args) != 2 or not all(isinstance(a, Node) for a in node.args):
        return None
    numerator = _two_sided_ratio(node, i, j, axes)
    if numerator is None:
        return None
    cumprod, mapped = numerator
    return "decay", cumprod.args[0], mapped


def _two_sided_ratio(node: Node, i: Index, j: Index, axes: tuple):
    top, bottom = node.args
    try:
        a = read(top, lambda n: base_op_name(n) == "cumprod", {})
        b = read(bottom, lambda n: base_op_name(n) == "cumprod", {})
    except NotAlgebraic:
        return None
    if len(a.terms) != 1 or len(b.terms) != 1 or len(a.terms[0].factors) != 1 or len(b.terms[0].factors) != 1:
        return None
    fa, fb = a.terms[0].factors[0], b.terms[0].factors[0]
    if fa.node is not fb.node or base_op_name(fa.node) != "cumprod":
        return None
    n = len(axes)
    ra = {x: y for x, y in zip(((None,) * (n - len(a.axes)) + a.axes), axes) if x is not None}
    rb = {x: y for x, y in zip(((None,) * (n - len(b.axes)) + b.axes), axes) if x is not None}
    mapped = tuple(ra.get(x) if x is not None else None for x in fa.axes)
    other = tuple(rb.get(x) if x is not None else None for x in fb.axes)
    return (fa.node, mapped) if i in mapped and j in other else None


def _power_gate(node: Node, axes: tuple, i: Index, j: Index):
    """gamma ** (i - j), the exponent a constant: the decay is gamma at every step (RetNet)."""
    if base_op_name(node) not in ("pow", "__pow__") or len(node.args) != 2 or not isinstance(node.args[0], Node):
        return None
    exponent = node.args[1]
    value = constant_value(exponent) if isinstance(exponent, Node) else None
    if value is None or value.dim() < 2:
        return None
    T = value.shape[-1]
    expected = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    if value.shape[-2:] != (T, T) or not torch.equal(value.reshape(-1, T, T)[0].to(expected.dtype), expected):
        return None
    base = node.args[0]
    base_value = fake_tensor(base)
    n = len(axes)
    mapped = tuple(axes[n - base_value.dim() + d] if base_value.shape[d] != 1 else None
                   for d in range(base_value.dim()))
    if i in mapped or j in mapped:
        return None
    return "decay", base, mapped


def gate_words(form: QuadraticForm) -> str:
    """How the form's gates are built, as the report says it: "per-head gates summed cumulatively", ..."""
    kinds = {"log": "gates summed cumulatively", "decay": "decays multiplied cumulatively"}
    if form.gate_kind not in kinds:
        return "no gate"
    decays = form.roles.get("decay", [])
    per = "key" if any(form.key_axis in f.positions for f in decays) else "head"
    if form.gate_kind == "decay" and not any(p in f.positions for f in decays for p in (TIME, ROW)):
        return f"a fixed decay per {per} raised to i - j"
    return f"per-{per} {kinds[form.gate_kind]}"


def describe_quadratic(form: QuadraticForm) -> str:
    return f"quadratic form (q k^T (.) D) v, {form.T} tokens, {gate_words(form)}, state {list(form.state_shape)}"
