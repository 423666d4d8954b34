"""The graph-size model's tile formula applied to StableHLO: what the budget estimate is calibrated against.

`laplace_passes.unroll.SizeModel` estimates instructions on the ATen graph
the passes see. neuronx-cc compiles the StableHLO torch-mlir makes of it,
after decompositions, so the same formula is applied here to that StableHLO,
op by op, and the two are compared (`benchmarks/bench_lowering.py`):

    stablehlo.dot_general       batch * ceil(K / P) * ceil(M / P) * ceil(N / F)
                                (batching and contracting dims read from the op)
    layout ops                  0: reshape, transpose, broadcast_in_dim, slice,
                                constant, iota, get_tuple_element, return
    every other op              ceil(max(numel of its operands and results) / (P * F)), at least 1
                                (ops in reduce regions are scalar: 1 each)

Counted from the module's text, one op per line, so it needs no MLIR bindings.
"""

from __future__ import annotations

import math
import re

from laplace_passes.unroll.size import SizeModel

_OP = re.compile(r'^\s*(?:%[\w#:, %]+=\s*)?"?(stablehlo\.[a-z_]+|func\.return)"?')
_TENSOR = re.compile(r"tensor<([0-9x]*?)x?(?:[a-z]+[0-9]*)>")
_DIMS = re.compile(r"(batching|contracting)_dims = \[([0-9, ]*)\] x \[([0-9, ]*)\]")

LAYOUT_OPS = frozenset({
    "stablehlo.reshape", "stablehlo.transpose", "stablehlo.broadcast_in_dim", "stablehlo.slice",
    "stablehlo.constant", "stablehlo.iota", "stablehlo.get_tuple_element", "stablehlo.return", "func.return",
})


def stablehlo_instructions(text: str, model: SizeModel | None = None) -> int:
    """The tile estimate of a StableHLO module's text (see the module docstring)."""
    model = model or SizeModel()
    return sum(_line_instructions(line, model) for line in text.splitlines())


def _line_instructions(line: str, model: SizeModel) -> int:
    match = _OP.match(line)
    if match is None:
        return 0
    op = match.group(1)
    if op in LAYOUT_OPS:
        return 0
    shapes = [_shape(dims) for dims in _TENSOR.findall(line)]
    if op == "stablehlo.dot_general" and len(shapes) >= 3:
        return _dot_general(line, shapes[0], shapes[1], model)
    return model.elementwise_instructions(max((math.prod(s) for s in shapes), default=1))


def _shape(dims: str) -> tuple[int, ...]:
    return tuple(int(d) for d in dims.split("x") if d)


def _dot_general(line: str, lhs: tuple[int, ...], rhs: tuple[int, ...], model: SizeModel) -> int:
    dims = {kind: ([int(d) for d in a.split(",") if d.strip()], [int(d) for d in b.split(",") if d.strip()])
            for kind, a, b in _DIMS.findall(line)}
    lhs_batch, rhs_batch = dims.get("batching", ([], []))
    lhs_contract, rhs_contract = dims.get("contracting", ([], []))
    batch = math.prod(lhs[d] for d in lhs_batch)
    k = math.prod(lhs[d] for d in lhs_contract)
    m = math.prod(s for d, s in enumerate(lhs) if d not in lhs_batch and d not in lhs_contract)
    n = math.prod(s for d, s in enumerate(rhs) if d not in rhs_batch and d not in rhs_contract)
    return model.matmul_instructions(batch, m, k, n)
