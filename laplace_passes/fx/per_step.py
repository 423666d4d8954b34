"""What an unrolled loop reads at each step, as one tensor over the steps.

An unrolled token loop (a Python loop Dynamo traced, a scan or while_loop
the unroll pass inlined) reads its inputs step by step: `k[:, t]`,
`exp(g[:, :, t])`, `xs.unbind(0)[t]`, `aten.select(xs, 0, t)`. `pattern`
reads a node as the same computation at every step with the step's position
abstracted (`Pattern.key`) and the positions it indexes (`Pattern.steps`),
so that the nodes of the T steps can be checked to be one computation at
positions 0 .. T-1. `Lifter.lift` then builds that computation once over
all steps, with the step dimension first: `movedim(k, 1, 0)` for `k[:, t]`,
`exp(movedim(g, 2, 0))` for `exp(g[:, :, t])`, one `F.linear` over all
steps for a projection of each step's input, `x.reshape(T, ..)` for a
step's `x.view(..)`. What it cannot lift (an op it does not know to act on
each step alone) is stacked from the steps' own nodes, which is always
right and costs a node per step.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from laplace_passes.infra.fx_helpers import ancestors, fake_tensor, new_node
from laplace_passes.infra.op_facts import base_op_name

Node = torch.fx.Node
aten = torch.ops.aten

STEP = "<t>"  # the step's position, abstracted, in a pattern's key

_SELECTS = frozenset({torch.select, aten.select.int})
_UNBINDS = frozenset({torch.unbind, aten.unbind.int})
_INDEX_SELECTS = frozenset({torch.index_select, aten.index_select.default})
# Ops that act element by element (with broadcasting), so that op(x[t]) == op(x)[t].
ELEMENTWISE = frozenset({
    torch.exp, torch.sigmoid, F.logsigmoid, torch._C._nn.log_sigmoid, torch.tanh, F.silu, F.softplus,
    torch._C._nn.softplus, torch.log, torch.abs, torch.neg, torch.relu, F.relu, torch.sqrt, torch.rsqrt,
    torch.reciprocal, torch.clamp, torch.clamp_min, torch.clamp_max, torch.log1p, torch.expm1,
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, torch.mul, torch.add, torch.sub,
    torch.div, aten.exp.default, aten.sigmoid.default, aten.log_sigmoid.default, aten.neg.default,
    aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.log.default, aten.tanh.default,
    aten.rsub.Scalar, operator.pow, torch.pow, aten.pow.Tensor_Scalar,
})
ELEMENTWISE_METHODS = frozenset({
    "exp", "sigmoid", "tanh", "log", "neg", "abs", "relu", "sqrt", "rsqrt", "reciprocal", "clamp", "clamp_min",
    "clamp_max", "mul", "add", "sub", "div", "float", "double", "half", "bfloat16", "to", "type_as", "pow",
    "log1p", "expm1", "__rsub__", "contiguous", "clone",
})


@dataclass(frozen=True)
class Pattern:
    key: Any  # hashable: the computation with the step's position as STEP
    steps: tuple[int, ...]  # the positions indexed, in the order found

    @property
    def varies(self) -> bool:
        return bool(self.steps)


def pattern(node: Node, memo: dict) -> Pattern:
    if node in memo:
        return memo[node]
    # The ancestors first, in graph order: a while_loop's counter is a chain as long as the loop, which a
    # recursion down the arguments would follow to Python's recursion limit.
    todo, stack = set(), [node]
    while stack:  # the ancestors not read yet
        current = stack.pop()
        if current not in memo and current not in todo:
            todo.add(current)
            stack.extend(current.all_input_nodes)
    for earlier in sorted(todo, key=_graph_order(node.graph, memo).__getitem__):
        memo[earlier] = step_index(earlier, memo) or _op_pattern(earlier, memo)
    return memo[node]


def _graph_order(graph: torch.fx.Graph, memo: dict) -> dict[Node, int]:
    """Each node's place in `graph`, computed once per memo."""
    order = memo.setdefault("order", {})
    if graph not in order:
        order[graph] = {n: i for i, n in enumerate(graph.nodes)}
    return order[graph]


def shared_by_steps(per_step: list[list[Node]], memo: dict) -> bool:
    """Read the nodes that two steps both read as step-invariant; whether any pattern changed.

    NOTE [values every step reads]: `step_index` reads x.unbind(d)[i], select(x, d, i) and x[.., i, ..] of a
    step-invariant x as a step's own input at position i. That is right for a scan's `xs.unbind(0)[t]` and
    wrong for q, k and v split out of one projection (`qkv.view(B, T, 3, H, K).unbind(2)`), which every step
    then indexes at its own position (`q[:, t]`): q would read "position 0" at every step, its steps' q[:, t]
    then keyed by their literal t, and no two steps alike. A node that the values of two steps both read is
    one value for both, so it reads no position: it is made step-invariant here, and every pattern computed
    from it is dropped, to be read again.
    """
    first, second = (ancestors(nodes) for nodes in per_step[:2])
    shared = {n for n in first & second if pattern(n, memo).varies}
    if not shared:
        return False
    for node in shared:
        memo[node] = Pattern(("node", node), ())
    _read_again_after(shared, memo)
    return True


_INDEX_KINDS = frozenset({"unbind", "index", "slice", "index_select", "select"})  # a step index's `Pattern.key[0]`


def step_index(node: Node, memo: dict) -> Pattern | None:
    """x[..., t, ...], select(x, d, t), x.unbind(d)[t] of a step-invariant x: the step's own input.

    A pattern already in `memo` is the answer: matching steps may have chosen one (NOTE [values every step
    reads], NOTE [an index of several numbers]), and it holds for every reader of the memo alike.
    """
    known = memo.get(node)
    if isinstance(known, Pattern):
        return known if known.key[0] in _INDEX_KINDS else None
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    target, args = node.target, node.args
    if target is operator.getitem and isinstance(args[0], Node):
        source = args[0]
        if _is_unbind(source) and isinstance(args[1], int):
            base, dim = source.args[0], _arg(source, 1, "dim", 0)
            return _indexed(("unbind", base, _norm_dim(base, dim)), base, dim, args[1], memo)
        return _getitem_index(node, memo)
    if target in _INDEX_SELECTS and isinstance(args[0], Node) and isinstance(_arg(node, 2, "index", None), Node):
        return _index_select(node, memo)
    if _is_narrow(node) and isinstance(args[0], Node):
        return _narrow_of_one(node, memo)
    if target in _SELECTS or (node.op == "call_method" and target == "select"):
        base, dim, index = args[0], _arg(node, 1, "dim", None), _arg(node, 2, "index", None)
        if isinstance(base, Node) and isinstance(dim, int) and isinstance(index, int):
            return _indexed(("select", base, _norm_dim(base, dim)), base, dim, index, memo)
    return None


def _index_select(node: Node, memo: dict) -> Pattern | None:
    """index_select(x, d, i) with i one position known at compile time (a while_loop's counter, unrolled)."""
    base, dim, index = node.args[0], _arg(node, 1, "dim", None), _arg(node, 2, "index", None)
    value = constant_value(index)
    if not isinstance(dim, int) or value is None or value.numel() != 1 or value.dtype.is_floating_point:
        return None
    found = _indexed(("index_select", base, _norm_dim(base, dim)), base, dim, int(value.reshape(())), memo)
    return found


def _is_narrow(node: Node) -> bool:
    return node.op == "call_function" and node.target in (torch.narrow, aten.narrow.default) or (
        node.op == "call_method" and node.target == "narrow")


def _narrow_of_one(node: Node, memo: dict) -> Pattern | None:
    """x.narrow(d, t, 1): position t, its dimension kept (of size 1), as index_select's is."""
    base, dim, start, length = (node.args[0], _arg(node, 1, "dim", None), _arg(node, 2, "start", None),
                                _arg(node, 3, "length", None))
    if not (isinstance(dim, int) and isinstance(start, int) and length == 1):
        return None
    return _indexed(("index_select", base, _norm_dim(base, dim)), base, dim, start, memo)


def _is_unbind(node: Node) -> bool:
    return node.op == "call_function" and node.target in _UNBINDS or (
        node.op == "call_method" and node.target == "unbind")


def _arg(node: Node, position: int, name: str, default):
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def _norm_dim(node: Node, dim: int) -> int:
    value = fake_tensor(node)
    return dim % value.dim() if value is not None and value.dim() else dim


def _indexed(key: tuple, base: Node, dim: int, index: int, memo: dict) -> Pattern | None:
    if pattern(base, memo).varies:
        return None
    value = fake_tensor(base)
    if value is None or not isinstance(value.shape[dim], int):
        return None
    return Pattern(key, (index % value.shape[dim],))


def _getitem_index(node: Node, memo: dict, slot: int | None = None) -> Pattern | None:
    """x[.., i, ..] as position i; with several numbers, the one at `slot` (NOTE [an index of several
    numbers]; the others then stay as they are, the same at every step)."""
    base, index = node.args
    items = index if isinstance(index, tuple) else (index,)
    ints, units = _int_items(items), _unit_slices(items)
    kind = "index"
    if slot is None:
        if len(ints) + len(units) != 1:
            return None
        slot = (ints or units)[0]
        kind = "index" if ints else "slice"  # x[:, t:t + 1]: position t, its dimension kept
    if any(not (item is None or item is Ellipsis or item == slice(None))
           for i, item in enumerate(items) if i not in ints and i != slot):
        return None
    dim = source_dim(items, slot, fake_tensor(base).dim() if fake_tensor(base) is not None else 0)
    if dim is None:
        return None
    rest = tuple(STEP if i == slot else _const_key(item) for i, item in enumerate(items))
    position = items[slot] if kind == "index" else items[slot].start
    return _indexed((kind, base, rest), base, dim, position, memo)


def _unit_slices(items: tuple) -> list[int]:
    """The items that slice one position, `t:t + 1` (a number start, its stop one past it)."""
    return [i for i, item in enumerate(items) if isinstance(item, slice) and isinstance(item.start, int)
            and isinstance(item.stop, int) and item.stop == item.start + 1 and item.start >= 0
            and item.step in (None, 1)]


def _int_items(items: tuple) -> list[int]:
    return [i for i, item in enumerate(items) if isinstance(item, int) and not isinstance(item, bool)]


def positions_in_several_numbers(per_step: list[list[Node]], memo: dict) -> bool:
    """Read each index of several numbers at the one number that changes between two steps; whether any
    pattern changed.

    NOTE [an index of several numbers]: `q[:, t, h]` in a loop over the heads and, inside it, the tokens
    holds the step's position and a constant head; which is which no one index says. Two steps do: the
    number that differs between step 0's index and step 1's (of the same tensor, the same other items) is
    the position. Every index of that tensor and form in the graph is then read at that slot, and every
    pattern computed from them is read again.
    """
    first, second = (_several_numbers(nodes, memo) for nodes in per_step[:2])
    if len(first) != len(second):
        return False
    slots = {}
    for a, b in zip(first, second):
        form = _form(a)
        if form != _form(b):
            return False
        differ = [i for i in _int_items(_items(a)) if _items(a)[i] != _items(b)[i]]
        if len(differ) != 1:
            return False
        slots[form] = differ[0]
    changed = set()
    for node in (first[0].graph.nodes if first else ()):
        if node.op == "call_function" and node.target is operator.getitem and _form(node) in slots:
            found = _getitem_index(node, memo, slots[_form(node)])
            if found is not None:
                memo[node] = found
                changed.add(node)
    _read_again_after(changed, memo)
    return bool(changed)


def _several_numbers(nodes: list[Node], memo: dict) -> list[Node]:
    """The step-invariant tensors' indices of two or more numbers that `nodes` read, in graph order."""
    found = [n for n in ancestors(nodes) if n.op == "call_function" and n.target is operator.getitem
             and isinstance(n.args[0], Node) and len(_int_items(_items(n))) >= 2
             and not pattern(n.args[0], memo).varies]
    return sorted(found, key=_graph_order(found[0].graph, memo).__getitem__) if found else []


def _items(node: Node) -> tuple:
    index = node.args[1]
    return index if isinstance(index, tuple) else (index,)


def _form(node: Node) -> tuple:
    """An index's tensor and items, its numbers left out: what two steps' indices of one tensor share."""
    return (node.args[0], tuple("int" if i in _int_items(_items(node)) else _const_key(item)
                                for i, item in enumerate(_items(node))))


def _read_again_after(changed: set[Node], memo: dict) -> None:
    """Drop the patterns computed from `changed` nodes (their new patterns kept), to be read again."""
    if not changed:
        return
    stale = set(changed)
    for node in next(iter(changed)).graph.nodes:
        if node not in changed and any(i in stale for i in node.all_input_nodes):
            stale.add(node)
            memo.pop(node, None)


def _dims_before(items: tuple, position: int, ndim: int) -> int:
    """The dimensions of a getitem's value before the one the item at `position` makes (a number makes none;
    None, a slice, one each; an Ellipsis those of the indexed tensor it stands for)."""
    consumed = sum(not (item is None or item is Ellipsis) for item in items)
    made = {type(None): 1, slice: 1, type(Ellipsis): ndim - consumed}
    return sum(made.get(type(item), 0) for item in items[:position])


def source_dim(items: tuple, position: int, ndim: int) -> int | None:
    """The dimension of the indexed tensor that the item at `position` of a getitem index selects."""
    consumes = [not (item is None or item is Ellipsis) for item in items]
    if Ellipsis in items:
        at = items.index(Ellipsis)
        if position > at:
            return ndim - sum(consumes[position:])
    return sum(consumes[:position])


def _const_key(value) -> Any:
    if isinstance(value, slice):
        return ("slice", value.start, value.stop, value.step)
    if value is Ellipsis:
        return "..."
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _op_pattern(node: Node, memo: dict) -> Pattern:
    if node.op not in ("call_function", "call_method"):
        return Pattern(("node", node), ())
    steps: list[int] = []

    def key_of(arg):
        if isinstance(arg, Node):
            found = pattern(arg, memo)
            steps.extend(found.steps)
            return found.key
        if isinstance(arg, (list, tuple)):
            return tuple(key_of(a) for a in arg)
        if isinstance(arg, dict):
            return tuple(sorted((k, key_of(v)) for k, v in arg.items()))
        return _const_key(arg)

    key = (node.op, node.target, key_of(node.args), key_of(dict(node.kwargs)))
    found = Pattern(key, tuple(steps))
    if not found.varies or len(set(steps)) > 1:  # reads no position, or many (a stack of every step's value)
        return Pattern(("node", node), ())  # step-invariant: the node itself, whatever computed it
    return found


class Lifter:
    """Builds in `graph` each per-step value over T steps (step dimension first).

    `env` maps the loop's nodes to `graph`'s (the identity when `graph` is the loop's own).
    """

    def __init__(self, graph: torch.fx.Graph, memo: dict, T: int, offset: int, env=None) -> None:
        self.graph, self.memo, self.T, self.offset = graph, memo, T, offset
        self.env = env or (lambda n: n)
        self.cache: dict = {}
        self.stacked = 0  # values that had to be stacked from the steps' own nodes

    def lift(self, nodes: list[Node]) -> tuple[Node, bool]:
        """(a node whose [t] is nodes[t], True) or (the one node, False) when it is the same at every step."""
        first = nodes[0]
        if not pattern(first, self.memo).varies:
            return self.env(first), False
        key = pattern(first, self.memo).key
        if key in self.cache:
            return self.cache[key], True
        lifted = self._lift(first) if self._liftable(first) else None
        if lifted is None:
            lifted = self._call(torch.stack, ([self.env(n) for n in nodes], 0))
            self.stacked += 1
        self.cache[key] = lifted
        return lifted, True

    def _call(self, target, args: tuple, kwargs: dict | None = None) -> Node:
        return new_node(self.graph, target, args, kwargs)

    def _liftable(self, node: Node) -> bool:
        if step_index(node, self.memo) is not None:
            return True
        if node.op == "call_function" and node.target in _ON_THE_LAST_DIM:  # a projection of the step's input
            x, rest = node.args[0], [a for a in node.all_input_nodes if a is not node.args[0]]
            return isinstance(x, Node) and not any(pattern(a, self.memo).varies for a in rest) and self._liftable(x)
        if _reshape_sizes(node) is not None:
            return self._liftable(node.args[0])
        target = node.target
        known = target in ELEMENTWISE if node.op == "call_function" else (
            node.op == "call_method" and target in ELEMENTWISE_METHODS)
        if not known:
            return _is_insertion(node) and self._liftable(node.args[0])
        return all(self._liftable(a) for a in node.all_input_nodes if pattern(a, self.memo).varies) and \
            self._invariants_broadcast(node)

    def _invariants_broadcast(self, node: Node) -> bool:
        """Step-invariant tensor operands must not reach the step dimension when broadcast."""
        out = fake_tensor(node)
        for arg in node.all_input_nodes:
            value = fake_tensor(arg)
            if value is not None and not pattern(arg, self.memo).varies and out is not None \
                    and value.dim() > out.dim():
                return False
        return True

    def _lift(self, node: Node) -> Node:
        index = step_index(node, self.memo)
        if index is not None:
            return self._lift_index(node, index)
        sizes = _reshape_sizes(node)
        if sizes is not None:  # the step's dimension first, then the step's own shape
            return self._call(torch.reshape, (self._lift(node.args[0]), (self.T, *sizes)))
        if _is_insertion(node):
            return self._lift_insertion(node)
        args = tuple(self._lifted_arg(a) for a in node.args)
        kwargs = {k: self._lifted_arg(v) for k, v in node.kwargs.items()}
        target = node.target if node.op == "call_function" else getattr(torch.Tensor, node.target)
        return self._call(target, args, kwargs)

    def _lifted_arg(self, arg):
        if isinstance(arg, Node):
            return self._lift(arg) if pattern(arg, self.memo).varies else self.env(arg)
        if isinstance(arg, (list, tuple)):
            return type(arg)(self._lifted_arg(a) for a in arg)
        return arg

    def _lift_index(self, node: Node, index: Pattern) -> Node:
        kind, base = index.key[0], index.key[1]
        # `kept`: where the step's own dimension stays, of size 1, in a step's value (None: it does not)
        if kind in ("index", "slice"):
            items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            position = index.key[2].index(STEP)
            dim = source_dim(items, position, fake_tensor(base).dim())
            rest = items[:position] + items[position + 1:]
            kept = _dims_before(items, position, fake_tensor(base).dim()) if kind == "slice" else None
        else:
            dim, rest = index.key[2], ()
            kept = dim if kind == "index_select" else None
        whole = self._call(torch.movedim, (self.env(base), dim, 0))
        if fake_tensor(base).shape[dim] != self.T or self.offset:
            whole = self._call(torch.narrow, (whole, 0, self.offset, self.T))
        if any(item is not None and item != slice(None) for item in rest) or None in rest:
            whole = self._call(operator.getitem, (whole, (slice(None), *rest)))
        if kept is not None:
            whole = self._call(torch.unsqueeze, (whole, kept + 1))
        return whole

    def _lift_insertion(self, node: Node) -> Node:
        source = self._lift(node.args[0])
        if node.target is operator.getitem:
            items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            return self._call(operator.getitem, (source, (slice(None), *items)))
        dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
        op = torch.squeeze if base_op_name(node) == "squeeze" else torch.unsqueeze
        return self._call(op, (source, dim + 1 if dim >= 0 else dim))


# Ops on the last dimension alone, each row by itself: op(x[t]) == op(x)[t] for a step dimension in front.
_ON_THE_LAST_DIM = frozenset({torch._C._nn.linear, F.linear, aten.linear.default})


def _reshape_sizes(node: Node) -> tuple[int, ...] | None:
    """The sizes of `x.view(..)`, `x.reshape(..)` or `torch.reshape(x, ..)`, when they are numbers; else None."""
    if not ((node.op == "call_method" and node.target in ("view", "reshape"))
            or (node.op == "call_function" and node.target is torch.reshape)):
        return None
    sizes = node.args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    ok = sizes and all(isinstance(n, int) and not isinstance(n, bool) for n in sizes) and \
        isinstance(node.args[0], Node)
    return tuple(sizes) if ok else None


def _is_insertion(node: Node) -> bool:
    """x[..., None], x.unsqueeze(d), x.squeeze(d): a size-1 dimension inserted or dropped, nothing else."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], Node):
        items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return all(item is None or item is Ellipsis or item == slice(None) for item in items)
    if base_op_name(node) in ("unsqueeze", "squeeze") and node.op in ("call_method", "call_function"):
        return isinstance(node.args[0], Node) and isinstance(node.args[1] if len(node.args) > 1 else None, int)
    return False


# Fills whose value depends on their input's shape and dtype only: zeros_like(x), x.new_zeros(...).
_FILLS = {"new_zeros": 0.0, "new_ones": 1.0, "zeros_like": 0.0, "ones_like": 1.0}


_SHAPE_FILLS = frozenset({*_FILLS, "new_full", "full_like", "new_empty", "empty_like"})


def is_fill(node: Node) -> bool:
    """A value made from no tensor's values: `torch.zeros(..)` (no tensor input), `x.new_zeros(..)`, `zeros_like(x)`."""
    return node.op in ("call_function", "call_method") and (not node.all_input_nodes or base_op_name(node) in _SHAPE_FILLS)


def constant_value(node: Node):
    """The value of a node computed from no graph input's values (a zero state, a range, a counter), or None."""
    fill = _fill_number(node) if node.op in ("call_function", "call_method") else None
    value = fake_tensor(node)
    if fill is not None and value is not None and all(isinstance(d, int) for d in value.shape):
        return torch.full(tuple(value.shape), fill, dtype=value.dtype)
    if any(a.op in ("placeholder", "get_attr") for a in ancestors([node])):
        return None
    try:
        return _evaluate(node, {})
    except Exception:  # noqa: BLE001 (anything that does not evaluate is not a constant here)
        return None


def _fill_number(node: Node) -> float | None:
    """The number a fill op fills with (`zeros_like`, `new_ones`, `full_like(x, 0.5)`, `x.new_full(size, v)`)."""
    name = base_op_name(node)
    if name in _FILLS:
        return _FILLS[name]
    if name in ("full_like", "new_full"):
        position = 1 if name == "full_like" else 2
        value = node.args[position] if len(node.args) > position else node.kwargs.get("fill_value")
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return None


def _evaluate(node: Node, memo: dict):
    """`node`'s value, its ancestors evaluated first in graph order (no recursion: a counter chain is long)."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    for step in sorted(ancestors([node]), key=order.__getitem__):
        args, kwargs = torch.fx.node.map_arg((step.args, step.kwargs), memo.__getitem__)
        if step.op == "call_function":
            memo[step] = step.target(*args, **kwargs)
        elif step.op == "call_method":
            memo[step] = getattr(args[0], step.target)(*args[1:], **kwargs)
        else:
            raise ValueError(step.op)
    return memo[node]
