"""The passes' logs, through torch's logging (docs/DESIGN.md section 9).

    TORCH_LOGS="laplace"     each pass's one-line summary per graph, and what it declined
    TORCH_LOGS="+laplace"    also each graph before and after each pass
    TORCH_TRACE=DIR          each pass's graph before and after as a structured trace
                             artifact: `tlparse DIR` shows them beside Dynamo's and AOT's

torch reads TORCH_LOGS when it is imported, before this package, and takes
a registered name or an importable module there. This distribution ships a
module named `laplace` (laplace.py, empty) for that: torch then configures
the "laplace" logger (level, handler, format), and the logger here is its
child. From Python, `torch._logging.set_logs(modules={"laplace": logging.INFO})`
does the same.
"""

from __future__ import annotations

import logging

import torch.fx
from torch._logging import trace_structured

from laplace_passes.infra.report import PassRecord

# The "laplace" logger is the one TORCH_LOGS="laplace" configures (see above).
log = logging.getLogger("laplace.passes")


def graph_before(pass_name: str, graph_name: str, gm: torch.fx.GraphModule) -> None:
    """The graph a pass is about to run on: at DEBUG, and as a trace artifact."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s: graph %s before\n%s", pass_name, graph_name, _readable(gm))
    _trace(f"laplace_{graph_name}_{pass_name}_before", gm)


def pass_done(record: PassRecord, gm: torch.fx.GraphModule) -> None:
    """What a pass did (INFO), the reasons it declined, and the graph after it (DEBUG, trace)."""
    result = "applied" if record.modified else "no change"
    log.info("%s on %s: %s, %d -> %d nodes: %s", record.name, record.graph, result,
             record.nodes_before, record.nodes_after, record.summary)
    for reason in record.declined:
        log.info("%s on %s declined: %s", record.name, record.graph, reason)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s: graph %s after\n%s", record.name, record.graph, _readable(gm))
    _trace(f"laplace_{record.graph}_{record.name}_after", gm)


def _readable(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False)


def _trace(name: str, gm: torch.fx.GraphModule) -> None:
    # The payload is built only when a trace is being written (TORCH_TRACE).
    trace_structured("graph_dump", metadata_fn=lambda: {"name": name}, payload_fn=lambda: _readable(gm))
