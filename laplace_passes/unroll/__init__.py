"""Static unrolling of sequential loops, and keeping every graph under the compiler's size budget.

    InlineRegions      calls of a nested compile region (Dynamo graphs) -> the region's nodes
    UnrollLoops        scan / while_loop with a static trip count (Dynamo and ATen graphs) and
                       the GLA chunk-loop ops (ATen graphs) -> straight-line code
    SizeModel          node count and an instruction estimate per graph, from shapes
    FitGraphToBudget   measure each ATen graph; cut one over the budget into partitions
    compile_graph      hand a graph, or each of its partitions, to the inner compiler

Where they run: `laplace_passes.driver.pipeline`. What they record: each graph's
`loops` and `size` in the report.
"""

from laplace_passes.unroll.budget import FitGraphToBudget, backward_activation_bytes
from laplace_passes.unroll.partition import PartitionPlan, plan_partitions
from laplace_passes.unroll.regions import InlineRegions
from laplace_passes.unroll.size import GraphSize, SizeModel
from laplace_passes.unroll.split import PARTITION_PREFIX, compile_graph, partition_calls, split_graph
from laplace_passes.unroll.unroll_pass import UnrollLoops

__all__ = [
    "PARTITION_PREFIX",
    "FitGraphToBudget",
    "GraphSize",
    "InlineRegions",
    "PartitionPlan",
    "SizeModel",
    "UnrollLoops",
    "backward_activation_bytes",
    "compile_graph",
    "partition_calls",
    "plan_partitions",
    "split_graph",
]
