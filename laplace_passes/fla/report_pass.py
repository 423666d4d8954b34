"""The pass that lists, for the report, the fla calls left to fla.

NOTE [fla_calls: before and after]
The graph is not changed. Before (a `fused_recurrent_gla` call with value
gates, which `laplace::gla` cannot express, left to fla behind a graph break):

    fla_call_not_replaced = torch.ops.laplace.fla_call_not_replaced.default(
        q, 'fla.fused_recurrent_gla', 'value gates (gv) have no laplace::gla form')
    return (fla_call_not_replaced, ...)        # fla runs the call after the graph

After: the same graph, and in the report

    fla_calls  dynamo_0  fla.fused_recurrent_gla (node fla_call_not_replaced): not replaced:
                         value gates (gv) have no laplace::gla form

Triton kernels Dynamo captured as graph nodes (`triton_kernel_wrapper_*`,
from fla code nothing replaced) are listed the same way.
"""

from __future__ import annotations

import torch.fx

from laplace_passes.fla.not_replaced import MARKER
from laplace_passes.infra.fx_helpers import graph_and_run_once_bodies
from laplace_passes.infra.pass_base import GraphPass, PassResult


class ReportFlaCalls(GraphPass):
    """List each fla call in the graph that was left to fla (a report line per call)."""

    name = "fla_calls"

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        lines = []
        # The graph and the bodies it calls once (a checkpointed layer): NOTE [run-once bodies].
        nodes = [(where, node) for where, module in graph_and_run_once_bodies(gm) for node in module.graph.nodes]
        for where, node in nodes:
            if node.op != "call_function":
                continue
            if node.target is MARKER:
                _, call, reason = node.args
                lines.append(f"{call} (node {where}{node.name}{_module_path(node)}): not replaced: {reason}")
            elif "triton_kernel_wrapper" in str(node.target):
                kernel = node.kwargs.get("kernel_idx", "?")
                lines.append(f"Triton kernel #{kernel} (node {where}{node.name}): not replaced: Dynamo captured a "
                             f"Triton kernel that no laplace replacement covers")
        summary = f"{len(lines)} fla call(s) left to fla" if lines else "no fla call left to fla"
        return PassResult(gm, modified=False, summary=summary, declined=lines)


def _module_path(node: torch.fx.Node) -> str:
    """", in model.layers.0.attn": the module the call was made in (Dynamo's nn_module_stack), if known."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])  # Dynamo's source: "L['self'].layers.0.attn", "L['module'].layers.0"
    for root in ("L['self']", "L['module']", "L['mod']"):
        if path.startswith(root):
            path = "model" + path[len(root):]
    return f", in {path}"
