"""How big a graph is for the target's compiler: node count and an instruction estimate.

neuronx-cc refuses graphs over about 5,000,000 generated instructions
([XTP002], docs/DESIGN.md sections 4 and 8). We cannot run it here, so each node gets an
estimate from its shapes, in units of the target's tile, `matmul_tile` =
(P, F) = (128 partition rows, 512 free elements) on trn2:

    matmul  [.., M, K] @ [.., K, N]   batch * ceil(K / P) * ceil(M / P) * ceil(N / F)
            (mm, bmm, addmm, baddbmm: the contraction runs over the partition
            dimension, one P x F output tile per instruction and K-step)
    views   view, reshape, permute, expand, slice, select, getitem, ...   0
            (layout changes the compiler folds into its access patterns)
    sizes   sym_size and arithmetic on sizes (graphs with symbolic sizes)   0
    fills   scalar_tensor, full, zeros, ones, empty, *_like   0
            (a splat constant once lowered: Python scalars and masks' fill values)
    other   ceil(max(numel of inputs and output) / (P * F)), at least 1
            (elementwise ops, reductions, copies, scans: one instruction per
            full tile the op reads or writes)
    loops   a scan still in the graph counts its body once per trip; a
            while_loop counts its body once (the unroll pass removes the
            loops whose trip count it knows)
    cond    the sum of both branches (each is compiled)

Placeholders, outputs and attributes cost nothing. A node without shape
information counts 1. A symbolic size (a graph compiled for dynamic shapes)
counts at its value in the example the graph was traced with.

Calibration. The estimate is made on the ATen graph; neuronx-cc compiles the
StableHLO torch-mlir makes of it, after decompositions. The same formula
applied op by op to that StableHLO (`laplace_passes.lowering.calibrate`)
was fitted against the estimate over 12 points (`python -m
benchmarks.bench_lowering --no-iree`: the tiny model at T = 256..4096 and
1..8 layers, the small model at T = 256..4096, forward + backward):

    estimate = 1.007 * stablehlo_estimate + 27      R^2 = 1.0000, worst gap 3.0%
(measured before fills counted 0 and the StableHLO was cleaned of f64 scalar
converts, which the two changes offset; tests/test_lowering.py still checks
the two agree within 5% on the tiny model; the fit was not re-run.)

So the ATen-level estimate tracks what the compiler receives. Raw StableHLO
op counts do not measure size: they grow with chunks (36 per chunk) and
layers (881 per layer) but are the same for the tiny and the small model,
while the work per op grows with the width. What is not calibrated here: the
tile constants (P, F) against neuronx-cc's own instruction counts, which
need neuronx-cc (not installable off Trainium). `SizeModel` keeps them in
one place.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import (
    COND, SCAN, WHILE_LOOP, fake_tensor, fake_value, size_hint, subgraph, tensor_values,
)
from laplace_passes.infra.op_facts import CONSTANT_FILLS, is_view, matmul_factors




@dataclass(frozen=True)
class SizeModel:
    """Instruction estimate per node; see the module docstring for the formula."""

    partition_rows: int = 128  # P
    free_elements: int = 512  # F

    def __post_init__(self) -> None:
        for name in ("partition_rows", "free_elements"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SizeModel.{name} must be a positive int, got {value!r}")

    @classmethod
    def for_target(cls, target) -> SizeModel:
        rows, free = target.matmul_tile
        return cls(partition_rows=rows, free_elements=free)

    @property
    def tile_elements(self) -> int:
        return self.partition_rows * self.free_elements

    def node_instructions(self, node: torch.fx.Node) -> int:
        if node.op != "call_function" or node.target is operator.getitem:
            return 0
        if isinstance(fake_value(node), (torch.SymInt, int)):
            return 0  # a size (sym_size, arithmetic on sizes): host arithmetic, no instruction
        if node.target in (SCAN, WHILE_LOOP):
            return self._loop_instructions(node)
        if node.target is COND:
            return self._cond_instructions(node)
        if is_view(node) or node.target in CONSTANT_FILLS:
            return 0
        if matmul_factors(node) is not None:
            estimate = self._matmul_instructions(node)
            if estimate is not None:
                return estimate
        numels = [_numel(v) for v in _tensor_values(node)]
        if not numels:
            return 1
        return self.elementwise_instructions(max(numels))

    def elementwise_instructions(self, numel: int) -> int:
        """One instruction per full tile read or written, at least 1 (the module docstring's "other")."""
        return max(1, math.ceil(numel / self.tile_elements))

    def matmul_instructions(self, batch: int, M: int, K: int, N: int) -> int:
        """[batch, M, K] @ [batch, K, N]: one P x F output tile per instruction and K-step."""
        P, F = self.partition_rows, self.free_elements
        return max(1, batch) * math.ceil(K / P) * math.ceil(M / P) * math.ceil(N / F)

    def measure(self, gm: torch.fx.GraphModule) -> GraphSize:
        per_node = {node: self.node_instructions(node) for node in gm.graph.nodes}
        return GraphSize(nodes=len(per_node), instructions=sum(per_node.values()), per_node=per_node)

    def _matmul_instructions(self, node: torch.fx.Node) -> int | None:
        a, b = (fake_tensor(f) for f in matmul_factors(node))
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() < 2 or b.dim() < 2:
            return None
        *batch, M, K = (size_hint(d) for d in a.shape)  # a dynamic size: at the example's value
        return self.matmul_instructions(math.prod(batch), M, K, size_hint(b.shape[-1]))

    def _cond_instructions(self, node: torch.fx.Node) -> int:
        """Both branches: the compiler generates the code of each."""
        gm = node.graph.owning_module
        branches = [subgraph(gm, arg) for arg in node.args[1:3]]
        return max(1, sum(self.measure(branch).instructions for branch in branches))

    def _loop_instructions(self, node: torch.fx.Node) -> int:
        body = subgraph(node.graph.owning_module, node.args[0] if node.target is SCAN else node.args[1])
        per_trip = self.measure(body).instructions
        trips = 1
        if node.target is SCAN:
            xs = node.args[2]
            first = fake_tensor(xs[0]) if xs else None
            length = first.shape[0] if first is not None and first.dim() else 1
            trips = size_hint(length)
        return per_trip * trips


@dataclass
class GraphSize:
    nodes: int
    instructions: int
    per_node: dict = field(repr=False)  # torch.fx.Node -> instructions


def _tensor_values(node: torch.fx.Node) -> list:
    """What the node reads and writes."""
    values = tensor_values(fake_value(node))
    for arg in node.all_input_nodes:
        values += tensor_values(fake_value(arg))
    return values


def _numel(value: torch.Tensor) -> int:
    return size_hint(value.numel())
