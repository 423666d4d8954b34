"""Which node of an FX graph torch-mlir failed to lower.

torch-mlir reports a failure on its own IR ("failed to legalize operation
'torch.operator' ... name = \"torch.laplace.check_gates\""), sometimes with
no op at all (std::bad_alloc). Users need the FX node. We read op names out
of the diagnostics when they are there; otherwise we lower each distinct op
of the graph on its own and keep those that fail.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import fake_tensor, fake_value, is_static
from laplace_passes.infra.op_facts import op_name, overload_packet_name
from laplace_passes.lowering._torch_mlir import TorchMlirFailure, import_stablehlo

# `name = "torch.aten.silu_backward"` (an op torch-mlir imported as an opaque
# torch.operator) or `operation 'torch.aten.foo'` (an op it has but cannot lower).
_OP_IN_DIAGNOSTICS = re.compile(r"""name = "torch\.([\w.]+)"|operation '(torch\.[\w.]+)'""")


@dataclass(frozen=True)
class Unlowerable:
    node: str
    op: str  # e.g. "laplace.check_gates.default"
    detail: str


class LoweringError(RuntimeError):
    """torch-mlir could not lower a graph; the message (and `unlowerable`) name the nodes."""

    def __init__(self, message: str, unlowerable: list[Unlowerable] | tuple = ()) -> None:
        super().__init__(message)
        self.unlowerable = list(unlowerable)


def find_unlowerable(gm: torch.fx.GraphModule, diagnostics: str) -> list[Unlowerable]:
    """The call_function nodes of `gm` that torch-mlir's `diagnostics` blame, or that fail alone."""
    blamed = _ops_named_in(diagnostics)
    if blamed:
        found = [
            Unlowerable(n.name, op_name(n), _first_line(diagnostics))
            for n in _calls(gm) if overload_packet_name(n) in blamed
        ]
        if found:
            return found
    return lower_each_op(gm)


def lowering_error(gm: torch.fx.GraphModule, diagnostics: str) -> LoweringError:
    """A LoweringError for `gm` that names the nodes torch-mlir's `diagnostics` come from."""
    found = find_unlowerable(gm, diagnostics)
    if not found:
        message = f"torch-mlir could not lower the graph, and every op lowers on its own: {_first_line(diagnostics)}"
    else:
        listed = "; ".join(f"node {u.node} ({u.op})" for u in found)
        message = f"torch-mlir cannot lower {len(found)} node(s): {listed}. torch-mlir said: {found[0].detail}"
        if any(u.op.startswith("laplace.gla") for u in found):  # only the re-tiled forms are standard ops
            message += (". laplace.gla is a GLA site the re-tiling pass did not re-tile: the report's GLA sites say "
                        "why (retile_gla=False, a dynamic length)")
    return LoweringError(message, found)


def _ops_named_in(diagnostics: str) -> set[str]:
    names = set()
    for opaque, illegal in _OP_IN_DIAGNOSTICS.findall(diagnostics):
        name = opaque or illegal.removeprefix("torch.")
        if name != "operator":
            names.add(name)
    return names


def _calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]


def _first_line(text: str) -> str:
    """The first error line, without the IR dump that follows its colon."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    line = (errors or lines or ["(no diagnostics)"])[0]
    return line.split(": %", 1)[0][:300]


def lower_each_op(gm: torch.fx.GraphModule, skip: Callable[[torch.fx.Node], bool] | None = None) -> list[Unlowerable]:
    """Lower one node at a time (one per distinct op and argument shapes) and keep the failures."""
    failures, tried = [], set()
    for node in _calls(gm):
        if skip is not None and skip(node):
            continue
        key = _signature(node)
        if key in tried or key is None:
            continue
        tried.add(key)
        try:
            import_stablehlo(_single_node_graph(node))
        except TorchMlirFailure as failure:
            failures.append(Unlowerable(node.name, op_name(node), _first_line(failure.diagnostics)))
    return failures


def _signature(node: torch.fx.Node):
    """(op, argument shapes and constants); None when a value has no fake tensor to build inputs from."""
    values = []
    for arg in node.all_input_nodes:
        value = fake_tensor(arg)
        if value is None or not is_static(value):  # a symbolic size: check_dynamic_shapes' finding
            return None
        values.append((tuple(value.shape), value.dtype))
    if fake_tensor(node) is None or not is_static(fake_tensor(node)):
        return None
    constants = repr(torch.fx.node.map_arg((node.args, node.kwargs), lambda _: None))
    return (node.target, tuple(values), constants)


def _single_node_graph(node: torch.fx.Node) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    inputs = {}
    for arg in node.all_input_nodes:
        placeholder = graph.placeholder(arg.name)
        placeholder.meta["val"] = fake_value(arg)
        inputs[arg] = placeholder
    copy = graph.call_function(node.target, *torch.fx.node.map_arg((node.args, node.kwargs), inputs.__getitem__))
    copy.meta["val"] = fake_value(node)
    graph.output((copy,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)
