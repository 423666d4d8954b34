"""A canonical algebraic form of what a graph computes: sums of products of tensors, with named indices.

NOTE [canonical tensor algebra]
Users write the same product in many spellings: `(q[..., None] * S).sum(-2)`,
`torch.einsum("bhk,bhkv->bhv", q, S)`, `(q.unsqueeze(-2) @ S).squeeze(-2)`,
`torch.bmm(...)`. To recognise a computation by what it computes rather
than by its ops, each value is read as an `Expr`: one index per dimension
(`axes`; None for a dimension of size 1, which broadcasts) and a sum of
`Term`s, each a coefficient times a product of `Factor`s, a factor being a
graph node (a leaf) with one index per dimension of its value. An index that
appears in factors but not in `axes` is summed over. So all four spellings
above read

    Expr(axes=(b, h, v), terms=[1.0 * q[b, h, k] * S[b, h, k, v]])      (k summed)

and a state update `S * exp(g)[..., None] + k[..., :, None] * v[..., None, :]`

    Expr(axes=(b, h, k, v), terms=[1.0 * S[b, h, k, v] * exp(g)[b, h, k],
                                   1.0 * k[b, h, k] * v[b, h, v]])

Products, sums, differences, numbers, sums over dimensions, einsum (an
ellipsis or an implicit output included), matmul / bmm / mm / outer, the
fused forms addcmul / baddbmm / addmm / addbmm / addr (with their value,
beta and alpha), broadcasting, unsqueeze and `[..., None]`, squeeze,
transpose / permute, expand / expand_as, reshapes that only add or drop size-1
dimensions, contiguous / clone / casts (the same value) are read
algebraically, in torch-level spellings (Dynamo graphs) and ATen ones
(unrolled loops), and in-place arithmetic on a temporary nothing else reads
(`S = S * a; S += k v`, NOTE [in-place writes to temporaries]). Anything
else is a leaf: `exp(g)`, `k[:, t]`, a division by a tensor, any other
in-place write (`S.addcmul_(k, v)`: other nodes read the written value
under the old name). Which nodes to read as leaves although
they are algebraic (a previous state) is the caller's `stop`; why a node
that computes something was read as a leaf is kept in the memo
(`why_unread`), for the report.

The form is a reading aid for matching, not a proof: a recognised rewrite is
also checked by running both on random inputs (`laplace_passes.fx.recognise`).
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx

from laplace_passes.fx.algebra_terms import (
    Expr, Factor, Index, NotAlgebraic, Term, add, einsum, expand, leaf, matmul, multiply, permute, renamed_fresh,
    reshape, scale, squeeze, sum_over, unsqueeze,
)
from laplace_passes.fx.in_place_writes import owns_its_memory
from laplace_passes.infra.fx_helpers import fake_tensor

# The form's types are this module's too: the passes read nodes here and take the types from here.
__all__ = ["UNREAD", "Expr", "Factor", "Index", "NotAlgebraic", "Term", "read", "why_unread", "writes_a_temporary"]

Node = torch.fx.Node
aten = torch.ops.aten
UNREAD = "unread"  # in `read`'s memo: node -> why it was read as a leaf (NotAlgebraic's message)


# -- reading a graph ------------------------------------------------------------------------------------


def read(node: Node, stop: Callable[[Node], bool], memo: dict | None = None) -> Expr:
    """`node`'s canonical form, reading through algebraic ops and stopping at nodes `stop` accepts."""
    memo = {} if memo is None else memo
    if node in memo:
        return renamed_fresh(memo[node])  # each use of a value names its dimensions anew
    expr = leaf(node)
    if not stop(node):
        try:
            expr = _interpret(node, lambda n: read(n, stop, memo))
        except NotAlgebraic as error:
            memo.setdefault(UNREAD, {})[node] = str(error)
        except RecursionError:  # a chain of ops too deep to read is a leaf
            memo.setdefault(UNREAD, {})[node] = "a chain of ops too deep to read"
    memo[node] = expr
    return expr


def why_unread(memo: dict, node: Node) -> str | None:
    """Why `read` (with this memo) took `node` for a leaf although it computes something, if it did."""
    return memo.get(UNREAD, {}).get(node)


def _number(x) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    return None


def _operand(x, sub) -> Expr | float:
    if isinstance(x, Node):
        return sub(x)
    number = _number(x)
    if number is None:
        raise NotAlgebraic("an operand that is neither a tensor nor a number")
    return number


def _times(a, b) -> Expr:
    if isinstance(a, float) and isinstance(b, float):
        raise NotAlgebraic("numbers only")
    if isinstance(a, float):
        return scale(b, a)
    if isinstance(b, float):
        return scale(a, b)
    return multiply(a, b)


def _plus(a, b, alpha: float = 1.0) -> Expr:
    if isinstance(a, float) or isinstance(b, float):  # x + 1 has no product form worth reading
        number = a if isinstance(a, float) else b * alpha
        raise NotAlgebraic(f"adding a number ({number:g}): an affine term, not a sum of products")
    return add(a, b, alpha)


def _args(node: Node) -> tuple[list, dict]:
    return list(node.args), dict(node.kwargs)


def _interpret(node: Node, sub) -> Expr:
    in_place = _IN_PLACE.get(node.target) if node.op in ("call_function", "call_method") else None
    if in_place is not None and writes_a_temporary(node):
        args, kwargs = _args(node)
        return in_place(sub, args, kwargs)
    if node.op == "call_method":
        handler = _METHODS.get(node.target)
        if handler is None:
            raise NotAlgebraic(_unknown(node.target))
        args, kwargs = _args(node)
        return handler(sub, args, kwargs)
    if node.op != "call_function":
        raise NotAlgebraic(node.op)
    handler = _FUNCTIONS.get(node.target) or _FUNCTIONS.get(getattr(node.target, "overloadpacket", None))
    if handler is None:
        raise NotAlgebraic(_unknown(getattr(node.target, "__name__", str(node.target))))
    args, kwargs = _args(node)
    return handler(sub, args, kwargs)


def writes_a_temporary(node: Node) -> bool:
    """Whether `node` writes in place to a value no other node reads: one computed by an op of its own
    (not a view of another node's memory) whose only reader is `node`.

    NOTE [in-place writes to temporaries]: `S = S * a; S += k (x) v` adds in place to the product it has
    just computed, which nothing else reads: the write changes no value another node sees, so it is
    read as the sum it computes (`S * a + k (x) v`). A write to anything else (a graph input, a view, a
    value read again elsewhere) stays an in-place write, which the algebra does not read.
    """
    written = node.args[0] if node.args else None
    if not isinstance(written, Node) or written.op not in ("call_function", "call_method") or len(written.users) != 1:
        return False
    if written.target in _IN_PLACE:  # `S = S.clone(); S *= a; S += k v`: its memory is the temporary it wrote
        return writes_a_temporary(written)
    return owns_its_memory(written)  # a view (of an unbind's tuple too) writes its base


def _unknown(name: str) -> str:
    # An in-place write changes a value other nodes read under their own names: not a sum of products.
    if name.endswith("_") and not name.endswith("__"):
        return f"{name}, an in-place write"
    return f"{name}, an op the algebra does not read"


def _coefficient(kwargs: dict, name: str) -> float:
    value = _number(kwargs.get(name, 1.0))
    if value is None:
        raise NotAlgebraic(f"a {name} that is not a number")
    return value


def _three_tensors(args: list) -> None:
    if len(args) != 3 or not all(isinstance(a, Node) for a in args):
        raise NotAlgebraic("a fused multiply-add whose operands are not three tensors")


def _plus_scaled(sub, base: Node, beta: float, product: Expr) -> Expr:
    """beta * base + product, as addcmul / baddbmm / addmm compute it: beta = 0 ignores `base` (NaN included)."""
    if beta == 0:
        return product
    return add(scale(sub(base), beta), product)


def _h_addcmul(sub, args, kwargs):
    """addcmul(input, t1, t2, value=c) = input + c * t1 * t2."""
    _three_tensors(args)
    product = scale(multiply(sub(args[1]), sub(args[2])), _coefficient(kwargs, "value"))
    return _plus_scaled(sub, args[0], 1.0, product)


def _h_baddbmm(sub, args, kwargs, batch_summed: bool = False):
    """baddbmm / addmm / addbmm(input, m1, m2, beta=b, alpha=a) = b * input + a * (m1 @ m2), addbmm summing
    the products over the batch."""
    _three_tensors(args)
    product = matmul(sub(args[1]), sub(args[2]))
    if batch_summed:
        product = sum_over(product, [0], False)
    return _plus_scaled(sub, args[0], _coefficient(kwargs, "beta"), scale(product, _coefficient(kwargs, "alpha")))


def _h_addbmm(sub, args, kwargs):
    return _h_baddbmm(sub, args, kwargs, batch_summed=True)


def _h_addr(sub, args, kwargs):
    """addr(input, u, v, beta=b, alpha=a) = b * input + a * outer(u, v)."""
    _three_tensors(args)
    product = scale(_h_outer(sub, args[1:], {}), _coefficient(kwargs, "alpha"))
    return _plus_scaled(sub, args[0], _coefficient(kwargs, "beta"), product)


def _h_mul(sub, args, kwargs):
    return _times(_operand(args[0], sub), _operand(args[1] if len(args) > 1 else kwargs["other"], sub))


def _h_add(sub, args, kwargs, sign: float = 1.0):
    alpha = _number(kwargs.get("alpha", args[2] if len(args) > 2 else 1.0))
    if alpha is None:
        raise NotAlgebraic("alpha")
    return _plus(_operand(args[0], sub), _operand(args[1] if len(args) > 1 else kwargs["other"], sub), sign * alpha)


def _h_sub(sub, args, kwargs):
    return _h_add(sub, args, kwargs, -1.0)


def _h_div(sub, args, kwargs):
    if kwargs.get("rounding_mode") is not None:
        raise NotAlgebraic("rounding division")
    divisor = _number(args[1] if len(args) > 1 else kwargs.get("other"))
    if divisor is None or divisor == 0:
        raise NotAlgebraic("division by a tensor")
    return scale(_operand(args[0], sub), 1.0 / divisor)


def _h_neg(sub, args, kwargs):
    return scale(sub(args[0]), -1.0)


def _h_same(sub, args, kwargs):
    return sub(args[0])


def _dims(value) -> list[int] | None:
    if value is None:
        return None
    return [value] if isinstance(value, int) else list(value)


def _h_sum(sub, args, kwargs):
    x = sub(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if "dtype" in kwargs and kwargs["dtype"] is not None:
        pass  # a cast: the same value
    dims = _dims(dim)
    return sum_over(x, list(range(len(x.axes))) if dims is None else dims, bool(keepdim))


def _h_unsqueeze(sub, args, kwargs):
    return unsqueeze(sub(args[0]), args[1] if len(args) > 1 else kwargs["dim"])


def _h_squeeze(sub, args, kwargs):
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return squeeze(sub(args[0]), _dims(dim))


def _h_permute(sub, args, kwargs):
    order = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else args[1]
    return permute(sub(args[0]), list(order))


def _h_transpose(sub, args, kwargs):
    x = sub(args[0])
    n = len(x.axes)
    d0, d1 = args[1] % n, args[2] % n
    order = list(range(n))
    order[d0], order[d1] = order[d1], order[d0]
    return permute(x, order)


def _h_t(sub, args, kwargs):
    x = sub(args[0])
    return x if len(x.axes) < 2 else permute(x, [1, 0])


def _h_view(sub, args, kwargs):
    shape = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else args[1]
    if any(not isinstance(d, int) for d in shape):
        raise NotAlgebraic("a view to sizes computed at run time")
    return reshape(sub(args[0]), list(shape))


def _h_expand(sub, args, kwargs):
    sizes = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else args[1]
    if any(not isinstance(d, int) for d in sizes):
        raise NotAlgebraic("expand to sizes computed at run time")
    return expand(sub(args[0]), list(sizes))


def _h_expand_as(sub, args, kwargs):
    """`a.expand_as(S)`: a broadcast to S's sizes; S lends its shape only, none of its values."""
    other = fake_tensor(args[1])
    if other is None or any(not isinstance(d, int) for d in other.shape):
        raise NotAlgebraic("expand_as a tensor whose sizes are not known")
    return expand(sub(args[0]), list(other.shape))


def _h_einsum(sub, args, kwargs):
    equation, *operands = args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or not all(isinstance(o, Node) for o in operands):
        raise NotAlgebraic("einsum")
    return einsum(equation, [sub(o) for o in operands])


def _h_matmul(sub, args, kwargs):
    return matmul(sub(args[0]), sub(args[1]))


def _h_outer(sub, args, kwargs):
    a, b = sub(args[0]), sub(args[1])
    if len(a.axes) != 1 or len(b.axes) != 1:
        raise NotAlgebraic("outer")
    return multiply(unsqueeze(a, 1), unsqueeze(b, 0))


def _h_getitem(sub, args, kwargs):
    """x[..., None], x[:, None], x[...]: views that only insert dimensions (anything else is a leaf)."""
    x, index = args
    if not isinstance(x, Node):
        raise NotAlgebraic("getitem")
    items = index if isinstance(index, tuple) else (index,)
    if any(not (i is None or i is Ellipsis or i == slice(None)) for i in items):
        raise NotAlgebraic("indexing")
    expr = sub(x)
    if sum(i is Ellipsis for i in items) > 1:
        raise NotAlgebraic("indexing")
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (len(expr.axes) - consumed) + items[at + 1:]
    else:
        items = items + (slice(None),) * (len(expr.axes) - consumed)
    axes, it = [], iter(expr.axes)
    for i in items:
        axes.append(None if i is None else next(it))
    return Expr(tuple(axes), expr.terms)


def _h_to(sub, args, kwargs):
    """.to(dtype) / .float() / casts: the same value (precision aside)."""
    return sub(args[0])


_FUNCTIONS = {
    operator.mul: _h_mul, torch.mul: _h_mul, aten.mul: _h_mul,
    operator.add: _h_add, torch.add: _h_add, aten.add: _h_add,
    operator.sub: _h_sub, torch.sub: _h_sub, aten.sub: _h_sub,
    operator.truediv: _h_div, torch.div: _h_div, aten.div: _h_div,
    operator.neg: _h_neg, torch.neg: _h_neg, aten.neg: _h_neg,
    torch.sum: _h_sum, aten.sum: _h_sum,
    torch.unsqueeze: _h_unsqueeze, aten.unsqueeze: _h_unsqueeze,
    torch.squeeze: _h_squeeze, aten.squeeze: _h_squeeze,
    torch.permute: _h_permute, aten.permute: _h_permute,
    torch.transpose: _h_transpose, aten.transpose: _h_transpose, torch.t: _h_t, aten.t: _h_t,
    torch.reshape: _h_view, aten.view: _h_view, aten._unsafe_view: _h_view, aten.reshape: _h_view,
    aten.expand: _h_expand,
    torch.einsum: _h_einsum, torch.functional.einsum: _h_einsum,
    torch.matmul: _h_matmul, operator.matmul: _h_matmul, torch.bmm: _h_matmul, torch.mm: _h_matmul,
    aten.bmm: _h_matmul, aten.mm: _h_matmul, aten.matmul: _h_matmul,
    torch.outer: _h_outer, torch.ger: _h_outer,
    torch.addcmul: _h_addcmul, aten.addcmul: _h_addcmul, torch.baddbmm: _h_baddbmm, aten.baddbmm: _h_baddbmm,
    torch.addmm: _h_baddbmm, aten.addmm: _h_baddbmm, torch.addbmm: _h_addbmm, aten.addbmm: _h_addbmm,
    torch.addr: _h_addr, aten.addr: _h_addr,
    operator.getitem: _h_getitem,
    torch.clone: _h_same, aten.clone: _h_same, aten.alias: _h_same, aten._to_copy: _h_to,
    torch.ops.prims.convert_element_type: _h_to,
}

# In-place arithmetic, read as its out-of-place form where the write is to a temporary (`writes_a_temporary`).
_IN_PLACE = {
    operator.iadd: _h_add, operator.isub: _h_sub, operator.imul: _h_mul, operator.itruediv: _h_div,
    "add_": _h_add, "sub_": _h_sub, "mul_": _h_mul, "div_": _h_div,
    "__iadd__": _h_add, "__isub__": _h_sub, "__imul__": _h_mul, "__itruediv__": _h_div, "addcmul_": _h_addcmul,
}

# The in-place methods read as arithmetic on a temporary (`S.mul_(a)`, `S.add_(kv)`): statements a chain may hold.
IN_PLACE_METHODS = frozenset(name for name in _IN_PLACE if isinstance(name, str) and not name.startswith("__"))

_METHODS = {
    "mul": _h_mul, "__mul__": _h_mul, "add": _h_add, "sub": _h_sub, "div": _h_div, "neg": _h_neg,
    "sum": _h_sum, "unsqueeze": _h_unsqueeze, "squeeze": _h_squeeze, "permute": _h_permute,
    "transpose": _h_transpose, "t": _h_t, "view": _h_view, "reshape": _h_view, "expand": _h_expand,
    "expand_as": _h_expand_as, "matmul": _h_matmul, "bmm": _h_matmul, "mm": _h_matmul, "outer": _h_outer,
    "ger": _h_outer,
    "contiguous": _h_same, "clone": _h_same, "float": _h_to, "double": _h_to, "half": _h_to,
    "bfloat16": _h_to, "to": _h_to, "type_as": _h_to,
    "addcmul": _h_addcmul, "baddbmm": _h_baddbmm, "addmm": _h_baddbmm, "addbmm": _h_addbmm, "addr": _h_addr,
}

