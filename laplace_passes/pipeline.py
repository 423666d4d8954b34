"""The passes, listed in the order they run: no registry, no import side effects."""

from __future__ import annotations

from laplace_passes.collectives import RewriteMuonStep, is_candidate
from laplace_passes.config import CompileConfig
from laplace_passes.fla.report_pass import ReportFlaCalls
from laplace_passes.fx.retile import RetileGLA
from laplace_passes.passes import GraphPass
from laplace_passes.unroll import FitGraphToBudget, SizeModel, UnrollLoops


def dynamo_passes(config: CompileConfig) -> list[GraphPass]:
    """Passes over the torch-level graph Dynamo captured, before AOT Autograd."""
    passes: list[GraphPass] = []
    if config.retile_gla:
        passes.append(RetileGLA(config.chunk_size, config.target.sub_chunk_size, config.target.recurrent_max_tokens))
    # User scan / while_loop: unrolled before AOT Autograd, which cannot
    # differentiate a scan in torch 2.13. The newest graph record is this graph.
    passes.append(UnrollLoops("dynamo", record=_current_graph(config)))
    passes.append(ReportFlaCalls())  # fla calls left to fla (no replacement): a report line each
    return passes


def aten_passes(config: CompileConfig, kind: str) -> list[GraphPass]:
    """Passes over each ATen graph (forward, backward, inference) AOT Autograd produces."""
    passes: list[GraphPass] = []
    current = _current_graph(config)
    if config.muon_all_to_all and kind == "inference" and current is not None and is_candidate(current.before):
        # A Muon step runs under no_grad: one inference graph. Graphs with no
        # gather and no Newton-Schulz (a GLA model, say) do not get the pass.
        passes.append(RewriteMuonStep(target=config.target, record=current))
    # GLA chunk-loop ops (and any scan / while_loop left) -> straight-line
    # code, decomposed like the rest of the graph for the inner compiler.
    decompositions = config.inner.decompositions() if config.inner.decompositions is not None else None
    passes.append(UnrollLoops("aten", record=current, decompositions=decompositions))
    # Last, the inner compiler's own passes: they prepare the final graph for
    # it (for the lowering compilers: making it lowerable, the Neuron preflight).
    if config.inner.aten_passes is not None:
        passes += config.inner.aten_passes(config, kind)
    # After everything that changes the graph: measure what the inner
    # compiler receives, and cut it into partitions if it is over budget.
    model = SizeModel.for_target(config.target)
    passes.append(FitGraphToBudget(config.max_graph_instructions, model, kind, record=current,
                                   forward_graphs=_forward_graphs(config)))
    return passes


def _forward_graphs(config: CompileConfig):
    """The forward graphs compiled so far, as AOT Autograd made them: a backward graph's saved inputs carry their names."""
    return lambda: [g.before for g in config.report.graphs if g.kind == "forward"]


def _current_graph(config: CompileConfig):
    """The record of the graph these passes are for: the backend records each graph just before its passes."""
    return config.report.graphs[-1] if config.report.graphs else None
