"""Where a loop puts its per-step outputs: one value that holds them all, replaced whole.

A token loop's readouts o_0 .. o_{T-1} usually end up in one tensor: stacked
(`torch.stack(outs, d)`, `torch.cat([o.unsqueeze(d) ...], d)`, a scan's own
stack), written into a preallocated buffer (`out[:, t] = o`, the
`setitem` nodes Dynamo records), or copied into one at the step's position
(`out = out.index_copy(d, t, o.unsqueeze(d))`, as a while_loop body does).
`find_aggregate` finds that value so the recognition pass can replace it by
GLA's output over all steps at once, instead of T selections written back
one by one: the graph then holds a constant number of nodes whatever T.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from laplace_passes.fx.per_step import constant_value
from laplace_passes.infra.fx_helpers import fake_tensor
from laplace_passes.infra.op_facts import base_op_name

Node = torch.fx.Node
aten = torch.ops.aten

_STACKS = frozenset({torch.stack, aten.stack.default})
_CATS = frozenset({torch.cat, aten.cat.default})
_UNSQUEEZES = frozenset({torch.unsqueeze, aten.unsqueeze.default})
_INDEX_COPIES = frozenset({torch.index_copy, aten.index_copy.default})


@dataclass
class Aggregate:
    """`node`'s value is the readouts stacked along `dim`; `replaced` are the nodes that built it."""

    node: Node
    dim: int
    replaced: list[Node] = field(default_factory=list)  # erased once `node`'s readers read the replacement
    readers: list[Node] | None = None  # None: every user of `node`


def find_aggregate(readouts: list[Node]) -> Aggregate | None:
    if not readouts:
        return None
    rank = fake_tensor(readouts[0]).dim()
    for finder in (_stacked, _concatenated, _set_items, _index_copies):
        found = finder(readouts, rank)
        if found is not None:
            return found
    return None


def _dim(node: Node, position: int, default: int, rank: int) -> int | None:
    value = node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)
    return value % (rank + 1) if isinstance(value, int) else None


def _sole_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _stacked(readouts: list[Node], rank: int) -> Aggregate | None:
    user = _sole_user(readouts[0])
    if user is None or user.target not in _STACKS or list(user.args[0]) != readouts:
        return None
    dim = _dim(user, 1, 0, rank)
    return None if dim is None else Aggregate(user, dim)


def _pieces(readouts: list[Node], consumer) -> list[Node] | None:
    """What a cat or index_copy reads of each readout: the readout, or its one unsqueeze."""
    pieces = []
    for readout in readouts:
        user = _sole_user(readout)
        if user is not None and base_op_name(user) == "unsqueeze" and not consumer(user):
            readout, user = user, _sole_user(user)
        if user is None or not consumer(user):
            return None
        pieces.append(readout)
    return pieces


def _concatenated(readouts: list[Node], rank: int) -> Aggregate | None:
    """torch.cat of the readouts, each with a size-1 dimension at the cat's (unsqueezed, or kept by the loop)."""
    pieces = _pieces(readouts, lambda n: n.target in _CATS)
    if pieces is None:
        return None
    cat = _sole_user(pieces[0])
    if list(cat.args[0]) != pieces:
        return None
    dim = _dim(cat, 1, 0, fake_tensor(pieces[0]).dim() - 1)
    if dim is None or any(fake_tensor(p).shape[dim] != 1 for p in pieces):
        return None
    return Aggregate(cat, dim, replaced=[p for p in pieces if p not in readouts])


def _set_items(readouts: list[Node], rank: int) -> Aggregate | None:
    """buffer[..., t, ...] = o_t for t = 0 .. T-1 in order, on a fresh buffer read only after the last."""
    writes = [_sole_user(r) for r in readouts]
    if any(w is None or w.target is not operator.setitem or w.args[2] is not r for w, r in zip(writes, readouts)):
        return None
    buffer = writes[0].args[0]
    dims = [_written_dim(w, t, rank) for t, w in enumerate(writes)]
    if any(w.args[0] is not buffer for w in writes) or len(set(dims)) != 1 or dims[0] is None:
        return None
    if not _fresh(buffer, len(readouts), dims[0]):
        return None
    order = {n: i for i, n in enumerate(buffer.graph.nodes)}
    readers = [u for u in buffer.users if u not in writes]
    if any(order[u] < order[writes[-1]] for u in readers):
        return None
    return Aggregate(buffer, dims[0], replaced=writes, readers=readers)


def _written_dim(write: Node, step: int, rank: int) -> int | None:
    items = write.args[1] if isinstance(write.args[1], tuple) else (write.args[1],)
    if Ellipsis in items or None in items:
        return None
    ints = [i for i, item in enumerate(items) if isinstance(item, int) and not isinstance(item, bool)]
    if len(ints) != 1 or items[ints[0]] != step or any(item != slice(None) for i, item in enumerate(items)
                                                        if i != ints[0]):
        return None
    return ints[0]


def _fresh(buffer: Node, steps: int, dim: int) -> bool:
    """A buffer made for the loop (zeros, empty), exactly `steps` long along `dim`."""
    value = fake_tensor(buffer)
    made = buffer.op in ("call_function", "call_method") and base_op_name(buffer) in (
        "zeros", "empty", "new_zeros", "new_empty", "zeros_like", "empty_like")
    return made and value is not None and value.shape[dim] == steps


def _index_copies(readouts: list[Node], rank: int) -> Aggregate | None:
    """out_{t+1} = out_t.index_copy(d, [t], o_t.unsqueeze(d)) from a fresh buffer, t = 0 .. T-1."""
    pieces = _pieces(readouts, lambda n: base_op_name(n) == "index_copy")
    if pieces is None:
        return None
    copies = [_sole_user(p) for p in pieces]
    dims = {_dim(c, 1, 0, fake_tensor(pieces[0]).dim() - 1) for c in copies}
    for t, (copy, piece) in enumerate(zip(copies, pieces)):
        index = constant_value(copy.args[2])
        if index is None or index.numel() != 1 or int(index.reshape(())) != t or copy.args[3] is not piece \
                or (t and copy.args[0] is not copies[t - 1]):
            return None
    dim = dims.pop() if len(dims) == 1 else None
    if dim is None or not _fresh(copies[0].args[0], len(readouts), dim):
        return None
    return Aggregate(copies[-1], dim, replaced=[*copies[:-1], *(p for p in pieces if p not in readouts)])
