"""The passes, listed in the order they run: no registry, no import side effects.

Each function builds the passes for one graph, giving each what it needs
besides the graph (`GraphContext`: the graph's name and kind, the target,
the budget; the forward graphs a backward graph's activations come from).
"""

from __future__ import annotations

from typing import Sequence

import torch.fx

from laplace_passes.collectives import RewriteMuonStep, is_candidate
from laplace_passes.driver.config import CompileConfig
from laplace_passes.fla.report_pass import ReportFlaCalls
from laplace_passes.fx.retile import RetileGLA
from laplace_passes.infra.pass_base import GraphContext, GraphPass
from laplace_passes.unroll import FitGraphToBudget, SizeModel, UnrollLoops


def graph_context(config: CompileConfig, name: str, kind: str) -> GraphContext:
    return GraphContext(name, kind, config.target, config.max_graph_instructions)


def dynamo_passes(config: CompileConfig) -> list[GraphPass]:
    """Passes over the torch-level graph Dynamo captured, before AOT Autograd."""
    passes: list[GraphPass] = []
    if config.retile_gla:
        target = config.target
        passes.append(RetileGLA(config.chunk_size, target.sub_chunk_size, target.recurrent_max_tokens,
                                target.recurrent_readout, target.save_residuals,
                                prove_gates=config.gate_checks == "auto"))
    # User scan / while_loop: unrolled before AOT Autograd, which cannot
    # differentiate a scan in torch 2.13.
    passes.append(UnrollLoops("dynamo"))
    passes.append(ReportFlaCalls())  # fla calls left to fla (no replacement): a report line each
    return passes


def aten_passes(
    config: CompileConfig, context: GraphContext, gm: torch.fx.GraphModule,
    forward_graphs: Sequence[torch.fx.GraphModule] = (),
) -> list[GraphPass]:
    """Passes over one ATen graph (forward, backward, inference) AOT Autograd produced.

    `forward_graphs`: the forward graphs compiled so far, as AOT Autograd made
    them; a backward graph's saved inputs carry the names of their nodes.
    """
    passes: list[GraphPass] = []
    if config.muon_all_to_all and context.kind == "inference" and is_candidate(gm):
        # A Muon step runs under no_grad: one inference graph. Graphs with no
        # gather and no Newton-Schulz (a GLA model, say) do not get the pass.
        passes.append(RewriteMuonStep(target=config.target))
    # GLA chunk-loop ops (and any scan / while_loop left) -> straight-line
    # code, decomposed like the rest of the graph for the inner compiler.
    passes.append(UnrollLoops("aten", decompositions=config.decompositions()))
    # Then the inner compiler's own passes: they prepare the final graph for
    # it (for the lowering compilers: making it lowerable, the Neuron preflight).
    passes += config.inner.aten_passes(context)
    # After everything that changes the graph: measure what the inner
    # compiler receives, and cut it into partitions if it is over budget.
    model = SizeModel.for_target(config.target)
    passes.append(FitGraphToBudget(config.max_graph_instructions, model, context.kind, forward_graphs=forward_graphs))
    # Last, the inner compiler's passes over what it receives, the graph or
    # its partitions (lowering each once, to StableHLO, say).
    passes += config.inner.final_passes(context)
    return passes
