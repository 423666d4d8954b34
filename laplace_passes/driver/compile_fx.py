"""Compiling one Dynamo graph with the passes, and capturing the graphs of a model.

    compile_fx(gm, example_inputs, config)       what the `laplace` backend does with each Dynamo graph
    capture_graphs(model_or_fn, inputs, config)  run once through it, forward and backward: the report

Dynamo graph -> Dynamo-level passes (GLA re-tiling, loop unrolling) -> AOT
Autograd -> ATen-level passes on the forward and backward graphs (see
`laplace_passes.driver.pipeline`) -> the inner compiler. Everything here takes a
`CompileConfig` with the inner compiler already resolved: the names users
write are mapped to compilers in `laplace_passes.driver.backend`, above the
lowering compilers, so `laplace_passes.lowering` can call `capture_graphs`
without depending on what depends on it.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._guards import CompileContext

from laplace_passes.driver.backward_ahead import BackwardAhead
from laplace_passes.driver.config import CompileConfig
from laplace_passes.fla.install import covered_before_install
from laplace_passes.fla.install import install as install_fla_replacements
from laplace_passes.fla.late_import import install_after_import
from laplace_passes.infra import logs
from laplace_passes.infra.graph_breaks import GraphBreaks
from laplace_passes.infra.pass_base import run_passes
from laplace_passes.infra.fx_helpers import dynamic_dims, input_source
from laplace_passes.driver.pipeline import aten_passes, compiles_loop_bodies, dynamo_passes, graph_context
from laplace_passes.infra.report import GraphRecord, Report, remember
from laplace_passes.driver.shapes import (
    PerShapeCompiler,
    loops_declined_at_symbolic_sizes,
    report_dynamic_dims,
    scan_over_dynamic_length,
    sizes_left_to_dynamo,
    static_shapes_reason,
)
from laplace_passes.ops.chunked import CHUNK_LOOP_OPS
from laplace_passes.unroll import compile_graph
from laplace_passes.unroll.body_helper import HELPER


class NothingCapturedError(RuntimeError):
    """`inspect` (and `export`) ran the function, and Dynamo compiled no graph of it to report."""


KINDS = ("forward", "backward", "inference")


def compile_fx(gm: torch.fx.GraphModule, example_inputs: list, config: CompileConfig) -> Callable:
    """Run the passes on a Dynamo graph and compile it: the body of the `laplace` backend.

    A graph with symbolic sizes on a compile that needs static shapes is
    compiled once per concrete shape, at its first call (`laplace_passes.driver.shapes`).
    """
    remember(config.report)
    config.inner.start()
    trace = CompileContext.current_trace_id()
    if trace is not None:  # Dynamo restarting its analysis of a frame: the earlier attempt's graphs go
        config.report.attempt_begins(str(trace.compile_id), trace.attempt)
    if report_dynamic_dims(gm, config):
        reason = static_shapes_reason(config)
        if not reason and (reason := scan_over_dynamic_length(gm)):  # the graph's own reason: say it
            config.report.notes.append(f"a graph with symbolic sizes is compiled once per shape: {reason}")
        if reason:
            return PerShapeCompiler(gm, functools.partial(_compile_graph, config=config), config, reason)
    return _compile_graph(gm, example_inputs, config)


def prepare_to_trace() -> bool:
    """What must be in place before Dynamo traces for the laplace backend; True when it added anything.

    The one place fla's replacements are installed (NOTE [how fla calls are
    replaced] in `laplace_passes.fla.install`): Dynamo substitutes fla's calls
    while it traces, so they must be installed before. It runs when a compile
    starts: when Dynamo looks the backend up by name (torch.compile(...,
    backend="laplace"), `laplace_passes.driver.backend`), in
    `laplace_passes.compile` and in `capture_graphs` (inspect, preflight,
    export); and again as each Dynamo graph is compiled, which covers an fla
    imported after the lookup for the compiles that follow. An fla not yet
    imported gets a one-shot import hook instead (`laplace_passes.fla.late_import`):
    a model importing fla inside `forward` has it covered before Dynamo traces
    its calls. Importing laplace_passes installs nothing.
    """
    added = install_fla_replacements() != covered_before_install()
    install_after_import(lambda: install_fla_replacements(import_fla=True))
    return added


def _compile_graph(gm: torch.fx.GraphModule, example_inputs: list, config: CompileConfig) -> Callable:
    """The passes, AOT Autograd, the ATen passes and the inner compiler, for one Dynamo graph."""
    report = config.report
    if prepare_to_trace():
        report.notes.append(
            "fla was imported after the laplace backend was loaded, so fla calls traced in this "
            "graph are not GLA sites; later compiles recognise them (or call "
            "laplace_passes.fla.install() before compiling)"
        )
    record = report.new_graph("dynamo", gm)
    record.compile_id = _compile_id()
    record.input_sources = [input_source(n) for n in gm.graph.find_nodes(op="placeholder")]
    left_to_dynamo = sizes_left_to_dynamo(gm)
    with logs.progress(f"{record.name}: the passes"):
        gm = run_passes(gm, dynamo_passes(config, gm, record.name), record, report, strict=config.strict)
    declined = loops_declined_at_symbolic_sizes(report, record.name) if left_to_dynamo else []
    if declined:
        return _per_shape_instead(record, len(declined), config)
    ahead = BackwardAhead.for_graph(config, example_inputs)
    if _backward_bodies_ahead(gm, example_inputs, config):
        HELPER.start()  # its imports overlap AOT Autograd (NOTE [bodies compiled in a helper process])
    compilers = {kind: _aten_compiler(config, kind, ahead) for kind in KINDS}
    kwargs: dict[str, Any] = {
        "fw_compiler": compilers["forward"],
        "bw_compiler": compilers["backward"],
        "inference_compiler": compilers["inference"],
    }
    if config.decompositions() is not None:
        kwargs["decompositions"] = config.decompositions()
    if config.inner.partition_fn is not None:
        kwargs["partition_fn"] = ahead.partition_fn if ahead is not None else config.inner.partition_fn
    if config.inner.keep_inference_input_mutations:
        kwargs["keep_inference_input_mutations"] = True
    return aot_autograd(**kwargs)(gm, example_inputs)


def _compile_id() -> str | None:
    """Dynamo's compile id of the frame being compiled ("0/0"), None outside a Dynamo compile."""
    trace = CompileContext.current_trace_id()
    return None if trace is None else str(trace.compile_id)


def _per_shape_instead(record: GraphRecord, declined: int, config: CompileConfig) -> PerShapeCompiler:
    """The Dynamo graph `record` as it came in, compiled once per shape; `declined`: its loops recognition
    declined at symbolic sizes (NOTE [loops declined at symbolic sizes] in `laplace_passes.driver.shapes`)."""
    dims = "; ".join(dynamic_dims(record.before, include_specialised=False))
    reason = (f"recognition reads loops of static sizes and declined {declined} loop(s) of {record.name} "
              f"at the sizes Dynamo made symbolic after a second shape ({dims})")
    config.report.notes.append(f"{record.name} is compiled once per shape: {reason}")
    return PerShapeCompiler(record.before, functools.partial(_compile_graph, config=config), config, reason)


def _backward_bodies_ahead(gm: torch.fx.GraphModule, example_inputs: list, config: CompileConfig) -> bool:
    """The forward graph will send backward bodies to the helper: GLA sites that may share a body, and a backward."""
    sites = len(gm.graph.find_nodes(op="call_function", target=CHUNK_LOOP_OPS[0]))
    differentiates = torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in example_inputs)
    return sites >= 2 and differentiates and compiles_loop_bodies(config)


def _aten_compiler(config: CompileConfig, kind: str, ahead: BackwardAhead | None = None) -> Callable:
    def compile_aten_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        report = config.report
        forward_graphs = [g.before for g in report.graphs if g.kind == "forward"]
        record = report.new_graph(kind, gm)
        record.compile_id = _compile_id()
        # The last pass lowers a graph for the compilers that take StableHLO: the progress line says so.
        lowering = " and the lowering to StableHLO (torch-mlir)" if config.inner.lowers_to_stablehlo else ""
        with logs.progress(f"{record.name}: the passes{lowering}"):
            gm = _with_aten_passes(config, gm, record, report, forward_graphs)
        if ahead is not None and kind == "forward":  # NOTE [backward graphs generated in the helper process]
            ahead.send(gm, functools.partial(_backward_as_sent, config, forward_graphs + [record.before]))
        # A graph the budget pass cut into partitions: each compiled on its own.
        with logs.inner_compile(config.inner.name, record.name), \
                ahead.answering(record.name) if ahead is not None and kind == "backward" else contextlib.nullcontext():
            return compile_graph(config.inner, gm, example_inputs, kind)

    compile_aten_graph.__name__ = f"laplace_{kind}_compiler"
    return compile_aten_graph


def _with_aten_passes(config: CompileConfig, gm: torch.fx.GraphModule, record: GraphRecord, report: Report,
                      forward_graphs: list) -> torch.fx.GraphModule:
    passes = aten_passes(config, graph_context(config, record.name, record.kind), gm, forward_graphs)
    return run_passes(gm, passes, record, report, strict=config.strict)


def _backward_as_sent(config: CompileConfig, forward_graphs: list, gm: torch.fx.GraphModule,
                      example_inputs: list) -> Callable:
    """The backward's compile as `compile_aten_graph` will run it, its record in a report of its own."""
    report = Report(config.report.target, config.report.inner)
    record = report.new_graph("backward", gm)
    record.name = "backward_ahead"  # what the passes' log lines name: not the backward compiled later
    gm = _with_aten_passes(config, gm, record, report, forward_graphs)
    # Its chunk-loop bodies are left to the backward compile (or the helper): here they would delay the forward.
    return compile_graph(config.inner, gm, example_inputs, "backward", bodies_ahead=False)


def capture_graphs(model_or_fn: Callable, example_inputs: tuple, config: CompileConfig) -> Report:
    """Run `model_or_fn(*example_inputs)` once through `compile_fx`; return the report it filled.

    Forward and backward graphs are both captured when an output requires
    grad (the backward is compiled at once, not at the first backward call).
    """
    check_callable(model_or_fn)
    prepare_to_trace()
    backend = functools.partial(compile_fx, config=config)
    compiled = torch.compile(fresh_code(model_or_fn), backend=backend, dynamic=False)
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True), \
            logs.progress(f"capturing the graphs of {_described(model_or_fn, example_inputs)}"):
        try:
            with GraphBreaks() as breaks:
                compiled(*example_inputs)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            # Dynamo's wrapper starts with the backend's repr; the user needs the cause first.
            raise error.inner_exception.with_traceback(error.inner_exception.__traceback__) from None
    config.report.graph_breaks = breaks.reasons(config.report.count("dynamo"))
    if not config.report.graphs:
        # A graph break can make Dynamo skip the whole frame (a data-dependent branch in a loop): say which.
        skipped = f"; it skipped the function at a graph break: {'; '.join(config.report.graph_breaks)}" \
            if config.report.graph_breaks else ""
        raise NothingCapturedError(f"captured no graph: Dynamo ran the function without compiling it{skipped}")
    return config.report


def _described(model_or_fn: Callable, example_inputs: tuple) -> str:
    """`GLALM at inputs [1, 2048]`: what a progress line names."""
    name = type(model_or_fn).__name__ if isinstance(model_or_fn, torch.nn.Module) else getattr(
        model_or_fn, "__name__", type(model_or_fn).__name__)
    shapes = ", ".join(str(list(x.shape)) for x in example_inputs if isinstance(x, torch.Tensor))
    return f"{name} at inputs {shapes}" if shapes else name


def check_callable(model_or_fn: object) -> None:
    """Refused before Dynamo starts, which would fail later with "'int' object is not callable"."""
    if not callable(model_or_fn):
        raise TypeError(f"expected a module or a function to run on the example inputs, "
                        f"got {type(model_or_fn).__name__}")


def fresh_code(model_or_fn: Callable) -> Callable:
    """A new code object per capture, so Dynamo's cache never answers for an earlier one.

    Dynamo keeps its cache (and its recompile limit of 8) on the code object
    of the frame it traces; a new closure alone would share one code object.
    """
    if isinstance(model_or_fn, torch.nn.Module):
        module = model_or_fn

        def run(*args):
            return module(*args)

    else:

        @functools.wraps(model_or_fn)
        def run(*args):
            return model_or_fn(*args)

    fresh = types.FunctionType(run.__code__.replace(), run.__globals__, run.__name__, run.__defaults__, run.__closure__)
    return functools.update_wrapper(fresh, run)
