"""Pass infrastructure: the shape of a pass and the loop that runs them.

Modelled on `torch.fx.passes.infra`: a pass is `requires / call / ensures`
and returns the graph module and whether it changed it. Ours returns a
`PassOutcome`, which also carries everything the pass has to say: a
one-line summary, the reasons it declined rewrites, and the records the
report keeps of the graph (GLA sites, loops, size, Muon traffic). A pass
never writes into a report itself, so any pass runs on a bare GraphModule:

    outcome = run_pass(UnrollLoops("aten"), gm)      # linted and recompiled
    outcome.graph_module, outcome.loops, outcome.declined

What a pass needs besides the graph (the target, the graph's name for its
messages, the forward graphs of a backward graph) it is given when it is
made: the pipeline (`laplace_passes.driver.pipeline`) builds the passes for each
graph from a `GraphContext`.

A rewrite that cannot be made raises `Declined(reason)` where that is
decided; the pass catches it and lists the reason in `outcome.declined`.

`run_passes` is what the backend runs: every pass in order, each followed by
a lint, and its outcome filed in the report (a `PassRecord`, the graph's
records, a snapshot of the graph). It also logs each pass through torch's
logging (`laplace_passes.infra.logs`: TORCH_LOGS="laplace", TORCH_TRACE).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

from laplace_passes.infra import logs
from laplace_passes.infra.report import (
    GraphRecord,
    LoopRecord,
    PassRecord,
    Report,
    SiteRecord,
    SizeRecord,
    TrafficRecord,
)
from laplace_passes.infra.targets import HardwareTarget


@dataclass(frozen=True)
class GraphContext:
    """What the passes over one graph know besides the graph itself."""

    name: str  # the report's name for the graph: "forward_0", "inference_1", ...
    kind: str  # "dynamo", "forward", "backward" or "inference"
    target: HardwareTarget
    max_graph_instructions: int | None = None  # the compile's budget per graph (None: no limit)


@dataclass
class PassOutcome:
    """What one pass did to one graph, and what the report should keep of it."""

    graph_module: torch.fx.GraphModule
    modified: bool
    summary: str = ""
    declined: list[str] = field(default_factory=list)
    # The report's records of this graph (the runner files them; GraphRecord says what each is).
    sites: list[SiteRecord] = field(default_factory=list)
    loops: list[LoopRecord] = field(default_factory=list)
    size: SizeRecord | None = None
    traffic: TrafficRecord | None = None


class Declined(Exception):
    """A rewrite that is not made, and why.

    Raised where that is decided (a trip count that is not static, a
    pattern that does not match, a graph no cut can fit); the pass catches
    it and reports `reason` in its outcome, where users read it.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GraphPass:
    """Base class: subclasses set `name` and implement `call`."""

    name = "graph_pass"

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """Check preconditions; raise to refuse the graph."""

    def call(self, gm: torch.fx.GraphModule) -> PassOutcome:
        raise NotImplementedError

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Check postconditions on the resulting graph; raise when the pass broke its promise."""

    def __call__(self, gm: torch.fx.GraphModule) -> PassOutcome:
        self.requires(gm)
        outcome = self.call(gm)
        self.ensures(outcome.graph_module)
        return outcome


class PassLintError(RuntimeError):
    """A pass left an ill-formed graph."""


def run_pass(graph_pass: GraphPass, gm: torch.fx.GraphModule, graph_name: str = "") -> PassOutcome:
    """Run one pass on one graph, then lint and recompile what it returns."""
    where = f" on graph {graph_name}" if graph_name else ""
    try:
        outcome = graph_pass(gm)
    except Exception as error:  # re-raised: only annotated with where it happened
        error.add_note(f"while running laplace pass {graph_pass.name!r}{where}")
        raise
    try:
        outcome.graph_module.graph.lint()
        outcome.graph_module.recompile()
    except RuntimeError as error:
        raise PassLintError(f"laplace pass {graph_pass.name!r} left graph {graph_name or '(unnamed)'} "
                            f"ill-formed: {error}") from error
    return outcome


def run_passes(
    gm: torch.fx.GraphModule, passes: list[GraphPass], graph: GraphRecord, report: Report
) -> torch.fx.GraphModule:
    """Run `passes` in order over `gm`, linting, filing and logging the outcome after each."""
    for graph_pass in passes:
        nodes_before = len(gm.graph.nodes)
        logs.graph_before(graph_pass.name, graph.name, gm)
        outcome = run_pass(graph_pass, gm, graph.name)
        gm = outcome.graph_module
        record = _file(outcome, graph_pass.name, graph, report, nodes_before)
        graph.snapshot(graph_pass.name, gm, modified=outcome.modified)
        logs.pass_done(record, gm)
    return gm


def _file(outcome: PassOutcome, pass_name: str, graph: GraphRecord, report: Report, nodes_before: int) -> PassRecord:
    """Put what the outcome says where the report keeps it."""
    record = PassRecord(
        name=pass_name,
        graph=graph.name,
        modified=outcome.modified,
        nodes_before=nodes_before,
        nodes_after=len(outcome.graph_module.graph.nodes),
        summary=outcome.summary,
        declined=list(outcome.declined),
    )
    report.passes.append(record)
    for site in outcome.sites:
        site.graph = graph.name
        report.sites.append(site)
    graph.loops.extend(outcome.loops)
    if outcome.size is not None:
        graph.size = outcome.size
    if outcome.traffic is not None:
        outcome.traffic.graph = graph.name
        graph.traffic = outcome.traffic
    return record
