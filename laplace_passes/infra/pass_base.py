"""Pass infrastructure: the shape of a pass and the loop that runs them.

Every pass is a torch pass: a `GraphPass` is a
`torch.fx.passes.infra.pass_base.PassBase` (`requires / call / ensures`), and
its `call` returns a `PassResult`, torch's `(graph_module, modified)` with
what the pass has to say besides: a one-line summary, the reasons it declined
rewrites, and the records the report keeps of the graph (GLA sites, loops,
size, Muon traffic and ownership plans, preflight findings). A pass never
writes into a report itself, so any pass runs on a bare GraphModule, alone:

    result = run_pass(UnrollLoops("aten"), gm)      # linted and recompiled
    result.graph_module, result.loops, result.declined

in torch's own pass manager:

    PassManager([RecogniseGLA(), UnrollLoops("dynamo")])(gm)

or, for passes over ATen graphs that rewrite in place, inside a user's own
Inductor compile (`laplace_passes.infra.inductor_passes`).

What a pass needs besides the graph (the target, the graph's name for its
messages, the forward graphs of a backward graph) it is given when it is
made: the declared pipeline (`laplace_passes.driver.pipeline`) builds the
passes for each graph from a `GraphContext`.

A rewrite that cannot be made raises `Declined(reason)` where that is
decided; the pass catches it and lists the reason in `result.declined`.

`run_passes` is what the backend runs: every pass in order, each followed by
a lint, and its result filed in the report (a `PassRecord`, the graph's
records, a snapshot of the graph). It also logs each pass through torch's
logging (`laplace_passes.infra.logs`: TORCH_LOGS="laplace", TORCH_TRACE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx
from torch.fx.passes.infra import pass_base as torch_pass_base

from laplace_passes.infra import logs
from laplace_passes.infra.report import (
    GraphRecord,
    LoopRecord,
    PassRecord,
    RecurrenceRecord,
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


class PassResult(torch_pass_base.PassResult):
    """torch's `PassResult(graph_module, modified)`, and what the report should keep of the pass.

    A namedtuple to torch's pass manager; the records are attributes:
    `summary` (one line), `declined` (a reason per rewrite not made), and the
    graph's records the runner files (`GraphRecord` says what each is):
    `sites`, `recurrences`, `loops`, `size`, `traffic`; `plans` (Muon ownership plans) and
    `findings` (preflight findings) for the callers that read them.
    """

    def __new__(cls, graph_module: torch.fx.GraphModule, modified: bool, *, summary: str = "",
                declined: list[str] | None = None, sites: list[SiteRecord] | None = None,
                loops: list[LoopRecord] | None = None, size: SizeRecord | None = None,
                traffic: TrafficRecord | None = None, plans: list | None = None,
                findings: list | None = None, recurrences: list[RecurrenceRecord] | None = None) -> PassResult:
        self = super().__new__(cls, graph_module, modified)
        self.summary = summary
        self.declined = list(declined or [])
        self.sites = list(sites or [])
        self.loops = list(loops or [])
        self.size = size
        self.traffic = traffic
        self.plans = list(plans or [])
        self.findings = list(findings or [])
        self.recurrences = list(recurrences or [])
        return self


class Declined(Exception):
    """A rewrite that is not made, and why.

    Raised where that is decided (a trip count that is not static, a
    pattern that does not match, a graph no cut can fit); the pass catches
    it and reports `reason` in its result, where users read it.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GraphPass(torch_pass_base.PassBase):
    """Base class of the project's passes: subclasses set `name` and implement `call`.

    Unlike `PassBase.__call__`, `ensures` checks the graph the pass returns
    (a pass may return a new module: the budget pass's partitioned driver).
    """

    name = "graph_pass"

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        raise NotImplementedError

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        self.requires(gm)
        result = self.call(gm)
        self.ensures(result.graph_module)
        return result


class PassLintError(RuntimeError):
    """A pass left an ill-formed graph."""


def run_pass(graph_pass: GraphPass, gm: torch.fx.GraphModule, graph_name: str = "") -> PassResult:
    """Run one pass on one graph, then lint and recompile what it returns."""
    where = f" on graph {graph_name}" if graph_name else ""
    try:
        result = graph_pass(gm)
    except Exception as error:  # re-raised: only annotated with where it happened
        error.add_note(f"while running laplace pass {graph_pass.name!r}{where}")
        raise
    try:
        result.graph_module.graph.lint()
        result.graph_module.recompile()
    except RuntimeError as error:
        raise PassLintError(f"laplace pass {graph_pass.name!r} left graph {graph_name or '(unnamed)'} "
                            f"ill-formed: {error}") from error
    return result


def run_passes(
    gm: torch.fx.GraphModule, passes: list[GraphPass], graph: GraphRecord, report: Report
) -> torch.fx.GraphModule:
    """Run `passes` in order over `gm`, linting, filing and logging the result after each."""
    for graph_pass in passes:
        nodes_before = len(gm.graph.nodes)
        logs.graph_before(graph_pass.name, graph.name, gm)
        result = run_pass(graph_pass, gm, graph.name)
        gm = result.graph_module
        record = _file(result, graph_pass.name, graph, report, nodes_before)
        graph.snapshot(graph_pass.name, gm, modified=result.modified)
        logs.pass_done(record, gm)
    return gm


def _file(result: PassResult, pass_name: str, graph: GraphRecord, report: Report, nodes_before: int) -> PassRecord:
    """Put what the result says where the report keeps it."""
    record = PassRecord(
        name=pass_name,
        graph=graph.name,
        modified=result.modified,
        nodes_before=nodes_before,
        nodes_after=len(result.graph_module.graph.nodes),
        summary=result.summary,
        declined=list(result.declined),
        findings=list(result.findings),
    )
    report.passes.append(record)
    for site in result.sites:
        site.graph = graph.name
        report.sites.append(site)
    for recurrence in result.recurrences:
        recurrence.graph = graph.name
        report.recurrences.append(recurrence)
    graph.loops.extend(result.loops)
    if result.size is not None:
        graph.size = result.size
    if result.traffic is not None:
        result.traffic.graph = graph.name
        graph.traffic = result.traffic
    return record
