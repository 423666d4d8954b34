"""ATen passes that make a graph lowerable by torch-mlir; run only for the lowering inner compilers.

The stablehlo, iree and neuron inner compilers hand each ATen graph to
torch-mlir. Two things in our graphs stop it, and each gets one small pass:

* `laplace::check_gates` is a Python custom op (it raises ValueError on a
  positive gate). torch-mlir cannot lower a Python op, and a device graph
  cannot raise. `ClampGateChecks` replaces it by `clamp(gk, max=0)`: the
  documented clamp of docs/DESIGN.md section 3.3. For valid gates (gk <= 0) the clamp is
  the identity and the numbers are bit for bit those of the eager graph; a
  positive gate is clamped to 0 (no decay) instead of refused, and a NaN
  gate stays NaN. So lowered graphs (StableHLO, IREE, Neuron) do not check
  gates: check them eagerly, or with inner="eager", before deploying.
* torch-mlir 20261001 lowers `aten.slice_scatter` whose end is "to the end"
  (INT64_MAX, which is what the backward of `G[..., -1:, :]` produces) by
  allocating for that end: std::bad_alloc, or the process is killed for
  memory. `BoundSliceScatter` writes the static bounds instead.
* torch-mlir 20261001 cannot lower `aten.diagonal` to StableHLO at all (the
  explicit GLA backward takes diagonal blocks with it).
  `DiagonalAsStridedSlice` rewrites it as a strided slice of the flattened
  matrix.
* `laplace::add_scaled` (torch.add with a tensor alpha, in ShardedMuon's
  step) is a Python op too. `ExpandScaledAdds` writes it as
  `input + other * alpha`.
"""

from __future__ import annotations

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import fake_tensor, new_node, provenance_of
from laplace_passes.infra.pass_base import Declined, GraphPass, PassResult
from laplace_passes.ops.scaled_add import ADD_SCALED

aten = torch.ops.aten
CHECK_GATES = torch.ops.laplace.check_gates.default
SLICE_SCATTER = aten.slice_scatter.default
DIAGONAL = aten.diagonal.default


class ClampGateChecks(GraphPass):
    """Replace every `laplace::check_gates(gk)` by `aten.clamp(gk, None, 0.0)`.

    NOTE [clamp_gate_checks: before and after]
    Before (forward graph of one GLA layer, re-tiled):

        div_2 = torch.ops.aten.div.Tensor(log_sigmoid, 16.0)
        check_gates = torch.ops.laplace.check_gates.default(div_2)
        constant_pad_nd_3 = torch.ops.aten.constant_pad_nd.default(check_gates, [0, 0, 0, 0, 0, 0])

    After:

        div_2 = torch.ops.aten.div.Tensor(log_sigmoid, 16.0)
        clamp_gates = torch.ops.aten.clamp.default(div_2, None, 0.0)
        constant_pad_nd_3 = torch.ops.aten.constant_pad_nd.default(clamp_gates, [0, 0, 0, 0, 0, 0])

    The backward graph is unchanged: AOT Autograd derived it from the check's
    identity gradient before this pass runs.
    """

    name = "clamp_gate_checks"

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        checks = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is CHECK_GATES]
        for check in checks:
            _replace_by_clamp(gm.graph, check)
        summary = (
            f"{len(checks)} gate check(s) replaced by clamp(max=0): torch-mlir cannot lower the Python "
            "check, so lowered graphs clamp positive gates instead of refusing them"
            if checks else "no gate check in this graph"
        )
        return PassResult(gm, modified=bool(checks), summary=summary)


def _replace_by_clamp(graph: torch.fx.Graph, check: torch.fx.Node) -> None:
    gates = check.args[0]  # the second, the site's origin, only words its error
    with graph.inserting_before(check):
        # fx makes the name unique (clamp_gates_1, ...) when several layers have one. The check's
        # fake value is empty_like(gk): the clamp's shape, dtype and strides.
        clamp = new_node(graph, aten.clamp.default, (gates, None, 0.0), name="clamp_gates",
                         provenance=provenance_of(check), like=check)
    check.replace_all_uses_with(clamp)
    graph.erase_node(check)


class BoundSliceScatter(GraphPass):
    """Give every `aten.slice_scatter` static, non-negative start and end.

    NOTE [bound_slice_scatter: before and after]
    Before (backward of `G_last = G[..., -1:, :]` with 128-row chunks):

        slice_scatter_1 = torch.ops.aten.slice_scatter.default(full_like_9, add_26, 3, -1, 9223372036854775807)

    After:

        slice_scatter_1 = torch.ops.aten.slice_scatter.default(full_like_9, add_26, 3, 127, 128)

    Same meaning (Python slice bounds resolved against the static size);
    declined, with the reason, when the sliced dimension is not static.
    """

    name = "bound_slice_scatter"

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        rewritten, declined = 0, []
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is not SLICE_SCATTER:
                continue
            try:
                args = _static_args(node)
            except Declined as why:
                declined.append(f"{node.name}: {why.reason}")
                continue
            if args != _slice_scatter_args(node):
                node.args, node.kwargs = args, {}
                rewritten += 1
        summary = f"{rewritten} slice_scatter bound(s) made static" if rewritten else "no unbounded slice_scatter"
        return PassResult(gm, modified=rewritten > 0, summary=summary, declined=declined)


def _static_args(node: torch.fx.Node) -> tuple:
    """`node`'s arguments with start and end resolved against the static size (Declined: why not)."""
    args = _slice_scatter_args(node)
    base_node, src, dim, start, end, step = args
    base = fake_tensor(base_node)
    if base is None:
        raise Declined("the base tensor has no fake value (meta['val']), so its size is unknown")
    dim = dim % base.dim()
    size = base.shape[dim]
    if not isinstance(size, int):
        raise Declined(f"dimension {dim} has symbolic size {size}; torch-mlir needs static bounds")
    if not all(isinstance(b, (int, type(None))) for b in (start, end)):
        raise Declined(f"bounds ({start}, {end}) are not static integers")
    start, end, _ = slice(start, end).indices(size)
    return (base_node, src, dim, start, end, step)


def _slice_scatter_args(node: torch.fx.Node) -> tuple:
    """(self, src, dim, start, end, step) with the schema's defaults filled in."""
    defaults = {"dim": 0, "start": None, "end": None, "step": 1}
    values = list(node.args[:2])
    for index, name in enumerate(defaults, start=2):
        values.append(node.args[index] if len(node.args) > index else node.kwargs.get(name, defaults[name]))
    return tuple(values)


class DiagonalAsStridedSlice(GraphPass):
    """Rewrite `aten.diagonal` as permute, contiguous copy, flatten and a strided slice.

    torch-mlir 20261001 has no StableHLO lowering for `aten.diagonal` ("failed
    to legalize operation 'torch.constant.int'"); the explicit GLA backward
    takes the diagonal blocks of its [.., C, C] score gradients with it. The
    diagonal of an [n, m] matrix with offset o is every (m+1)-th element of
    the flattened matrix, starting at o (o >= 0) or -o*m (o < 0).

    NOTE [diagonal_as_strided_slice: before and after]
    Before (blocks [1, 2, 2, 8, 16, 8, 16], diagonal over dims -4 and -2):

        diagonal = torch.ops.aten.diagonal.default(view_40, 0, -4, -2)           # [1, 2, 2, 16, 16, 8]

    After:

        diagonal_in_last_dims = torch.ops.aten.permute.default(view_40, [0, 1, 2, 4, 6, 3, 5])
        diagonal_contiguous = torch.ops.aten.clone.default(diagonal_in_last_dims, memory_format=torch.contiguous_format)
        diagonal_flat = torch.ops.aten.view.default(diagonal_contiguous, [1, 2, 2, 16, 16, 64])
        diagonal = torch.ops.aten.slice.Tensor(diagonal_flat, -1, 0, 64, 9)       # [1, 2, 2, 16, 16, 8]

    Declined, with the reason, when the two dimensions are not static.
    """

    name = "diagonal_as_strided_slice"

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        rewritten, declined = 0, []
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not DIAGONAL:
                continue
            try:
                _check_static_diagonal(node)
            except Declined as why:
                declined.append(f"{node.name}: {why.reason}")
                continue
            _replace_diagonal(gm.graph, node)
            rewritten += 1
        summary = f"{rewritten} diagonal(s) rewritten as strided slices" if rewritten else "no diagonal"
        return PassResult(gm, modified=rewritten > 0, summary=summary, declined=declined)


def _diagonal_args(node: torch.fx.Node) -> tuple:
    """(self, offset, dim1, dim2) with the schema's defaults, dims made non-negative."""
    defaults = {"offset": 0, "dim1": 0, "dim2": 1}
    values = [node.args[0]]
    for index, name in enumerate(defaults, start=1):
        values.append(node.args[index] if len(node.args) > index else node.kwargs.get(name, defaults[name]))
    x, offset, dim1, dim2 = values
    rank = fake_tensor(x).dim()
    return x, offset, dim1 % rank, dim2 % rank


def _check_static_diagonal(node: torch.fx.Node) -> None:
    value = fake_tensor(node.args[0])
    if value is None:
        raise Declined("the input has no fake value (meta['val']), so its shape is unknown")
    _, _, dim1, dim2 = _diagonal_args(node)
    if not all(isinstance(value.shape[d], int) for d in (dim1, dim2)):
        raise Declined(f"dimensions {dim1} and {dim2} are not static")


def _replace_diagonal(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    x, offset, dim1, dim2 = _diagonal_args(node)
    value = fake_tensor(x)
    n, m = value.shape[dim1], value.shape[dim2]
    others = [d for d in range(value.dim()) if d not in (dim1, dim2)]
    length = max(0, min(n, m - offset) if offset >= 0 else min(n + offset, m))
    start = offset if offset >= 0 else -offset * m
    end = start + (length - 1) * (m + 1) + 1 if length else start
    steps = [
        ("diagonal_in_last_dims", aten.permute.default, ([*others, dim1, dim2],), {}),
        ("diagonal_contiguous", aten.clone.default, (), {"memory_format": torch.contiguous_format}),
        ("diagonal_flat", aten.view.default, ([*(value.shape[d] for d in others), n * m],), {}),
        ("diagonal", aten.slice.Tensor, (-1, start, end, m + 1), {}),
    ]
    current = x
    with graph.inserting_before(node):
        for name, op, args, kwargs in steps:
            current = new_node(graph, op, (current, *args), kwargs, name=name)
    node.replace_all_uses_with(current)
    graph.erase_node(node)


class ExpandScaledAdds(GraphPass):
    """Replace every `laplace::add_scaled(input, other, alpha)` by ATen's `input + other * alpha`.

    NOTE [expand_scaled_adds: before and after]
    Before (ShardedMuon's step, learning rates as inputs):

        mul = torch.ops.aten.mul.Tensor(arg2_1, select_2)
        add_scaled = torch.ops.laplace.add_scaled.default(mul, squeeze, select_3)

    After (`other` cast to the result's dtype first, as torch.add computes):

        add_scaled_other = torch.ops.aten._to_copy.default(squeeze, dtype=torch.float32)
        add_scaled_product = torch.ops.aten.mul.Tensor(add_scaled_other, select_3)
        add_scaled = torch.ops.aten.add.Tensor(mul, add_scaled_product)

    The sum and the product round separately, where the eager op rounds once;
    the lowered program's rounding is its device's.
    """

    name = "expand_scaled_adds"

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        adds = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ADD_SCALED]
        for node in adds:
            _expand_scaled_add(gm.graph, node)
        summary = f"{len(adds)} add_scaled op(s) written as input + other * alpha" if adds else "no add_scaled"
        return PassResult(gm, modified=bool(adds), summary=summary)


def _expand_scaled_add(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    input_, other, alpha = node.args
    dtype = fake_tensor(node).dtype
    provenance = provenance_of(node)
    with graph.inserting_before(node):
        if fake_tensor(other).dtype != dtype:
            other = new_node(graph, aten._to_copy.default, (other,), {"dtype": dtype}, name="add_scaled_other",
                             provenance=provenance)
        product = new_node(graph, aten.mul.Tensor, (other, alpha), name="add_scaled_product", provenance=provenance)
        total = new_node(graph, aten.add.Tensor, (input_, product), name="add_scaled", provenance=provenance)
    node.replace_all_uses_with(total)
    graph.erase_node(node)
