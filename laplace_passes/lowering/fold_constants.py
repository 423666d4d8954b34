"""`FoldIndexConstants`: index arithmetic that depends on no input, computed once at compile time.

Masks built by constructors and index arithmetic (chunked GLA's diagonals
of its leaf blocks, `eye` and `pad`; `arange` comparisons, `tril`) depend
on no input. The shapes are static, so these are constants; lowered as they
are, torch-mlir turns them into i64 `iota`, floor divisions and compares,
and neuronx-cc receives i64 index arithmetic the model never asked for (Trainium1 downcasts every i64 to i32; Trainium2 computes i64 only with
`--native-int64`, AWS Neuron SDK data-types.rst). Computed here, each is one
constant (`dense<...> : tensor<8x128xi1>`), and i64 is left only where the
model's inputs are i64 (token ids).
"""

from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_map

from laplace_passes.infra.pass_base import GraphPass, PassResult

aten = torch.ops.aten
PLAIN_CONSTRUCTORS = (aten.full.default, aten.scalar_tensor.default, aten.zeros.default, aten.ones.default)
# Larger constants stay computed in the graph: each folded element is written out in the StableHLO text.
MAX_FOLDED_ELEMENTS = 1 << 16


class FoldIndexConstants(GraphPass):
    """Replace each input-independent subgraph (index masks, eye, arange) by one constant.

    NOTE [fold_index_constants: before and after]
    Before (chunked GLA's mask of the first diagonal below the main one in
    its 16-row leaf blocks):

        eye_1 = torch.ops.aten.eye.default(15, dtype = torch.float32, device = device(type='cpu'), ...)
        constant_pad_nd_1 = torch.ops.aten.constant_pad_nd.default(eye_1, [0, 1, 1, 0], 0.0)
        mul_11 = torch.ops.aten.mul.Tensor(constant_pad_nd_16, constant_pad_nd_1)

    After:

        _folded_constant_pad_nd_1 = self._folded_constant_pad_nd_1   # float [16, 16], a buffer of the module
        mul_11 = torch.ops.aten.mul.Tensor(constant_pad_nd_16, _folded_constant_pad_nd_1)

    A constant filled with one value (`full`, `scalar_tensor`) is left as
    it is (it lowers to one splat constant); `eye`, `arange`, `tril` masks
    and whatever is computed from constants are folded, each result at most
    MAX_FOLDED_ELEMENTS elements; random and in-place ops are never folded.
    Declined, with the reason, when the constants live on the meta device.
    """

    name = "fold_index_constants"

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        values = _evaluate_constant_nodes(gm.graph)
        meta = [n.name for n, v in values.items() if v.device.type == "meta"]
        if meta:
            return PassResult(gm, modified=False, summary="nothing folded",
                               declined=[f"{meta[0]}: constants on the meta device have no values to fold"])
        frontier = [n for n, v in values.items() if not _plain_constant(n) and v.numel() <= MAX_FOLDED_ELEMENTS
                    and any(user not in values for user in n.users)]
        for node in frontier:
            _replace_by_buffer(gm, node, values[node])
        removed = _erase_unused(gm.graph, values)
        if frontier:
            gm.recompile()
        summary = (f"{len(frontier)} input-independent subgraph(s) ({removed} nodes) folded into constants"
                   if frontier else "nothing input-independent to fold")
        return PassResult(gm, modified=bool(frontier), summary=summary)


def _plain_constant(node: torch.fx.Node) -> bool:
    """A constant filled with one value (`full`, `scalar_tensor`): already one splat constant when lowered."""
    return not node.all_input_nodes and node.target in PLAIN_CONSTRUCTORS


def _evaluate_constant_nodes(graph: torch.fx.Graph) -> dict:
    """The value of every call_function node that depends on no placeholder."""
    values: dict[torch.fx.Node, torch.Tensor] = {}
    with unset_fake_temporarily():
        for node in graph.nodes:
            if not _foldable_op(node) or any(i not in values for i in node.all_input_nodes):
                continue
            args, kwargs = tree_map(lambda a: values[a] if isinstance(a, torch.fx.Node) else a, (node.args, node.kwargs))
            value = node.target(*args, **kwargs)
            if not isinstance(value, torch.Tensor):
                continue
            values[node] = value
    return values


def _foldable_op(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    schema = node.target._schema
    random = torch.Tag.nondeterministic_seeded in node.target.tags
    mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return not random and not mutates and not node.target.name().startswith(("aten::empty", "_c10d"))


def _replace_by_buffer(gm: torch.fx.GraphModule, node: torch.fx.Node, value: torch.Tensor) -> None:
    """Register `value` as a buffer and read it with one get_attr node per use of `node`.

    One per use because torch-mlir 20261001's FX importer imports a get_attr
    at each use and asserts on the second (fx_importer.py `_import_argument`
    checks `(arg.target, 0)` but binds `(arg, 0)`); its CSE merges the copies.
    """
    name = f"_folded_{node.name}"
    gm.register_buffer(name, value)  # a fresh tensor: computed by the pass, shared with nothing

    def read(arg):
        if arg is not node:
            return arg
        with gm.graph.inserting_before(user):
            constant = gm.graph.get_attr(name)
        constant.meta = dict(node.meta)
        return constant

    for user in list(node.users):
        user.args = torch.fx.node.map_arg(user.args, read)
        user.kwargs = torch.fx.node.map_arg(user.kwargs, read)


def _erase_unused(graph: torch.fx.Graph, folded: dict) -> int:
    """Erase the evaluated nodes nothing uses any more (last first); how many."""
    removed = 0
    for node in reversed(list(folded)):
        if not node.users:
            graph.erase_node(node)
            removed += 1
    return removed
