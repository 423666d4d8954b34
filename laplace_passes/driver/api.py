"""The user-facing entry points: `compile` and `inspect`."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from laplace_passes.driver.backend import compile_config, laplace_backend
from laplace_passes.driver.buckets import check_buckets, with_seq_buckets
from laplace_passes.driver.compile_fx import NothingCapturedError, capture_graphs, prepare_to_trace
from laplace_passes.fla import FlaCallNotReplaced
from laplace_passes.fla.not_replaced import triton_error_call
from laplace_passes.infra.report import Report


def compile(
    model_or_fn: Callable | None = None,
    *,
    target: Any = "trn2",
    inner: Any = "eager",
    fullgraph: bool = False,
    dynamic: bool = False,
    seq_buckets: Sequence[int] | None = None,
    **options: Any,
):
    """Compile a module or function with the laplace passes.

    Decorator or function form::

        @laplace_passes.compile(target="trn2")
        def step(...): ...

        model = laplace_passes.compile(model, target="cpu", inner="inductor")

    Same semantics as ``torch.compile(obj, backend="laplace", options=...)``;
    shapes are static by default (``dynamic=False``) because the chunk plan and
    the Neuron compiler both need them. The result carries the compile's
    report as ``.laplace_report``.

    ``seq_buckets=[128, 256, 512]``: for causal models only (outputs at a
    position must not depend on later positions). Token inputs are padded
    along dimension 1 up to the next bucket and outputs sliced back, so any
    length up to the largest bucket compiles at most once per bucket
    (`laplace_passes.driver.buckets`: what is padded, with what, and what is not
    sliced). A module comes back wrapped in a module holding the compiled one.
    """
    if not isinstance(fullgraph, bool):
        raise TypeError(f"fullgraph must be a bool, got {type(fullgraph).__name__}")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(f"dynamic must be a bool or None, got {type(dynamic).__name__}")
    report = options.pop("report", None)
    report = Report() if report is None else report
    full_options = {"target": target, "inner": inner, "report": report, **options}
    compile_config(full_options)  # fail now, not at the first call
    if seq_buckets is not None:
        check_buckets(seq_buckets)

    def wrap(obj: Callable):
        if not callable(obj):
            raise TypeError(f"laplace_passes.compile expects a module or a function, got {type(obj).__name__}")
        prepare_to_trace()
        compiled = torch.compile(obj, backend=laplace_backend, options=full_options,
                                 fullgraph=fullgraph, dynamic=dynamic)
        if seq_buckets is not None:
            compiled = with_seq_buckets(compiled, seq_buckets)
        compiled.laplace_report = report
        return compiled

    return wrap if model_or_fn is None else wrap(model_or_fn)


def inspect(model_or_fn: Callable, *example_inputs: Any, target: Any = "trn2", **options: Any) -> Report:
    """Run the passes on the graphs of `model_or_fn(*example_inputs)` and report.

    The function runs once on the examples (with the eager inner compiler, so
    meta-device models allocate nothing); forward and backward graphs are
    both captured when an output requires grad. Nothing else is changed:
    parameter ``.grad`` fields are left as they were. ``report=`` names a
    `Report` to fill (and return); by default a new one.
    """
    options = {"inner": "eager", **options, "target": target}
    # Validated before anything is traced: a clear error, not one wrapped by Dynamo.
    config = compile_config(options)
    try:
        return capture_graphs(model_or_fn, example_inputs, config)
    except (FlaCallNotReplaced, RuntimeError) as error:  # what was captured is reported: show it
        _note_unreplaced_fla_call(config.report, error)
    if not config.report.graphs:
        raise NothingCapturedError("inspect captured no graph before an fla call without a replacement stopped it")
    return config.report


def _note_unreplaced_fla_call(report: Report, error: Exception) -> None:
    """An fla call without a replacement stopped the run: note it; any other error propagates."""
    if isinstance(error, FlaCallNotReplaced):
        report.notes.append(f"running the compiled graphs stopped at an fla call without a replacement: {error}")
        return
    call = triton_error_call(error)
    if call is None:
        raise error
    report.notes.append(f"fla call not replaced: {call} reached fla's Triton kernels, which cannot run here ({error})")
