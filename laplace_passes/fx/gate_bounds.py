"""Gates that are <= 0 by construction, whose run-time check the re-tiling pass leaves out.

NOTE [gates proven <= 0]
`laplace::check_gates` refuses a positive (or NaN) gate at run time: a
reduction over gk, a copy of it and a host sync, per site and per call. In a
decode step of one sequence that is a fifth of the step. Most models build
their gates so that no value can be positive: fla's GLA layers use
``F.logsigmoid(x) / normalizer`` (then maybe ``clamp_min(gk, c < 0)``),
others ``-F.softplus(x)``. `gate_bound` reads that off the graph, following
gk back through the ops below and the sign each one guarantees; when the
result can never be positive the re-tiling pass gives gk to the op
unchecked, and the report's "gates" column shows the derivation.

    sources     logsigmoid is <= 0; relu, exp, sigmoid, abs and softplus (beta > 0,
                threshold >= 0: its linear branch returns x above the threshold) are >= 0;
                a tensor filled with one finite number has its sign (zeros, full: the
                gates the re-tiling pass gives a site that has none, or a constant decay)
    logs        log(x) is <= 0 where x lies in [0, 1] (the gates a recognised loop's decay
                gets, NOTE [resets in a trained decay]): x a number or fill in [0, 1],
                sigmoid, exp of a value <= 0, 1 - x, a product of such values, a quotient
                by a number >= 1, clamp(min >= 0, max <= 1), a select between such values
    rules       neg flips the sign; times or over a finite positive number keeps it,
                a negative one flips it; a product of two bounded factors has their
                sign product; a sum of terms of one sign has it (log(decay) + log(c),
                c <= 1); clamp / clamp_max with a max <= 0 is <= 0, and
                clamp_min(x <= 0, c <= 0) stays <= 0; torch.where(c, x, y) has the sign
                x and y share (the number 0 has either, -inf, a reset, is <= 0)
    unchanged   views, reshapes, transposes, indexing, contiguous, clone, and casts
                from one floating-point dtype to another
    stops       any value that is not a signed floating-point dtype (a cast to bool
                turns -0.5 into True, to uint8 wraps it, to int8 wraps -1000;
                float8_e8m0fnu has no sign), a view that reinterprets the bits as
                another dtype (the low half of a negative float32 read as float16
                can be positive), and an in-place write anywhere in the graph to
                memory a step of the derivation lives in (``g.view(-1).add_(5)``,
                ``g[..., 0] = 1``, ``copy_``, ``out=``, ``.data``: the op would read
                the written values; `laplace_passes.fx.in_place_writes`)

Before (a decode step of fla's GLA layer) and after the re-tiling pass:

    log_sigmoid = torch._C._nn.log_sigmoid(unflatten_3)
    gk = log_sigmoid / 16.0
    gla = torch.ops.laplace.gla.default(q, k, v, gk, state, 0.25, 'laplace.gla')
    # after: no check_gates node
    gla_recurrence = laplace_passes.ops.gla.gla_recurrence(q, k, v, gk, state, 0.25, 'reduce')

What is given up: every rule holds for every value but NaN, and a proven
gate is not checked for NaN. A NaN gate, from a NaN input (logsigmoid(NaN))
or from the gate's own arithmetic (0 * inf, as logsigmoid(x) * exp(x) gives
for a large x; 0 / 0, as a divisor of 1e-300 that rounds to 0 in float32
gives), reaches the op unrefused, and the chunked and recurrent forms give
NaN from that token on in that channel, exactly where the token recurrence
has NaN (`tests/test_gate_bounds.py`). Gates the rules cannot bound (a graph input,
a sum, anything not listed) keep their check.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx

from laplace_passes.fx.in_place_writes import in_place_writes, storage_of
from laplace_passes.infra.fx_helpers import fake_value
from laplace_passes.infra.op_facts import short_op_name, tensor_method_name

aten = torch.ops.aten
F = torch.nn.functional

NONPOSITIVE, NONNEGATIVE = -1, 1

# The dtypes whose values the sign rules are about: float8_e8m0fnu is floating point but has no sign bit.
SIGNED_FLOATS = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e4m3fnuz,
    torch.float8_e5m2, torch.float8_e5m2fnuz,
})

# How far back through sign-preserving ops the search goes: a gate is a few ops from its source.
MAX_DEPTH = 24


@dataclass(frozen=True)
class Bound:
    """`sign` (NONPOSITIVE, NONNEGATIVE, or None: not bounded) and how it was found, or why not."""

    sign: int | None
    how: str

    @property
    def nonpositive(self) -> bool:
        return self.sign == NONPOSITIVE


def _targets(*functions) -> frozenset:
    return frozenset(functions)


# Dynamo graphs call torch functions (and Tensor methods by name); AOT and make_fx graphs call ATen.
_NONPOSITIVE_SOURCES = _targets(F.logsigmoid, torch._C._nn.log_sigmoid, aten.log_sigmoid.default)
_NONNEGATIVE_SOURCES = _targets(
    torch.relu, F.relu, aten.relu.default, torch.exp, aten.exp.default, torch.sigmoid, F.sigmoid,
    aten.sigmoid.default, torch.abs, aten.abs.default,
)
_NONNEGATIVE_METHODS = frozenset({"relu", "exp", "sigmoid", "abs"})
_FILLS = _targets(torch.full, aten.full.default, torch.full_like, aten.full_like.default)  # value: argument 1
_ZEROS = _targets(torch.zeros, torch.zeros_like, aten.zeros.default, aten.zeros_like.default)
_SOFTPLUS = _targets(F.softplus, torch._C._nn.softplus, aten.softplus.default)
_NEG = _targets(operator.neg, torch.neg, aten.neg.default)
_MUL = _targets(operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar)
_DIV = _targets(operator.truediv, torch.div, aten.div.Tensor, aten.div.Scalar)
_CLAMP = _targets(torch.clamp, torch.clip, aten.clamp.default)
_CLAMP_MAX = _targets(torch.clamp_max, aten.clamp_max.default)
_CLAMP_MIN = _targets(torch.clamp_min, aten.clamp_min.default)
_ADD = _targets(operator.add, torch.add, aten.add.Tensor, aten.add.Scalar)
_LOG = _targets(torch.log, aten.log.default)
_SIGMOID = _targets(torch.sigmoid, F.sigmoid, aten.sigmoid.default)
_EXP = _targets(torch.exp, aten.exp.default)
_SUB = _targets(operator.sub, torch.sub, aten.sub.Tensor)  # 1 - x: sub(1, x)
_RSUB = _targets(torch.rsub, aten.rsub.Scalar)  # 1 - x: rsub(x, 1)
_PADS = _targets(F.pad, torch._C._nn.pad, aten.constant_pad_nd.default)
_SELECTS = _targets(torch.where, aten.where.self)
_SAME_SIGN = _targets(
    torch.reshape, torch.transpose, torch.permute, torch.flatten, torch.unflatten, torch.squeeze,
    torch.unsqueeze, torch.clone, torch.movedim, operator.getitem,
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.expand.default, aten.clone.default, aten._to_copy.default, aten.alias.default,
    aten.slice.Tensor, aten.select.int, torch.select, torch.narrow, aten.narrow.default,
)
_CASTS = _targets(aten._to_copy.default)
_CAST_METHODS = frozenset({"float", "double", "half", "bfloat16", "to", "type", "type_as"})
_SAME_SIGN_METHODS = frozenset({
    "view", "reshape", "unflatten", "flatten", "transpose", "permute", "contiguous", "clone", "unsqueeze",
    "squeeze", "expand", "expand_as", "movedim", "float", "double", "half", "bfloat16", "to", "type",
    "type_as", "__getitem__", "detach", "select", "narrow",
})


def gate_bound(node: torch.fx.Node | object) -> Bound:
    """Whether `node` (the gates of a site) is <= 0, or >= 0, for every non-NaN value; and how."""
    derivation: list[torch.fx.Node] = []
    bound = _bound(node, MAX_DEPTH, derivation)
    if bound.sign is None or not isinstance(node, torch.fx.Node):
        return bound
    overwritten = _overwritten(derivation, node.graph)
    return bound if overwritten is None else Bound(None, overwritten)


def _overwritten(derivation: list[torch.fx.Node], graph: torch.fx.Graph) -> str | None:
    """Why the bound no longer holds when the graph writes in place to memory a step of it lives in."""
    steps = {storage_of(step): step for step in derivation}
    for node, written, storage in in_place_writes(graph.nodes):
        if storage is not None and storage not in steps:
            continue
        op = short_op_name(node)
        writer = f"{op}{'' if node.name == op else f' ({node.name})'} writes in place to {written.name}"
        why = ("whose memory the pass cannot tell" if storage is None
               else f"which shares memory with {steps[storage].name}")
        return f"{writer}, {why}"
    return None


def _bound(node, depth: int, derivation: list) -> Bound:
    if not isinstance(node, torch.fx.Node):
        return _number_bound(node)
    stopped = _bound_prefix(node, depth, derivation)  # every rule below is about signed real numbers
    if stopped is not None:
        return stopped
    target, method = _as_called(node)
    name = short_op_name(node)
    if target in _NONPOSITIVE_SOURCES or (target == aten.log_sigmoid_forward.default):
        return Bound(NONPOSITIVE, "logsigmoid")
    if target in _NONNEGATIVE_SOURCES or (method and target in _NONNEGATIVE_METHODS):
        return Bound(NONNEGATIVE, name)
    if target in _FILLS or target in _ZEROS or (method and target in ("new_zeros", "new_full")):
        return _filled(node, target)
    if target in _SOFTPLUS:
        beta, threshold = _argument(node, 1, "beta", 1.0), _argument(node, 2, "threshold", 20.0)
        if _finite_number(beta) and beta > 0 and _finite_number(threshold) and threshold >= 0:
            return Bound(NONNEGATIVE, "softplus")
        return Bound(None, f"{node.name}: softplus with beta {beta!r} and threshold {threshold!r}")
    if target in _SAME_SIGN or (method and target in _SAME_SIGN_METHODS):
        return _same_sign(node, depth, derivation)
    if target in _NEG or (method and target == "neg"):
        inner = _bound(_argument(node, 0, "input", None), depth - 1, derivation)
        return Bound(-inner.sign, f"-({inner.how})") if inner.sign else inner
    if target in _MUL or (method and target == "mul"):
        return _product(node, depth, derivation)
    if target in _DIV or (method and target == "div"):
        return _quotient(node, depth, derivation)
    if target in _CLAMP or target in _CLAMP_MAX or target in _CLAMP_MIN or (
            method and target in ("clamp", "clip", "clamp_max", "clamp_min")):
        return _clamp(node, depth, derivation)
    if target in _LOG or (method and target == "log"):
        return _log_of_decay(node, depth, derivation)
    if target in _ADD or (method and target == "add"):
        return _sum(node, depth, derivation)
    if target in _PADS:
        return _padded(node, depth, derivation)
    if target in _SELECTS and len(node.args) == 3:
        return _selected(node, depth, derivation)
    if node.name != name and not re.fullmatch(rf"{re.escape(name)}_\d+", node.name):
        return Bound(None, f"{node.name} comes from {name}, whose sign the pass does not bound")
    named = name if node.name == name else f"{name} ({node.name})"  # not "cumsum comes from cumsum"
    return Bound(None, f"{named}, whose sign the pass does not bound")


def _as_called(node: torch.fx.Node) -> tuple[object, bool]:
    """`node`'s target, and whether it is a Tensor method: ``torch.Tensor.expand(x, ...)``, as passes that insert
    ops write a method call (the re-tiling pass's own layout of a per-head gate), is read as ``x.expand(...)``."""
    method = tensor_method_name(node.target) if node.op == "call_function" else ""
    return (method, True) if method else (node.target, node.op == "call_method")


def _filled(node: torch.fx.Node, target) -> Bound:
    """A tensor filled with one number (the zero gates the re-tiling pass gives a site without gates): its sign,
    0 counting as <= 0."""
    value = _fill_value(node, target)
    if _finite_number(value):
        return Bound(NONPOSITIVE if value <= 0 else NONNEGATIVE, f"filled with {value!r}")
    return Bound(None, f"{node.name}: filled with {getattr(value, 'name', value)!r}, not a finite number")


def _fill_value(node: torch.fx.Node, target):
    if target in _ZEROS or target == "new_zeros":
        return 0.0
    return _argument(node, 2 if target == "new_full" else 1, "fill_value", None)  # full(size, v), new_full(size, v)


def _padded(node: torch.fx.Node, depth: int, derivation: list) -> Bound:
    """F.pad with a constant of the input's sign (0 has both): the sign of its input (a shifted gate)."""
    if node.target is aten.constant_pad_nd.default:
        mode, value = "constant", _argument(node, 2, "value", 0.0)
    else:
        mode, value = _argument(node, 2, "mode", "constant"), _argument(node, 3, "value", None)
    value = 0.0 if value is None else value
    inner = _bound(_argument(node, 0, "input", None), depth - 1, derivation)
    if mode == "constant" and inner.sign and _finite_number(value) and value * inner.sign >= 0:
        return Bound(inner.sign, f"pad({inner.how}, {value!r})")
    return Bound(None, f"{node.name}: pad with mode {mode!r} and value {value!r} of {inner.how}")


def _selected(node: torch.fx.Node, depth: int, derivation: list) -> Bound:
    """torch.where(c, x, y): the sign its two branches share, a branch that is the number 0 taking the other's
    (the gate 0 of a step a select skips, NOTE [steps a select skips])."""
    branches = [b for b in node.args[1:] if not (_finite_number(b) and b == 0)]
    bounds = [Bound(NONPOSITIVE, "-inf") if _is_minus_inf(b) else _bound(b, depth - 1, derivation) for b in branches]
    return _shared_sign(bounds, lambda hows: f"where(c, {', '.join(hows)}{', 0' if len(hows) == 1 else ''})",
                        f"{node.name}: a select between values of opposite signs")


def _shared_sign(bounds: list[Bound], how, opposite: str) -> Bound:
    """The sign every bound shares (how its derivations combine: `how` of their texts); else the first that is
    unbounded, or `opposite` when they are bounded with opposite signs."""
    signs = {b.sign for b in bounds}
    if bounds and len(signs) == 1 and None not in signs:
        return Bound(signs.pop(), how([b.how for b in bounds]))
    unbounded = [b for b in bounds if not b.sign]
    return unbounded[0] if unbounded else Bound(None, opposite)


def _sum(node: torch.fx.Node, depth: int, derivation: list) -> Bound:
    """x + y (times a finite positive alpha): the sign its terms share, a term that is the number 0 taking the
    other's (a recognised loop's gates log(decay) + log(coefficient) when the coefficient multiplies the state)."""
    alpha = node.kwargs.get("alpha", 1)
    if not (_finite_number(alpha) and alpha > 0):
        return Bound(None, f"{node.name}: a sum with alpha {alpha!r}")
    terms = [t for t in (_argument(node, 0, "input", None), _argument(node, 1, "other", None))
             if not (_finite_number(t) and t == 0)]
    bounds = [_bound(t, depth - 1, derivation) for t in terms]
    return _shared_sign(bounds, lambda hows: " + ".join(f"({h})" for h in hows),
                        f"{node.name}: a sum of terms of opposite signs")


def _log_of_decay(node: torch.fx.Node, depth: int, derivation: list) -> Bound:
    """log(x) for x in [0, 1]: <= 0 (-inf at 0)."""
    within, how = _in_unit_interval(_argument(node, 0, "input", None), depth - 1, derivation)
    if within:
        return Bound(NONPOSITIVE, f"log({how})")
    return Bound(None, f"log of a value not shown to lie in [0, 1] ({how})")


def _in_unit_interval(node, depth: int, derivation: list) -> tuple[bool, str]:
    """Whether `node` lies in [0, 1] for every non-NaN value (a decay), and how; or why not."""
    if not isinstance(node, torch.fx.Node):
        return (True, repr(node)) if _finite_number(node) and 0 <= node <= 1 else (False, f"the constant {node!r}")
    bound = _bound_prefix(node, depth, derivation)
    if bound is not None:
        return False, bound.how
    target, method = _as_called(node)
    arguments = [_argument(node, 0, "input", None), _argument(node, 1, "other", None)]
    if target in _SIGMOID or (method and target == "sigmoid"):
        return True, "sigmoid"
    if target in _EXP or (method and target == "exp"):
        exponent = _bound(arguments[0], depth - 1, derivation)
        return (True, f"exp({exponent.how})") if exponent.nonpositive else (False, f"exp of {exponent.how}")
    if target in _FILLS or target in _ZEROS or (method and target in ("new_zeros", "new_full")):
        value = _fill_value(node, target)
        return _finite_number(value) and 0 <= value <= 1, f"filled with {getattr(value, 'name', value)!r}"
    if target in _SAME_SIGN or (method and target in _SAME_SIGN_METHODS):
        source, why_not = _view_source(node)
        return (False, why_not) if source is None else _in_unit_interval(source, depth - 1, derivation)
    if target in _MUL or (method and target == "mul"):
        return _all_in_unit_interval(arguments, "*", depth, derivation)
    if target in _SELECTS and len(node.args) == 3:
        return _all_in_unit_interval(list(node.args[1:]), ", ", depth, derivation, "where(c, {})")
    if target in _DIV and _finite_number(arguments[1]) and arguments[1] >= 1 and not node.kwargs.get("rounding_mode"):
        within, how = _in_unit_interval(arguments[0], depth - 1, derivation)
        return within, f"{how} / {arguments[1]!r}"
    if (target in _SUB or target in _RSUB) and _is_one_minus(node, target):
        within, how = _in_unit_interval(node.args[0 if target in _RSUB else 1], depth - 1, derivation)
        return within, f"1 - {how}"
    if target in _CLAMP or (method and target in ("clamp", "clip")):
        low, high = _argument(node, 1, "min", None), _argument(node, 2, "max", None)
        if _finite_number(low) and low >= 0 and _finite_number(high) and high <= 1:
            return True, f"clamp(min={low!r}, max={high!r})"
    return False, f"{short_op_name(node)} ({node.name}), not bounded to [0, 1] by the pass"


def _bound_prefix(node: torch.fx.Node, depth: int, derivation: list) -> Bound | None:
    """What stops every bound of `node` before its op is read (an input, the depth, a dtype), else None."""
    if node.op == "placeholder":
        return Bound(None, f"{node.name} is an input of the graph")
    if node.op not in ("call_function", "call_method"):
        return Bound(None, f"{node.name} comes from {node.op} {node.target}")
    if depth <= 0:
        return Bound(None, f"{node.name}: more than {MAX_DEPTH} ops from a source the pass can bound")
    derivation.append(node)
    dtype = getattr(fake_value(node), "dtype", None)
    if dtype not in SIGNED_FLOATS:
        return Bound(None, f"{node.name} is {dtype or 'not a tensor with a known dtype'}, not a signed floating-point "
                           "dtype")
    return None


def _all_in_unit_interval(values: list, joiner: str, depth: int, derivation: list,
                          template: str = "{}") -> tuple[bool, str]:
    """A product of (or a select between) values in [0, 1] lies in [0, 1]."""
    found = [_in_unit_interval(v, depth - 1, derivation) for v in values]
    missing = [how for within, how in found if not within]
    if missing:
        return False, missing[0]
    return True, template.format(joiner.join(f"({how})" if joiner == "*" else how for _, how in found))


def _is_one_minus(node: torch.fx.Node, target) -> bool:
    """1 - x: sub(1, x) or rsub(x, 1), with no alpha."""
    if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return False
    one = node.args[1] if target in _RSUB else node.args[0]
    return _finite_number(one) and one == 1


def _is_minus_inf(value) -> bool:
    return isinstance(value, float) and value == -math.inf


def _view_source(node: torch.fx.Node):
    """The input of a view, copy or cast, and None; or None and why its values are not the input's (a view that
    reads the input's bits as another dtype)."""
    dtype = getattr(fake_value(node), "dtype", None)
    source = _argument(node, 0, "input", None)
    source_dtype = getattr(fake_value(source), "dtype", None) if isinstance(source, torch.fx.Node) else None
    target, method = _as_called(node)
    cast = target in _CASTS or (method and target in _CAST_METHODS)
    if source_dtype != dtype and not cast:
        return None, f"{node.name} reads {source_dtype} as {dtype}"
    return source, ""


def _same_sign(node: torch.fx.Node, depth: int, derivation: list) -> Bound:
    """A view, copy or cast: the sign of its input, unless it reads the input's bits as another dtype."""
    source = _argument(node, 0, "input", None)
    if node.target is operator.getitem and _is_tuple_of_log_sigmoid(source):
        # aten.log_sigmoid_forward returns (output, buffer): only the output is a logsigmoid.
        return Bound(NONPOSITIVE, "logsigmoid") if node.args[1] == 0 else Bound(None, "log_sigmoid_forward's buffer")
    source, why_not = _view_source(node)
    return Bound(None, why_not) if source is None else _bound(source, depth - 1, derivation)


def _product(node: torch.fx.Node, depth: int, derivation: list) -> Bound:
    factors = (_argument(node, 0, "input", None), _argument(node, 1, "other", None))
    left, right = (_bound(factor, depth - 1, derivation) for factor in factors)
    if left.sign and right.sign:
        return Bound(left.sign * right.sign, f"({left.how}) * ({right.how})")
    return left if not left.sign else right


def _quotient(node: torch.fx.Node, depth: int, derivation: list) -> Bound:
    if node.kwargs.get("rounding_mode") is not None:  # floor / trunc division of a gate: not a scaling
        return Bound(None, f"{node.name}: division with rounding_mode {node.kwargs['rounding_mode']!r}")
    divisor = _argument(node, 1, "other", None)
    if isinstance(divisor, torch.fx.Node) or not (_finite_number(divisor) and divisor != 0):
        return Bound(None, f"{node.name}: division by {getattr(divisor, 'name', divisor)!r}, not a finite "
                           "non-zero number")
    dividend = _bound(_argument(node, 0, "input", None), depth - 1, derivation)
    if not dividend.sign:
        return dividend
    return Bound(dividend.sign * (1 if divisor > 0 else -1), f"{dividend.how} / {divisor!r}")


def _clamp(node: torch.fx.Node, depth: int, derivation: list) -> Bound:
    method = short_op_name(node)
    if "clamp_max" in method:
        low, high = None, _argument(node, 1, "max", None)
    elif "clamp_min" in method:
        low, high = _argument(node, 1, "min", None), None
    else:
        low, high = _argument(node, 1, "min", None), _argument(node, 2, "max", None)
    if _finite_number(high) and high <= 0:
        return Bound(NONPOSITIVE, f"clamp(max={high!r})")
    inner = _bound(_argument(node, 0, "input", None), depth - 1, derivation)
    if high is None and inner.nonpositive and (low is None or (_finite_number(low) and low <= 0)):
        return Bound(NONPOSITIVE, f"clamp({inner.how}, min={low!r})")
    return Bound(None, f"{node.name}: clamp(min={getattr(low, 'name', low)!r}, max={getattr(high, 'name', high)!r}) "
                       f"of {inner.how}")


def _argument(node: torch.fx.Node, index: int, name: str, default):
    """Argument `index` of `node`, or its keyword `name` (`torch.mul(a, other=0.5)`), or `default`."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_tuple_of_log_sigmoid(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.target == aten.log_sigmoid_forward.default


def _finite_number(value) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range: a scale the pass will not reason about
        return False


def _number_bound(value) -> Bound:
    if _finite_number(value) and value != 0:
        return Bound(NONPOSITIVE if value < 0 else NONNEGATIVE, repr(value))
    return Bound(None, f"the constant {value!r}")
