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

NOTE [a failing pass declines]: a pass that raises, or leaves a graph the
lint rejects, must not end the user's compile. `run_passes` puts back the
graph as it was before that pass (the last snapshot), files the pass as
declined with the exception, where it was raised and the node it was
working on, and goes on with the next pass. Two exceptions: passes whose
failure is the answer the user asked for (`stops_compile_on_error`: the
lowering the user chose, the preflight the user made a requirement), and
strict mode (the `strict` option, LAPLACE_PASSES_STRICT=1: the test suite),
where the exception is raised so that such failures are found. A pass that
would specialise a dynamic graph's sizes fails this way too
(`laplace_passes.infra.guards`, NOTE [passes add no guards]).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

import torch.fx
from torch.fx.passes.infra import pass_base as torch_pass_base

from laplace_passes.infra import guards, logs
from laplace_passes.infra.op_facts import op_name
from laplace_passes.infra.report import (
    GraphRecord,
    copy_graphs,
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
    # NOTE [a failing pass declines]: True for a pass whose exception is the user's answer (a lowering the
    # user asked for failed, a required preflight found problems): raised, never declined.
    stops_compile_on_error = False

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
        with guards.refusing_new_guards(guards.shape_env_of(gm)):  # NOTE [passes add no guards]
            result = graph_pass(gm)
    except Exception as error:  # re-raised: only annotated with where it happened
        error.add_note(f"while running laplace pass {graph_pass.name!r}{where}")
        raise
    try:
        for module in result.graph_module.modules():  # the graph and its bodies (loops, checkpointed regions)
            if isinstance(module, torch.fx.GraphModule):
                module.graph.lint()
                module.recompile()
    except RuntimeError as error:
        raise PassLintError(f"laplace pass {graph_pass.name!r} left graph {graph_name or '(unnamed)'} "
                            f"ill-formed: {error}") from error
    return result


def run_passes(
    gm: torch.fx.GraphModule, passes: list[GraphPass], graph: GraphRecord, report: Report, strict: bool = False
) -> torch.fx.GraphModule:
    """Run `passes` in order over `gm`, linting, filing and logging the result after each.

    A pass that fails declines and the graph goes on as it was (NOTE [a failing pass declines]);
    `strict`: its exception is raised instead.
    """
    for graph_pass in passes:
        nodes_before = len(gm.graph.nodes)
        logs.graph_before(graph_pass.name, graph.name, gm)
        try:
            result = run_pass(graph_pass, gm, graph.name)
        except Exception as error:
            if strict or graph_pass.stops_compile_on_error or not graph.snapshots:
                raise
            result = _declined_for_failure(graph_pass, graph, error)
            logs.log.warning("laplace pass %r failed on graph %s: %s", graph_pass.name, graph.name, result.declined[0])
        gm = result.graph_module
        record = _file(result, graph_pass.name, graph, report, nodes_before)
        graph.snapshot(graph_pass.name, gm, modified=result.modified)
        logs.pass_done(record, gm)
    return gm


def _declined_for_failure(graph_pass: GraphPass, graph: GraphRecord, error: Exception) -> PassResult:
    """The pass's result when it raised: the graph before it (a copy: the pass may have half-changed
    the one it was given), and the failure as the reason it declined."""
    reason = failure_reason(error)
    return PassResult(copy_graphs(graph.after), False, summary=f"failed and skipped: {type(error).__name__}",
                      declined=[reason])


_PACKAGE_DIRECTORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GUARDS_FILE = os.path.abspath(guards.__file__)


def failure_reason(error: BaseException) -> str:
    """One line: the exception, where in laplace_passes it was raised, the node being worked on, the way out."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else "(no message)"
    if isinstance(error, PassLintError) and error.__cause__ is not None:
        message = f"left an ill-formed graph ({str(error.__cause__).strip().splitlines()[0]})"
    parts = [f"{type(error).__name__}: {message[:300]}"]
    frame, node = _innermost_own_frame(error.__traceback__)
    if frame is not None:
        parts.append(f"at {os.path.relpath(frame.f_code.co_filename, os.path.dirname(_PACKAGE_DIRECTORY))}"
                     f":{frame.f_lineno} ({frame.f_code.co_name})")
    if node is not None:  # the node may have been erased by then: its name and op, not its arguments
        parts.append(f"on node {node.name} ({node.op} {op_name(node)})")
    return (" ".join(parts) + "; the pass was skipped for this graph, which goes on as it was before it "
            "(strict=True or LAPLACE_PASSES_STRICT=1 raises instead)")


def _innermost_own_frame(tb) -> tuple:
    """The innermost traceback frame in this package, and the graph node our frames were working on:
    the innermost local named `node` (the loops over a graph's nodes name it so), else any Node."""
    own_frame, named, other = None, None, None
    for frame, _ in traceback.walk_tb(tb):
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_PACKAGE_DIRECTORY + os.sep) or path == _GUARDS_FILE:  # where the question was asked
            continue
        own_frame = frame
        local_values = frame.f_locals
        if isinstance(local_values.get("node"), torch.fx.Node):
            named = local_values["node"]
        other = next((value for value in local_values.values() if isinstance(value, torch.fx.Node)), other)
    return own_frame, named if named is not None else other


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
