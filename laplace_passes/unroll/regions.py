"""The pass that inlines nested compile regions: each `invoke_subgraph` call becomes its body's own nodes.

NOTE [nested compile regions: before and after]
`torch.compiler.nested_compile_region` marks a function (a transformer
block, say) whose graph torch traces once and calls at every use. Dynamo
records each use as a call of the one body:

    subgraph_0 = self.subgraph_0
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph(subgraph_0, 'subgraph_0', l_q_, l_g_, l_k_, l_v_)
    o = invoke_subgraph[0];  getitem_1 = invoke_subgraph[1]
    mul = l_q_ * 2
    invoke_subgraph_1 = torch.ops.higher_order.invoke_subgraph(subgraph_1, 'subgraph_0', mul, l_g_, l_k_, l_v_)

After, on the Dynamo graph before any other pass, the body's nodes copied in
at each call, its placeholders bound to the call's operands:

    mul_1 = l_g_.exp() ...;  S_1 = ... ;  stack = torch.stack([...], 1)     # the first call's body
    mul = l_q_ * 2
    mul_41 = l_g_.exp() ...;  S_41 = ... ;  stack_1 = torch.stack([...], 1)  # the second call's

Why: every pass after this one reads one graph. A GLA written in plain
PyTorch inside a region is found only where its loop is in the graph
(recognition); a GLA site's chunk loop is unrolled, and the graph's size
measured against the Neuron compiler's budget, only in the graph; the
Neuron compiler takes one graph. Without it, a region's loop went through
un-tiled with an empty report, and on trn2 a site's chunk loop stayed
inside the region, unrolled nowhere and left out of the size estimate.
What is given up is the region's own saving: its body is compiled at each
call instead of once.

A call whose results are read whole rather than element by element is
declined with that reason and left as it is.
"""

from __future__ import annotations

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import graph_and_run_once_bodies, provenance_of, subgraph
from laplace_passes.infra.pass_base import GraphPass, PassResult
from laplace_passes.unroll.inline import erase_unused, getitem_users, inline_graph, replace_tuple_result

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


class InlineRegions(GraphPass):
    """Replace each call of a nested compile region by a copy of its body (NOTE [nested compile regions: ...])."""

    name = "inline_regions"

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        inlined, regions, declined = 0, set(), {}
        for where, graph_module in graph_and_run_once_bodies(gm):  # a region in a checkpointed block too
            while calls := [n for n in graph_module.graph.nodes if _is_region_call(n) and n not in declined]:
                for node in calls:  # a body that calls a region brings a new call in: hence the loop
                    if getitem_users(node) is None:
                        declined[node] = f"{where}{node.name}: its results are read whole, not element by element"
                        continue
                    regions.add(node.args[1])
                    _inline(graph_module, node)
                    inlined += 1
            graph_module.delete_all_unused_submodules()
        summary = (f"inlined {inlined} call(s) of {len(regions)} nested compile region(s): "
                   f"{', '.join(sorted(regions))}" if inlined else "no nested compile region")
        return PassResult(gm, modified=inlined > 0, summary=summary, declined=list(declined.values()))

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        left = [where + n.name for where, n in _region_calls(gm) if getitem_users(n) is not None]
        if left:
            raise RuntimeError(f"inline_regions left calls it did not decline: {left}")


def calls_a_region(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph, or a body it calls once, calls a nested compile region (the pass's graphs)."""
    return bool(_region_calls(gm))


def _region_calls(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.Node]]:
    """(where, node) for every region call in the graph and the bodies it calls once."""
    return [(where, n) for where, graph_module in graph_and_run_once_bodies(gm) for n in graph_module.graph.nodes
            if _is_region_call(n)]


def _is_region_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is INVOKE_SUBGRAPH


def _inline(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """The body's nodes in place of `node`; its getitems read the copies of the body's outputs."""
    body_attr, _, *operands = node.args
    with gm.graph.inserting_before(node):
        outputs = inline_graph(gm, subgraph(gm, body_attr), operands, provenance_of(node))
    replace_tuple_result(gm.graph, node, outputs)
    erase_unused([body_attr])
