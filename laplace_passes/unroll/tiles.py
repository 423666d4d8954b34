"""How much of a graph's matmul work fills the TensorEngine: FLOPs on whole 128 x 128 tiles, small products.

The TensorEngine is a 128 x 128 systolic array (AWS Neuron SDK,
nki/guides/architecture/trainium2_arch.rst): one matmul instruction
multiplies a stationary K x M tile (K, M <= 128) by a moving K x N tile.
Either operand of [M, K] @ [K, N] can be the stationary one (the product's
transpose is the same work), so the larger free dimension L = max(M, N) is
taken as stationary; with K or L under 128, rows or columns of the array
idle. Per graph:

    matmul FLOPs        2 * batch * M * K * N over every mm / bmm / addmm / baddbmm
    whole-tile share    the part of those FLOPs on whole 128 x 128 (K x L) tiles:
                        floor(K / 128) * 128 * floor(L / 128) * 128 / (K * L) of each product
    small products      batch elements of products whose K or L is under 128

Chunked GLA's intra-chunk scores are built from small products by design
(halves of 64, 32 and 16 rows down to 16-row leaves on trn2, NOTE [stable
intra-chunk scores]); this measure is what the report and
`benchmarks/bench_lowering.py` show for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import fake_tensor
from laplace_passes.infra.op_facts import matmul_factors



@dataclass(frozen=True)
class TileUse:
    matmul_flops: int
    whole_tile_flops: int
    small_products: int  # batch elements with M or K under the tile size
    products: int  # all batch elements of all matmuls

    @property
    def whole_tile_share(self) -> float:
        return self.whole_tile_flops / self.matmul_flops if self.matmul_flops else 1.0

    def __add__(self, other: TileUse) -> TileUse:
        return TileUse(self.matmul_flops + other.matmul_flops, self.whole_tile_flops + other.whole_tile_flops,
                       self.small_products + other.small_products, self.products + other.products)


def matmul_shape(node: torch.fx.Node) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of a static mm / bmm / addmm / baddbmm node, else None."""
    if node.op != "call_function":
        return None
    factors = matmul_factors(node)
    if factors is None:
        return None
    a, b = (fake_tensor(f) for f in factors)
    if a is None or b is None or a.dim() < 2 or b.dim() < 2:
        return None
    *batch, M, K = a.shape
    N = b.shape[-1]
    if not all(isinstance(d, int) for d in (*batch, M, K, N)):
        return None
    return math.prod(batch), M, K, N


def tile_use(gm: torch.fx.GraphModule, tile: int = 128) -> TileUse:
    """The measure of the module docstring over every static matmul of `gm`."""
    total = TileUse(0, 0, 0, 0)
    for node in gm.graph.nodes:
        shape = matmul_shape(node)
        if shape is None:
            continue
        batch, M, K, N = shape
        L, other = max(M, N), min(M, N)
        flops = 2 * batch * M * K * N
        whole = 2 * batch * (L // tile * tile) * (K // tile * tile) * other
        small = batch if L < tile or K < tile else 0
        total = total + TileUse(flops, whole, small, batch)
    return total
