"""ATen graph -> StableHLO with torch-mlir, and the `stablehlo` inner compiler.

`lower_to_stablehlo(gm)` returns a `LoweredGraph`: the module's text, its
inputs and outputs (shapes, dtypes) and its op counts by op name. The
`LowerToStableHLO` pass runs it as the last ATen pass of the lowering inner
compilers (after the budget pass, on each partition of a cut graph), so the
report shows every graph's op count and a graph torch-mlir cannot lower
fails at compile time, naming the op.

inner="stablehlo" lowers every graph (forward, backward, inference, every
partition) and then runs the ATen graph itself eagerly: StableHLO needs an
executor, which is what inner="iree" adds. Use
`laplace_passes.export_stablehlo` to write the modules to files.

A graph the budget pass (laplace_passes.unroll) cut into partitions reaches
the inner compiler partition by partition: each partition is lowered once
(and, with inner="iree", compiled) on its own; the pass's report entry
sums them.

torch-mlir's FX importer cannot return None: AOT Autograd's backward
returns None for inputs without a gradient (token ids). Those outputs are
left out of the module and put back by `LoweredGraph.assemble_outputs`.
"""

from __future__ import annotations

import weakref

import copy
import io
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx
from functorch.compile import make_boxed_func

from laplace_passes.infra.fx_helpers import fake_tensor, fake_value, output_values, propagate_from_inputs
from laplace_passes.infra.inner import InnerCompiler
from laplace_passes.lowering import _deps
from laplace_passes.lowering._torch_mlir import TorchMlirFailure, import_stablehlo
from laplace_passes.lowering.collectives import CollectiveLoweringError
from laplace_passes.lowering.diagnose import LoweringError, lowering_error
from laplace_passes.infra.pass_base import GraphPass, PassResult
from laplace_passes.unroll import partition_calls

# Each graph module's lowering, made once by `LowerToStableHLO` and read by the inner compiler that
# receives the module (`lowered_graph`); weak keys: a dropped graph takes its lowering with it.
_LOWERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output; a symbolic size is written as its symbol ("s0")."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str

    @classmethod
    def of(cls, node: torch.fx.Node) -> TensorSpec:
        value = fake_value(node)
        if not isinstance(value, torch.Tensor):  # a symbolic size passed as an input
            return cls(node.name, (), type(value).__name__)
        shape = tuple(s if isinstance(s, int) else str(s) for s in value.shape)
        return cls(node.name, shape, str(value.dtype).removeprefix("torch."))

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass
class LoweredGraph:
    """One ATen graph as a StableHLO module (function `main`)."""

    text: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    # The ATen graph returns `output_count` values; the module returns the
    # tensors among them, which go to `output_positions` (the rest are None).
    output_positions: list[int]
    output_count: int
    # Inputs the graph updates in place (a trailing copy_ kept by keep_inference_input_mutations):
    # the module returns their new values after its outputs, as TorchNeuron's importer does.
    input_updates: list[str] = field(default_factory=list)
    op_counts: dict[str, int] = field(default_factory=dict)
    # The same module as MLIR bytecode: what TorchNeuron hands neuronx-cc (tied to torch-mlir's MLIR version).
    bytecode: bytes = b""

    @property
    def total_ops(self) -> int:
        return sum(self.op_counts.values())

    def assemble_outputs(self, values) -> tuple:
        """The module's results in the ATen graph's output order, None where it returned None."""
        outputs = [None] * self.output_count
        values = list(values)[: len(values) - len(self.input_updates)] if self.input_updates else values
        for position, value in zip(self.output_positions, values, strict=True):
            outputs[position] = value
        return tuple(outputs)

    def summary(self) -> str:
        top = ", ".join(f"{name.removeprefix('stablehlo.')} {n}" for name, n in _most_common(self.op_counts, 4))
        loops = self.op_counts.get("stablehlo.while", 0)
        calls = self.op_counts.get("stablehlo.custom_call", 0)
        return f"{self.total_ops} StableHLO ops ({top}); {loops} while, {calls} custom_call"

    def to_dict(self) -> dict:
        return {
            "inputs": [s.to_dict() for s in self.inputs],
            "outputs": [s.to_dict() for s in self.outputs],
            "op_counts": dict(sorted(self.op_counts.items())),
            "total_ops": self.total_ops,
        }


def _most_common(counts: dict[str, int], n: int) -> list[tuple[str, int]]:
    return Counter(counts).most_common(n)


def torch_mlir_decompositions() -> dict:
    """torch-mlir's decomposition table: what AOT Autograd applies for the lowering compilers.

    It turns ops torch-mlir has no lowering for (silu_backward, addmm, ...)
    into ones it has, the same table `torch_mlir.fx.export_and_import` uses.
    """
    _deps.torch_mlir_fx("decomposing ATen graphs for torch-mlir")
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    return get_decomposition_table()


def lower_to_stablehlo(gm: torch.fx.GraphModule, example_inputs: list | None = None) -> LoweredGraph:
    """Lower `gm` with torch-mlir; raise LoweringError naming the ops it cannot lower.

    `gm` itself is not changed. Nodes without a fake value (`meta["val"]`)
    get one from FakeTensorProp over `example_inputs` first.
    """
    ensure_fake_values(gm, example_inputs)
    lowering_gm, positions, count = _without_none_outputs(gm)
    updates = _input_copies_as_outputs(lowering_gm)
    try:
        module = import_stablehlo(lowering_gm)
    except TorchMlirFailure as failure:
        raise lowering_error(gm, failure.diagnostics) from failure
    except CollectiveLoweringError as error:
        raise LoweringError(f"a collective cannot be lowered: {error}") from error
    except NotImplementedError as error:  # the importer's refusal of an op it has no lowering for (torch.cond)
        raise LoweringError(f"torch-mlir cannot lower this graph: {error}{_control_flow_hint(gm)}") from error
    return LoweredGraph(
        text=str(module),
        inputs=[TensorSpec.of(n) for n in gm.graph.find_nodes(op="placeholder")],
        outputs=[TensorSpec.of(n) for n in output_values(lowering_gm)],
        output_positions=positions,
        output_count=count,
        input_updates=updates,
        op_counts=count_ops(module),
        bytecode=_bytecode(module),
    )


_CONTROL_FLOW = frozenset({"cond", "while_loop", "scan", "map", "map_impl", "associative_scan"})


def _control_flow_hint(gm: torch.fx.GraphModule) -> str:
    """What to do about a control-flow op left in `gm` (torch.cond, while_loop): none lowers here."""
    flows = sorted({n.target.__name__ for n in gm.graph.nodes
                    if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)
                    and n.target.__name__ in _CONTROL_FLOW})
    if not flows:
        return ""
    return (f" (the graph holds control flow: {', '.join(flows)}, which torch-mlir does not lower; compute both "
            "branches and select with torch.where; laplace_passes.preflight names it as a [control-flow] finding)")


def _bytecode(module) -> bytes:
    buffer = io.BytesIO()
    module.operation.write_bytecode(buffer)
    return buffer.getvalue()


def count_ops(module) -> dict[str, int]:
    """Operations in an MLIR module by name (`stablehlo.add`: 33, ...), nested regions included."""
    from torch_mlir import ir

    counts: Counter[str] = Counter()

    def visit(op):
        counts[op.name] += 1
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    counts.pop("builtin.module", None)
    return dict(counts)


def ensure_fake_values(gm: torch.fx.GraphModule, example_inputs: list | None) -> None:
    """Give every node a fake value (torch-mlir's importer reads shapes and dtypes in `meta["val"]`)."""
    nodes = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function")]
    missing = [n for n in nodes if fake_value(n) is None]
    if not missing:
        return
    if example_inputs is None:
        raise LoweringError(f"node {missing[0].name} has no fake value (meta['val']) and no example inputs were given")
    propagate_from_inputs(gm, example_inputs)


def _without_none_outputs(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[int], int]:
    """A copy of `gm` returning only its tensor outputs, their positions, and the original count."""
    copied = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    values = output_values(copied)
    positions = [i for i, v in enumerate(values) if v is not None]
    for position in positions:
        value = values[position]
        if fake_tensor(value) is None:
            raise LoweringError(f"output {position} ({value}) is not a tensor; StableHLO functions return tensors")
    output = copied.graph.find_nodes(op="output")[0]
    output.args = (tuple(values[i] for i in positions),)
    copied.recompile()
    return copied, positions, len(values)


def _input_copies_as_outputs(gm: torch.fx.GraphModule) -> list[str]:
    """Replace each `copy_(input, value)` by returning `value` last; the names of the inputs updated.

    AOT Autograd leaves an in-place update of an input in the graph when
    keep_inference_input_mutations is set (inner="neuron", as TorchNeuron's
    own backend does). torch-mlir's stateless importer cannot lower a copy_
    into an argument; TorchNeuron's FunctionalizeCopyInplacePass
    (torch_neuronx/neuron_dynamo_backend/fx/passes) rewrites it this way
    before lowering, and its executor writes the extra results back.
    """
    copies = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
              and n.args[0].op == "placeholder"]
    if not copies:
        return []
    updates = [(c.args[0].name, c.args[1]) for c in copies]
    output = gm.graph.find_nodes(op="output")[0]
    for copy_node in copies:
        copy_node.replace_all_uses_with(copy_node.args[1])
        gm.graph.erase_node(copy_node)
    output.args = (tuple(output.args[0]) + tuple(value for _, value in updates),)
    gm.recompile()
    return [name for name, _ in updates]


class LowerToStableHLO(GraphPass):
    """Lower the graph, or each partition it calls, with torch-mlir; keep the result for the inner compiler.

    NOTE [lower_to_stablehlo: before and after]
    The FX graph is unchanged; the pass attaches its StableHLO module, e.g.
    for `mm = aten.mm(x, w); gelu = aten.gelu(mm); return (gelu.sum(-1),)`:

        func.func @main(%arg0: tensor<4x8xf32>, %arg1: tensor<8x16xf32>) -> tensor<4xf32> {
          %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] ...
          ... gelu as multiply / erf polynomial ...
          %5 = stablehlo.reduce(%4 init: %cst) applies stablehlo.add across dimensions = [1] ...

    It runs after the budget pass, on what the inner compiler receives: a
    graph cut into partitions is lowered partition by partition (each module
    on its partition), never also whole. Fails (LoweringError) when
    torch-mlir cannot lower an op, naming it.
    """

    name = "lower_to_stablehlo"
    stops_compile_on_error = True  # NOTE [a failing pass declines]: the failure is the answer asked for

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        parts = [gm.get_submodule(call.target) for call in partition_calls(gm)] or [gm]
        lowered = []
        for part in parts:
            _LOWERED[part] = lower_to_stablehlo(part)
            lowered.append(_LOWERED[part])
        if len(lowered) == 1:
            return PassResult(gm, modified=False, summary=lowered[0].summary())
        total = sum(g.total_ops for g in lowered)
        summary = f"{total} StableHLO ops in {len(lowered)} partitions ({', '.join(str(g.total_ops) for g in lowered)})"
        return PassResult(gm, modified=False, summary=summary)


def lowered_graph(gm: torch.fx.GraphModule, example_inputs: list) -> LoweredGraph:
    """The lowering `LowerToStableHLO` made of `gm`, or a new one."""
    lowered = _LOWERED.get(gm)
    return lowered if lowered is not None else lower_to_stablehlo(gm, example_inputs)


class StableHLOCompiler(InnerCompiler):
    """inner="stablehlo": each graph lowered by torch-mlir (failing at compile time if it cannot), then run eagerly."""

    name = "stablehlo"
    static_shapes = True  # neuronx-cc's input: every size static
    legalizes = True
    lowers_to_stablehlo = True

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
        lowered_graph(gm, example_inputs)
        return make_boxed_func(gm.forward)

    def decompositions(self) -> dict:
        return torch_mlir_decompositions()

    def check_available(self) -> None:
        _deps.check_stablehlo()
