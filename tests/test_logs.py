"""torch's logging shows the passes: TORCH_LOGS="laplace" / "+laplace", and TORCH_TRACE for tlparse.

Each test runs a fresh interpreter: torch reads the environment when it is
imported. The script inspects one GLA call (an inference graph: re-tiled,
then unrolled).
"""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import laplace_passes
from laplace_passes.infra import logs

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import torch
import laplace_passes

def attention(q, k, v, gk):
    return laplace_passes.gla(q, k, v, gk)[0]

q, k, v, gk = (torch.randn(1, 100, 2, 8) for _ in range(4))  # T > 64: chunked, not the recurrent form
laplace_passes.inspect(attention, q, k, v, -gk.abs(), target="cpu")
"""


def run_script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "inspect_one_site.py"
    script.write_text(SCRIPT)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": path, **env},
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_torch_logs_laplace_prints_each_pass_summary(tmp_path):
    err = run_script(tmp_path, TORCH_LOGS="laplace").stderr
    # One line per pass and graph, in the order they ran, with the report's summary.
    runs = re.findall(r"\] (\w+) on (\w+): (applied|no change), \d+ -> \d+ nodes: (.*)", err)
    assert [(name, graph) for name, graph, _, _ in runs] == [
        ("unroll_loops", "dynamo_0"), ("recognise_gla", "dynamo_0"), ("retile_gla", "dynamo_0"),
        ("fla_calls", "dynamo_0"), ("unroll_loops", "inference_0"), ("fit_to_budget", "inference_0"),
    ]
    assert runs[2][2:] == ("applied", "1 of 1 GLA sites re-tiled at chunk 64")
    assert runs[4][3] == "unrolled 1 loop (1 x laplace.chunked_gla, 2 trips)"
    assert "class GraphModule" not in err  # graphs only at +laplace


def test_plus_laplace_prints_graphs_and_torch_trace_keeps_them(tmp_path):
    trace = tmp_path / "trace"
    err = run_script(tmp_path, TORCH_LOGS="+laplace", TORCH_TRACE=str(trace)).stderr
    before = err.index("retile_gla: graph dynamo_0 before")
    after = err.index("retile_gla: graph dynamo_0 after")
    assert "torch.ops.laplace.gla.default(" in err[before:after]
    assert "torch.ops.laplace.chunked_gla.default(" in err[after:err.index("fla_calls: graph dynamo_0 before")]
    assert "retile_gla on dynamo_0: applied" in err  # the summaries too
    logged = "".join(path.read_text() for path in trace.iterdir())
    names = re.findall(r'"graph_dump": \{"name": "(laplace_[\w]+)"\}', logged)
    assert names == [f"laplace_{graph}_{name}_{stage}"
                     for graph, name in (("dynamo_0", "unroll_loops"), ("dynamo_0", "recognise_gla"),
                                         ("dynamo_0", "retile_gla"), ("dynamo_0", "fla_calls"),
                                         ("inference_0", "unroll_loops"), ("inference_0", "fit_to_budget"))
                     for stage in ("before", "after")]
    # The payload follows its header: the graph after re-tiling holds the chunk-loop op.
    header = logged.index('"laplace_dynamo_0_retile_gla_after"')
    assert "torch.ops.laplace.chunked_gla.default(" in logged[header:logged.index('"laplace_dynamo_0_fla_calls_before"')]


class Records(logging.Handler):
    """The records of one logger, kept in order (caplog needs pytest's logging plugin)."""

    def __init__(self, name: str):
        super().__init__(logging.DEBUG)
        self.logger, self.records = logging.getLogger(name), []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        self.saved_level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self.records

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.saved_level)


def attention(q, k, v, gk):
    return laplace_passes.gla(q, k, v, gk)[0]


def gla_inputs(grad: bool):
    q, k, v, gk = (torch.randn(1, 100, 2, 8, requires_grad=grad) for _ in range(4))
    return q, k, v, -gk.abs()


def test_the_python_api_logs_its_progress_under_laplace(monkeypatch):
    """inspect, as the CLI and TORCH_LOGS=laplace show it: the capture, then each graph's passes, timed."""
    with Records("laplace.progress") as records:
        laplace_passes.inspect(attention, *gla_inputs(grad=True), target="cpu")
    messages = [r.getMessage() for r in records]
    assert all(r.levelno == logging.INFO for r in records) and logging.getLogger("laplace") in _parents(records[0])
    assert messages[0] == "capturing the graphs of attention at inputs " + ", ".join(["[1, 100, 2, 8]"] * 4) + " ..."
    assert [m for m in messages if m.endswith(" ...")][1:] == [f"{g}: the passes ..." for g in
                                                              ("dynamo_0", "forward_0", "backward_0")]
    assert re.fullmatch(r"capturing the graphs of attention .*: done in \d+\.\d s", messages[-1])


def _parents(record):
    logger = logging.getLogger(record.name)
    while logger is not None:
        yield logger
        logger = logger.parent


def test_the_first_slow_compile_says_once_what_took_the_time(monkeypatch):
    """Over SLOW_COMPILE_S (here 0 s: every compile is slow), one WARNING for the process, not one per graph."""
    monkeypatch.setattr(logs, "SLOW_COMPILE_S", 0.0)
    monkeypatch.setattr(logs, "_slow_compile_hinted", False)
    with Records("laplace.progress") as records:
        compiled = laplace_passes.compile(attention, target="cpu")
        compiled(*gla_inputs(grad=True))[0].sum().backward()  # forward and backward graphs: two compiles
        laplace_passes.inspect(attention, *gla_inputs(grad=False), target="cpu")
    hints = [r for r in records if r.levelno == logging.WARNING]
    assert len(hints) == 1, [r.getMessage() for r in records]
    assert re.fullmatch(r"first compile took \d+ s \(eager on forward_0\); later calls with the same shapes reuse "
                        r"it; set TORCH_LOGS=laplace for progress", hints[0].getMessage())


def test_no_graph_is_printed_for_a_trace_torch_s_handler_has_no_folder_for(monkeypatch, tmp_path):
    """torch's trace handler is installed without TORCH_TRACE too (folderless until its first write), and pytest
    attaches its log capture to torch's trace logger: the passes print no graph for either. A handler with a
    folder, or one of the user's own, gets each graph before and after each pass."""
    from _pytest.logging import LogCaptureHandler
    from torch._logging._internal import LazyTraceHandler, trace_log

    printed = []
    monkeypatch.setattr(logs, "_readable", lambda gm: printed.append(gm) or "")

    def attention(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    q, k, v, gk = (torch.randn(1, 100, 2, 8) for _ in range(4))
    folderless, with_folder = LazyTraceHandler(None), LazyTraceHandler(str(tmp_path))
    users_own = logging.StreamHandler(io.StringIO())
    cases = (([folderless], False), ([folderless, LogCaptureHandler()], False), ([with_folder], True),
             ([LogCaptureHandler(), users_own], True))
    for handlers, expect_prints in cases:
        monkeypatch.setattr(trace_log, "handlers", handlers)
        assert logs.writing_a_trace() is expect_prints, handlers
        printed.clear()
        laplace_passes.inspect(attention, q, k, v, -gk.abs(), target="cpu")
        assert bool(printed) is expect_prints, (handlers, len(printed))
    with_folder.close()


def test_a_compile_in_a_test_prints_no_graph_for_pytest_s_log_capture(monkeypatch):
    """As this suite runs (pytest's logging plugin on): the trace logger holds only pytest's capture and torch's
    folderless handler, and no pass writes a graph to the trace."""
    from torch._logging._internal import LazyTraceHandler, trace_log

    handlers = list(trace_log.handlers)
    if not any(type(h).__module__ == "_pytest.logging" for h in handlers):
        pytest.skip("pytest's logging plugin is off (-p no:logging)")
    # Read here, not through logs._writes_a_trace: a wrong verdict of the code under test must fail, not skip.
    if any(not isinstance(h, LazyTraceHandler) and type(h).__module__ != "_pytest.logging" or
           isinstance(h, LazyTraceHandler) and h.root_dir is not None for h in handlers):
        pytest.skip("a trace was asked for (TORCH_TRACE, TORCH_COMPILE_DEBUG or a handler of one's own)")
    traced = []
    monkeypatch.setattr(logs, "trace_structured", lambda *args, **kwargs: traced.append(kwargs))
    assert not logs.writing_a_trace(), [type(h).__name__ for h in handlers]
    q, k, v, gk = (torch.randn(1, 100, 2, 8) for _ in range(4))
    laplace_passes.inspect(lambda q, k, v, gk: laplace_passes.gla(q, k, v, gk)[0], q, k, v, -gk.abs(), target="cpu")
    assert traced == [], [type(h).__name__ for h in handlers]
