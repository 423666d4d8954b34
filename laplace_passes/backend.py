"""The `laplace` torch.compile backend.

    torch.compile(model, backend="laplace", options={"target": "trn2", "inner": "eager"})

Dynamo graph -> Dynamo-level passes (GLA re-tiling) -> AOT Autograd ->
ATen-level passes on the forward and backward graphs -> the inner compiler.
Registered through the `torch_dynamo_backends` entry point in setup.cfg.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx
from torch._dynamo.backends.common import aot_autograd

from laplace_passes.config import CompileConfig
from laplace_passes.fx import fla_sites
from laplace_passes.passes import run_passes
from laplace_passes.pipeline import aten_passes, dynamo_passes, graph_context
from laplace_passes.report import remember
from laplace_passes.unroll import compile_graph

# Looking the backend up (torch.compile(backend="laplace")) imports this
# module before Dynamo traces anything: the moment fla calls must become
# recognisable nodes. Only an fla the user already imported is covered.
fla_sites.install()


def laplace_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict[str, Any] | None = None):
    config = CompileConfig.from_options(options)
    report = config.report
    remember(report)
    if fla_sites.install() != fla_sites.covered_before_install():
        report.notes.append(
            "fla was imported after the laplace backend was loaded, so fla calls traced in this "
            "graph are not GLA sites; later compiles recognise them (or call "
            "laplace_passes.fx.enable_fla_sites() before compiling)"
        )
    record = report.new_graph("dynamo", gm)
    gm = run_passes(gm, dynamo_passes(config), record, report)
    compilers = {kind: _aten_compiler(config, kind) for kind in ("forward", "backward", "inference")}
    kwargs = {
        "fw_compiler": compilers["forward"],
        "bw_compiler": compilers["backward"],
        "inference_compiler": compilers["inference"],
    }
    if config.decompositions() is not None:
        kwargs["decompositions"] = config.decompositions()
    if config.inner.partition_fn is not None:
        kwargs["partition_fn"] = config.inner.partition_fn
    return aot_autograd(**kwargs)(gm, example_inputs)


def _aten_compiler(config: CompileConfig, kind: str) -> Callable:
    def compile_aten_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        report = config.report
        forward_graphs = [g.before for g in report.graphs if g.kind == "forward"]
        record = report.new_graph(kind, gm)
        passes = aten_passes(config, graph_context(config, record.name, kind), gm, forward_graphs)
        gm = run_passes(gm, passes, record, report)
        # A graph the budget pass cut into partitions: each compiled on its own.
        return compile_graph(config.inner, gm, example_inputs, kind)

    compile_aten_graph.__name__ = f"laplace_{kind}_compiler"
    return compile_aten_graph
