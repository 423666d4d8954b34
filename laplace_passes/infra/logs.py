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

Progress, on the "laplace.progress" logger: a line at INFO before each wait
(capturing a model's graphs, the passes on each graph, the inner compiler on
each graph) and its time after; the first compile that takes more than
`SLOW_COMPILE_S` logs, once per process at WARNING (shown with no logging
configured), what took the time and how to see the progress. The CLI prints
these lines on stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Iterator

import torch.fx
from torch._logging import trace_structured
from torch._logging._internal import LazyTraceHandler, trace_log

from laplace_passes.infra.report import PassRecord

# The "laplace" logger is the one TORCH_LOGS="laplace" configures (see above).
log = logging.getLogger("laplace.passes")
progress_log = logging.getLogger("laplace.progress")

SLOW_COMPILE_S = 10.0
_slow_compile_hinted = False


@contextlib.contextmanager
def progress(what: str) -> Iterator[None]:
    """`what ...` at INFO before the work, `what: done in N s` after."""
    progress_log.info("%s ...", what)
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    # The exact seconds ride on the record for a handler that adds them up (benchmarks/bench_compile.py).
    progress_log.info("%s: done in %.1f s", what, seconds, extra={"laplace_what": what, "laplace_seconds": seconds})


@contextlib.contextmanager
def inner_compile(inner: str, graph: str) -> Iterator[None]:
    """Progress around the inner compiler on one graph, and the hint at the first slow compile."""
    start = time.perf_counter()
    # eager and stablehlo run the graph as it is (stablehlo's lowering was the passes' last step): no line.
    with progress(_compiling(inner, graph)) if inner not in ("eager", "stablehlo") else contextlib.nullcontext():
        yield
    seconds = time.perf_counter() - start
    if seconds > SLOW_COMPILE_S:
        _hint_once(inner, graph, seconds)


def _compiling(inner: str, graph: str) -> str:
    if inner == "iree":
        return f"compiling {graph}'s StableHLO with IREE"
    return f"compiling {graph} with {inner}"


def _hint_once(inner: str, graph: str, seconds: float) -> None:
    global _slow_compile_hinted
    if _slow_compile_hinted:
        return
    _slow_compile_hinted = True
    progress_log.warning("first compile took %.0f s (%s on %s); later calls with the same shapes reuse it; "
                         "set TORCH_LOGS=laplace for progress", seconds, inner, graph)


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
    if writing_a_trace():  # printing a graph of thousands of nodes takes a tenth of a second, twice per pass
        trace_structured("graph_dump", metadata_fn=lambda: {"name": name}, payload_fn=lambda: _readable(gm))


def writing_a_trace() -> bool:
    """Whether torch's structured trace has somewhere to write (TORCH_TRACE=DIR, or a handler of the user's).

    torch installs its trace handler whatever the environment, and `trace_structured` builds the payload
    whenever a handler is installed; the handler finds out only when it first writes that it has no folder
    (no TORCH_TRACE) and removes itself. Until then each pass printed its graph twice for nothing.

    Recent pytest (9.2 here) attaches its log-capturing handlers to every logger that does not propagate,
    torch's trace logger included, for every test: they are not a trace anyone asked for, and counting them
    made every pass print its graphs twice in any compile a test runs (4% of the CPU time of this package's
    own test suite, profiled). A test that wants the trace (through caplog too) sets TORCH_TRACE (or
    TORCH_COMPILE_DEBUG=1, which gives torch's handler a folder) or adds a handler of its own.
    """
    return any(_writes_a_trace(handler) for handler in trace_log.handlers)


def _writes_a_trace(handler: logging.Handler) -> bool:
    if isinstance(handler, LazyTraceHandler):
        return handler.root_dir is not None or handler.stream is not None or _trace_folder_found_later()
    return type(handler).__module__ != "_pytest.logging"  # pytest's capture, on every logger (see above)


def _trace_folder_found_later() -> bool:
    """torch's handler without TORCH_TRACE still writes into /logs in Meta's builds and jobs (its emit())."""
    return not hasattr(torch.version, "git_version") or os.environ.get("MAST_HPC_JOB_NAME") is not None
