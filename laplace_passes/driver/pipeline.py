"""The passes, declared once per stage in the order they run: no registry, no import side effects.

Two stages: `DYNAMO` runs on each torch-level graph Dynamo captures, before
AOT Autograd; `ATEN` on each ATen graph AOT Autograd derives (forward,
backward or inference). Each step names its pass, says in words when it
runs, and builds the pass for one graph from what the graph's passes are
given (`Build`: the compile's options, the graph's `GraphContext`, the
forward graphs a backward graph's activations come from, the passes built
before it on that graph). The backend (`compile_fx`), `laplace-passes
inspect --passes` and the report header all read these two tables; inner
compilers take part only through data (`InnerCompiler.legalizes`,
`.preflight`, `.lowers_to_stablehlo`), never by adding passes of their own.

    laplace_passes.driver.pipeline.describe(config)   # the table, with which steps apply
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch.fx

from laplace_passes.collectives import RewriteMuonStep, is_candidate
from laplace_passes.driver.config import CompileConfig
from laplace_passes.fla.report_pass import ReportFlaCalls
from laplace_passes.fx.recognise import RecogniseGLA
from laplace_passes.fx.retile import RetileGLA
from laplace_passes.infra.pass_base import GraphContext, GraphPass
from laplace_passes.lowering.fold_constants import FoldIndexConstants
from laplace_passes.lowering.legalize import (
    BoundSliceScatter,
    ClampGateChecks,
    DiagonalAsStridedSlice,
    ExpandScaledAdds,
)
from laplace_passes.lowering.preflight import NeuronPreflight, RequireCleanPreflight
from laplace_passes.lowering.stablehlo import LowerToStableHLO
from laplace_passes.unroll import FitGraphToBudget, InlineRegions, SizeModel, UnrollLoops
from laplace_passes.unroll.regions import calls_a_region


@dataclass
class Build:
    """What a step is given to build its pass for one graph."""

    config: CompileConfig
    context: GraphContext
    gm: torch.fx.GraphModule
    forward_graphs: Sequence[torch.fx.GraphModule] = ()
    built: dict[str, GraphPass] = field(default_factory=dict)  # this graph's passes so far, by name


def _always(config: CompileConfig) -> bool:
    return True


def _every_graph(build: Build) -> bool:
    return True


@dataclass(frozen=True)
class Step:
    name: str  # the pass's name, as the report shows it
    when: str  # when it runs, in words (`describe`)
    enabled: Callable[[CompileConfig], bool]  # what the compile's options decide
    make: Callable[[Build], GraphPass]
    graph_filter: Callable[[Build], bool] = _every_graph  # what the graph decides, among enabled steps

    def applies(self, build: Build) -> bool:
        return self.enabled(build.config) and self.graph_filter(build)


def _retile(build: Build) -> GraphPass:
    config, target = build.config, build.config.target
    return RetileGLA(config.chunk_size, target.sub_chunk_size, target.recurrent_max_tokens, target.recurrent_readout,
                     target.save_residuals, prove_gates=config.gate_checks == "auto",
                     checks_become_clamps=config.inner.legalizes, rewrite=config.retile_gla)


DYNAMO = (
    # Calls of a nested compile region become the region's nodes, so that every later pass reads one graph.
    Step("inline_regions", "graphs calling a torch.compiler.nested_compile_region: each call -> the region's nodes",
         _always, lambda b: InlineRegions(), lambda b: calls_a_region(b.gm)),
    # User scan / while_loop: unrolled before AOT Autograd, which cannot differentiate a scan in torch 2.13,
    # and before recognition, which then reads every token loop as straight-line steps.
    Step("unroll_loops", "always: user scan / while_loop with a static trip count", _always,
         lambda b: UnrollLoops("dynamo")),
    Step("recognise_gla", "option recognise_gla (default on): GLA written in plain PyTorch -> laplace::gla",
         lambda c: c.recognise_gla, lambda b: RecogniseGLA(checks_become_clamps=b.config.inner.legalizes)),
    # With retile_gla=False the pass still runs, to list each site in the report (declined, saying why).
    Step("retile_gla", "always: re-tiles with option retile_gla (default on); else lists the GLA sites", _always,
         _retile),
    Step("fla_calls", "always: fla calls left to fla get a report line each", _always, lambda b: ReportFlaCalls()),
)


def _muon_graph(build: Build) -> bool:
    # A Muon step runs under no_grad: one inference graph. Graphs with no gather and no Newton-Schulz
    # (a GLA model, say) do not get the pass.
    return build.context.kind == "inference" and is_candidate(build.gm)


def _legalizes(config: CompileConfig) -> bool:
    return config.inner.legalizes


def _budget(build: Build) -> GraphPass:
    model = SizeModel.for_target(build.config.target)
    return FitGraphToBudget(build.config.max_graph_instructions, model, build.context.kind,
                            forward_graphs=build.forward_graphs)


def _unroll(build: Build) -> GraphPass:
    config = build.config
    return UnrollLoops("aten", decompositions=config.decompositions(), chunk_recurrence=_recurrence(config),
                       compile_bodies=compiles_loop_bodies(config))


def _recurrence(config: CompileConfig) -> str:
    # A compiler that lowers to StableHLO takes ATen ops only: the recurrence reaches it unrolled.
    return "unrolled" if config.inner.legalizes else config.target.chunk_recurrence


def compiles_loop_bodies(config: CompileConfig) -> bool:
    """Inductor compiles a chunk-loop op's body once for every site of its shape (unroll/compiled_bodies.py)."""
    return _recurrence(config) == "op" and config.inner.compiles_loop_bodies and config.share_loop_bodies


ATEN = (
    Step("muon_all_to_all", "option muon_all_to_all (default on), inference graphs holding a gather or Newton-Schulz",
         lambda c: c.muon_all_to_all, lambda b: RewriteMuonStep(target=b.config.target), _muon_graph),
    # GLA chunk-loop ops (and any scan / while_loop left) -> straight-line code, decomposed like the rest of
    # the graph for the inner compiler.
    Step("unroll_loops", "always: GLA chunk-loop ops, scan / while_loop left", _always, _unroll),
    # What makes our graphs lowerable by torch-mlir (lowering/legalize.py, lowering/fold_constants.py).
    Step("clamp_gate_checks", "inner compilers that lower (stablehlo, iree, neuron)", _legalizes,
         lambda b: ClampGateChecks()),
    Step("bound_slice_scatter", "inner compilers that lower", _legalizes, lambda b: BoundSliceScatter()),
    Step("diagonal_as_strided_slice", "inner compilers that lower", _legalizes, lambda b: DiagonalAsStridedSlice()),
    Step("expand_scaled_adds", "inner compilers that lower", _legalizes, lambda b: ExpandScaledAdds()),
    Step("fold_index_constants", "inner compilers that lower", _legalizes, lambda b: FoldIndexConstants()),
    Step("neuron_preflight", "inner neuron, and preflight()", lambda c: c.inner.preflight != "off",
         lambda b: NeuronPreflight.for_graph(b.context)),
    Step("require_clean_preflight", "inner neuron with strict_preflight (default)",
         lambda c: c.inner.preflight == "require",
         lambda b: RequireCleanPreflight(b.built["neuron_preflight"])),
    # After everything that changes the graph: measure what the inner compiler receives, and cut it into
    # partitions if it is over budget.
    Step("fit_to_budget", "always: measures; cuts a graph over max_graph_instructions", _always, _budget),
    # Last, over what the inner compiler receives (the graph, or each partition): lowered once.
    Step("lower_to_stablehlo", "inner stablehlo and iree", lambda c: c.inner.lowers_to_stablehlo,
         lambda b: LowerToStableHLO()),
)

STAGES = {"dynamo": DYNAMO, "aten": ATEN}


def graph_context(config: CompileConfig, name: str, kind: str) -> GraphContext:
    return GraphContext(name, kind, config.target, config.max_graph_instructions)


def build_passes(steps: Sequence[Step], build: Build) -> list[GraphPass]:
    """The passes of `steps` that apply to this graph, in order."""
    passes = []
    for step in steps:
        if step.applies(build):
            graph_pass = build.built[step.name] = step.make(build)
            passes.append(graph_pass)
    return passes


def dynamo_passes(config: CompileConfig, gm: torch.fx.GraphModule, name: str = "dynamo") -> list[GraphPass]:
    """Passes over the torch-level graph Dynamo captured, before AOT Autograd."""
    return build_passes(DYNAMO, Build(config, graph_context(config, name, "dynamo"), gm))


def aten_passes(
    config: CompileConfig, context: GraphContext, gm: torch.fx.GraphModule,
    forward_graphs: Sequence[torch.fx.GraphModule] = (),
) -> list[GraphPass]:
    """Passes over one ATen graph (forward, backward, inference) AOT Autograd produced.

    `forward_graphs`: the forward graphs compiled so far, as AOT Autograd made
    them; a backward graph's saved inputs carry the names of their nodes.
    """
    return build_passes(ATEN, Build(config, context, gm, forward_graphs))


def describe(config: CompileConfig) -> str:
    """The declared pipeline, one line per pass, marked with whether this compile's options run it.

    A step that also depends on the graph (the Muon rewrite: inference
    graphs with a gather) is marked by the options alone.
    """
    lines = [f"passes for target {config.target.name}, inner {config.inner.name} (+ runs, - does not):"]
    for stage, steps in STAGES.items():
        lines.append(f"  {stage} graphs:")
        for number, step in enumerate(steps, 1):
            mark = "+" if step.enabled(config) else "-"
            lines.append(f"    {mark} {number:>2}. {step.name:<26} {step.when}")
    return "\n".join(lines)

