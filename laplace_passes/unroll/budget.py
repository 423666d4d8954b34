"""The budget pass: measure each ATen graph; cut one over the budget into partitions that fit.

Last of the ATen passes, so it measures what the inner compiler receives.
A graph within the budget (or a target with none) is left as it is; the
report records its size either way. Over the budget, the graph becomes a
driver that calls its partitions in order (NOTE [partitioned graph: before
and after] in `split.py`), and `split.compile_graph` compiles each partition
separately. A graph that no cut can fit (one node alone over the budget) is
declined with that reason and compiled whole, and so is a graph with
symbolic sizes (its estimate holds for the traced example only; targets
with a budget compile each concrete shape on its own, see
`laplace_passes.driver.shapes`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import dynamic_dims, value_bytes
from laplace_passes.infra.op_facts import is_view
from laplace_passes.infra.pass_base import Declined, GraphPass, PassResult
from laplace_passes.infra.report import PartitionRecord, SizeRecord
from laplace_passes.unroll.partition import plan_partitions
from laplace_passes.unroll.size import SizeModel
from laplace_passes.unroll.split import partition_calls, split_graph
from laplace_passes.unroll.tiles import tile_use

# AOT Autograd names the backward graph's inputs: tangents_1, ... for the
# gradients, primals_1, ... for forward inputs it kept (parameters, token ids:
# memory held anyway); every other input is named after the forward node that
# made it.
_NOT_ACTIVATIONS = ("tangents_", "primals_")


class FitGraphToBudget(GraphPass):
    """Record the graph's estimated size; partition it when it is over `budget` instructions.

    `forward_graphs`: for a backward graph, the forward graphs compiled before
    it, as AOT Autograd made them; its saved inputs are named after the
    forward nodes that made them (see `backward_activation_bytes`).
    """

    name = "fit_to_budget"

    def __init__(
        self, budget: int | None, model: SizeModel, kind: str,
        forward_graphs: Sequence[torch.fx.GraphModule] = (),
    ) -> None:
        self.budget = budget
        self.model = model
        self.kind = kind
        self.forward_graphs = list(forward_graphs)

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        size = self.model.measure(gm)
        tiles = tile_use(gm, self.model.partition_rows)
        info = SizeRecord(nodes=size.nodes, instructions=size.instructions, budget=self.budget,
                          whole_tile_share=tiles.whole_tile_share, small_products=tiles.small_products)
        if self.kind == "backward":
            info.saved_for_backward_bytes = backward_activation_bytes(gm, self.forward_graphs)
        against = "no budget" if self.budget is None else f"budget {self.budget:,}"
        summary = f"{size.nodes} nodes, ~{size.instructions:,} instructions ({against})"
        if self.budget is None or size.instructions <= self.budget:
            return PassResult(gm, modified=False, summary=summary + ": fits", size=info)
        try:
            _require_static_sizes(gm)
            plan = plan_partitions(gm, size.per_node, self.budget)
        except Declined as declined:
            info.note = f"over budget, not cut: {declined.reason}"
            return PassResult(gm, modified=False, summary=summary + ": over budget", declined=[declined.reason],
                               size=info)
        info.partitions = [
            PartitionRecord(index=i, nodes=plan.nodes[i], instructions=plan.instructions[i],
                            bytes_in=plan.bytes_in[i])
            for i in range(plan.count)
        ]
        info.cut_bytes = list(plan.cut_bytes)
        summary += f": cut into {plan.count} partitions"
        return PassResult(split_graph(gm, plan), modified=True, summary=summary, size=info)

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Every partition the graph calls fits the budget (measured again on the partition itself)."""
        if self.budget is None:
            return
        for index, call in enumerate(partition_calls(gm)):
            instructions = self.model.measure(gm.get_submodule(call.target)).instructions
            if instructions > self.budget:
                raise RuntimeError(f"partition {index} has {instructions} instructions > budget {self.budget}")


def _require_static_sizes(gm: torch.fx.GraphModule) -> None:
    """Partitions are compiled for static shapes: a graph with symbolic sizes is not cut."""
    dynamic = dynamic_dims(gm)
    if dynamic:
        raise Declined(f"its sizes are dynamic ({', '.join(dynamic)}), estimated at the traced example's "
                       "values; a static-shape target compiles each concrete shape on its own instead")


def backward_activation_bytes(gm: torch.fx.GraphModule, forward_graphs: list[torch.fx.GraphModule] = ()) -> int:
    """Bytes of the activations a backward graph reads from its forward.

    Its inputs other than gradients and forward inputs, less those its
    forward graph made as views of its own inputs (a weight's transpose:
    no memory of its own). Without the forward graph every such input counts.
    """
    saved = [n for n in gm.graph.nodes if n.op == "placeholder" and not n.name.startswith(_NOT_ACTIVATIONS)]
    made_by = _forward_nodes({n.name for n in saved}, forward_graphs)
    return sum(value_bytes(n) for n in saved if not _views_an_input(made_by.get(n.name)))


def _forward_nodes(names: set[str], forward_graphs: list[torch.fx.GraphModule]) -> dict:
    """The nodes named `names` in the (latest) forward graph, as AOT Autograd made it, that returns all of them."""
    for forward in reversed(list(forward_graphs)):
        returned = {n.name: n for n in forward.graph.output_node().all_input_nodes}
        if names <= returned.keys():
            return returned
    return {}


def _views_an_input(node: torch.fx.Node | None) -> bool:
    while node is not None and node.op == "call_function" and is_view(node) and node.args:
        node = node.args[0] if isinstance(node.args[0], torch.fx.Node) else None
    return node is not None and node.op == "placeholder"
