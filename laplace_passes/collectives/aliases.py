"""Logical aliases: which nodes of an ATen graph hold the same value, whatever the spelling.

The Muon pass recognises Newton-Schulz and its layouts by value, not by node
identity: functionalisation leaves many nodes holding one value. An in-place
`div_` on a transposed view of a gathered buffer (torch.optim.Muon's own
function does this) becomes

    div_1     = div(permute(wait, [1, 0]), clamp)
    permute_6 = permute(permute(div_1, [1, 0]), [1, 0])     # div_1 again
    permute_9 = permute(permute(permute(div_1, ...)))       # div_1.T

and an in-place op on a slice is written back with `slice_scatter`, after
which every read of that slice goes through the scattered buffer.

`Aliases.of(node)` describes a node's value as a strided view of a *root*
value: `Alias(root, shape, stride, offset)`, strides and offset over the
root's logical row-major index. View ops are replayed on meta tensors (exact,
no memory); casts and copies are seen through (the analysis is for
recognition: the rewrite copies the user's own nodes, so rounding is
preserved); a reshape that is no strided view (`view` of a transposed value,
which functional graphs write for `reshape`) starts a new root, remembered so
that reshaping it back gives the old alias; a read of a `slice_scatter` is
the written source when it reads exactly the written slice, a read of the
base when it reads none of it. Two nodes hold the same value when their
`key()`s are equal; `transposed()` swaps the last two dimensions.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from laplace_passes.infra.fx_helpers import fake_tensor
from laplace_passes.infra.op_facts import RESHAPES, SPLITS, is_value_copy

aten = torch.ops.aten
prims = torch.ops.prims
Node = torch.fx.Node

def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Alias:
    root: Node
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def transposed(self) -> Alias:
        if len(self.shape) < 2:
            return self
        s, t = list(self.shape), list(self.stride)
        s[-1], s[-2], t[-1], t[-2] = s[-2], s[-1], t[-2], t[-1]
        return Alias(self.root, tuple(s), tuple(t), self.offset)

    def key(self) -> tuple:
        """Equal keys: the same value (strides of size-1 dimensions do not matter)."""
        stride = tuple(0 if n == 1 else st for n, st in zip(self.shape, self.stride))
        return self.root, self.shape, stride, self.offset

    def in_root_order(self) -> bool:
        """Every element of the root once, in the root's row-major order (any shape)."""
        root = fake_tensor(self.root)
        numel = 1
        for n in self.shape:
            numel *= n
        return (root is not None and numel == root.numel() and self.offset == 0
                and self.stride == contiguous_strides(self.shape))

    def is_transpose_view(self) -> bool:
        """Reads its root column-major in the last two dimensions (x.T / x.mT of a row-major value)."""
        return len(self.shape) >= 2 and self.shape[-1] > 1 and self.stride[-1] != 1 and self.stride[-2] == 1

    def flat_indices(self) -> torch.Tensor:
        """The root's logical flat index of every element, in this alias's shape (int64)."""
        out = torch.full((), self.offset, dtype=torch.long)
        for dim, (n, st) in enumerate(zip(self.shape, self.stride)):
            view = [1] * len(self.shape)
            view[dim] = n
            out = out + (torch.arange(n, dtype=torch.long) * st).view(view)
        return out.expand(self.shape)


class Aliases:
    """The alias of every node it is asked about, memoised (one instance per graph and analysis)."""

    def __init__(self) -> None:
        self._memo: dict[Node, Alias] = {}
        self._reshaped: dict[Node, Alias] = {}  # roots made by a reshape -> the alias they reshaped

    def of(self, node: Node) -> Alias:
        found = self._memo.get(node)
        if found is None:
            # The backend runs passes inside AOT Autograd's fake mode; index arithmetic here is real.
            with unset_fake_temporarily():
                found = self._compute(node)
            self._memo[node] = found
        return found

    def is_transpose_of(self, a: Node, b: Node) -> bool:
        # An alias has its node's shape: when the shapes already differ, no view need be replayed
        # (most matmuls of a model, asked about by the Newton-Schulz search, end here).
        shape_a, shape_b = _static_shape(a), _static_shape(b)
        if shape_a is not None and shape_b is not None and len(shape_b) >= 2 \
                and shape_a != shape_b[:-2] + (shape_b[-1], shape_b[-2]):
            return False
        return self.of(a).key() == self.of(b).transposed().key()

    def within_source(self, node: Node) -> Alias | None:
        """`node`'s alias relative to its direct input taken as a contiguous value (None: not a view).

        For one view op (`select`, `slice`, `getitem` of a split, ...), whatever
        the input's own layout: which of the input's elements, in its logical
        row-major order, the view reads.
        """
        is_split_item = node.target is operator.getitem and isinstance(node.args[0], Node) \
            and node.args[0].target in SPLITS
        op_node = node.args[0] if is_split_item else node
        source = op_node.args[0] if op_node.args else None
        value = fake_tensor(source) if isinstance(source, Node) else None
        if value is None or not (is_split_item or getattr(node.target, "is_view", False)):
            return None
        shape = tuple(int(d) for d in value.shape)
        alias = Alias(source, shape, contiguous_strides(shape), 0)
        with unset_fake_temporarily():
            return self._replay_on(alias, op_node, (lambda out: out[node.args[1]]) if is_split_item else (lambda out: out))

    # -- computing -----------------------------------------------------------------------

    def _fresh(self, node: Node) -> Alias:
        value = fake_tensor(node)
        shape = tuple(int(d) for d in value.shape) if value is not None else ()
        return Alias(node, shape, contiguous_strides(shape), 0)

    def _compute(self, node: Node) -> Alias:
        if node.op != "call_function" or fake_tensor(node) is None:
            return self._fresh(node)
        source = node.args[0] if node.args else None
        if is_value_copy(node) and isinstance(source, Node):
            return self.of(source)
        if node.target is aten.copy.default and _same_shape(node.args[0], node.args[1]):
            return self.of(node.args[1])  # dst.copy_(src) of the whole of dst: src's value
        if node.target is operator.getitem and isinstance(source, Node) and source.target in SPLITS:
            return self._replay(source, lambda out: out[node.args[1]]) or self._fresh(node)
        is_view = getattr(node.target, "is_view", False) or node.target is aten._unsafe_view.default
        if not (is_view and isinstance(source, Node) and fake_tensor(source) is not None):
            return self._fresh(node)
        back = self._reshaped_back(node)
        if back is not None:
            return back
        replayed = self._replay(node, lambda out: out)
        if replayed is not None:
            return self._through_scatter(replayed) or replayed
        return self._reshape(node)

    def _replay(self, node: Node, pick) -> Alias | None:
        """Run the view op on a fake strided view of the source's root: the result's alias."""
        return self._replay_on(self.of(node.args[0]), node, pick)

    def _replay_on(self, src: Alias, node: Node, pick) -> Alias | None:
        target = aten.view.default if node.target is aten._unsafe_view.default else node.target
        root = fake_tensor(src.root)
        if root is None:
            return None
        try:
            # On the meta device: strides and offsets exact, no memory, and no fake-tensor dispatch.
            storage = torch.empty(max(root.numel(), 1), device="meta")
            base = torch.as_strided(storage, src.shape, src.stride, src.offset)
            out = pick(target(base, *node.args[1:], **node.kwargs))
        except (RuntimeError, TypeError, ValueError, IndexError):  # not a strided view of the root
            return None
        if not isinstance(out, torch.Tensor):
            return None
        return Alias(src.root, tuple(out.shape), tuple(out.stride()), int(out.storage_offset()))

    def _reshaped_back(self, node: Node) -> Alias | None:
        if node.target not in RESHAPES:
            return None
        src = self.of(node.args[0])
        before = self._reshaped.get(src.root)
        if before is None or not src.in_root_order():
            return None
        return before if tuple(fake_tensor(node).shape) == before.shape else None

    def _reshape(self, node: Node) -> Alias:
        """A reshape that no strided view expresses: a new root, remembered for the way back."""
        fresh = self._fresh(node)
        if node.target in RESHAPES:
            self._reshaped[node] = self.of(node.args[0])
        return fresh

    def _through_scatter(self, alias: Alias) -> Alias | None:
        """A read of slice_scatter(base, src, dim, start, end): src's value or the base's, when decidable."""
        while alias.root.op == "call_function" and alias.root.target is aten.slice_scatter.default:
            scatter = alias.root
            base, src = scatter.args[:2]
            dim, start, end = (list(scatter.args[2:]) + [0, None, None])[:3]
            value = fake_tensor(scatter)
            whole = torch.arange(value.numel()).view(tuple(value.shape))
            written = aten.slice.Tensor(whole, dim, start, end).reshape(-1)
            read = alias.flat_indices().reshape(-1)
            if read.numel() == written.numel() and torch.equal(read, written):
                inner = self.of(src)
                return inner if inner.shape == alias.shape else None
            if torch.isin(read, written).any():
                return None  # reads part of the written slice: not one value
            base_alias = self.of(base)
            if not base_alias.in_root_order():
                return None
            alias = Alias(base_alias.root, alias.shape, alias.stride, alias.offset)
        return alias


def _static_shape(node: Node) -> tuple[int, ...] | None:
    """The node's shape when it is known and every size is a plain int (None otherwise: no guess)."""
    value = fake_tensor(node)
    if value is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return tuple(value.shape)


def _same_shape(a, b) -> bool:
    va, vb = fake_tensor(a), fake_tensor(b)
    return va is not None and vb is not None and tuple(va.shape) == tuple(vb.shape)
