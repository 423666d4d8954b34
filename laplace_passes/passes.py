"""Pass infrastructure: the shape of a pass and the loop that runs them.

Modelled on `torch.fx.passes.infra`: a pass is `requires / call / ensures` and
returns the graph module and whether it changed it. Ours also returns a
one-line summary and the reasons it declined rewrites, and the runner lints
the graph after every pass, naming the pass when the graph is broken, and
records every run in the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

from laplace_passes.report import GraphRecord, PassRecord, Report, SiteRecord


@dataclass
class PassOutcome:
    graph_module: torch.fx.GraphModule
    modified: bool
    summary: str = ""
    declined: list[str] = field(default_factory=list)
    # Per-site records for the report (e.g. GLA sites and their chunk plans).
    sites: list[SiteRecord] = field(default_factory=list)


class GraphPass:
    """Base class: subclasses set `name` and implement `call`."""

    name = "graph_pass"

    def requires(self, gm: torch.fx.GraphModule) -> None:
        """Check preconditions; raise to refuse the graph."""

    def call(self, gm: torch.fx.GraphModule) -> PassOutcome:
        raise NotImplementedError

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        """Check postconditions; raise when the pass broke its promise."""

    def __call__(self, gm: torch.fx.GraphModule) -> PassOutcome:
        self.requires(gm)
        outcome = self.call(gm)
        self.ensures(outcome.graph_module)
        return outcome


class PassLintError(RuntimeError):
    """A pass left an ill-formed graph."""


def run_passes(
    gm: torch.fx.GraphModule, passes: list[GraphPass], graph: GraphRecord, report: Report
) -> torch.fx.GraphModule:
    """Run `passes` in order over `gm`, linting and recording after each."""
    for graph_pass in passes:
        nodes_before = len(gm.graph.nodes)
        try:
            outcome = graph_pass(gm)
        except Exception as error:  # re-raised: only annotated with where it happened
            error.add_note(f"while running laplace pass {graph_pass.name!r} on graph {graph.name}")
            raise
        gm = outcome.graph_module
        _lint(gm, graph_pass.name, graph.name)
        report.passes.append(
            PassRecord(
                name=graph_pass.name,
                graph=graph.name,
                modified=outcome.modified,
                nodes_before=nodes_before,
                nodes_after=len(gm.graph.nodes),
                summary=outcome.summary,
                declined=list(outcome.declined),
            )
        )
        for site in outcome.sites:
            site.graph = graph.name
            report.sites.append(site)
        graph.snapshot(graph_pass.name, gm)
    return gm


def _lint(gm: torch.fx.GraphModule, pass_name: str, graph_name: str) -> None:
    try:
        gm.graph.lint()
        gm.recompile()
    except RuntimeError as error:
        raise PassLintError(f"laplace pass {pass_name!r} left graph {graph_name} ill-formed: {error}") from error
