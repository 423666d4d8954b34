"""The `laplace` torch.compile backend, and the inner compilers by name.

    torch.compile(model, backend="laplace", options={"target": "trn2", "inner": "eager"})

Registered through the `torch_dynamo_backends` entry point in setup.cfg.
Each Dynamo graph goes through `compile_fx.compile_fx`: the Dynamo-level
passes, AOT Autograd, the ATen-level passes, the inner compiler.

This module sits above everything it names: `INNER_COMPILERS` maps the
names of `inner=` to compiler objects, those torch provides
(`laplace_passes.infra.inner`) and the lowering ones (`laplace_passes.lowering`).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Mapping

import torch.fx

from laplace_passes.driver.compile_fx import compile_fx, prepare_to_trace
from laplace_passes.driver.config import CompileConfig
from laplace_passes.infra.inner import TORCH_COMPILERS, InnerCompiler
from laplace_passes.infra.report import Report
from laplace_passes.lowering.iree import IreeCompiler
from laplace_passes.lowering.neuron import NeuronCompiler
from laplace_passes.lowering.stablehlo import StableHLOCompiler

INNER_COMPILERS: Mapping[str, InnerCompiler] = {
    **TORCH_COMPILERS,
    # torch-mlir -> StableHLO (the graph then runs eagerly); that StableHLO run by IREE on the CPU;
    # TorchNeuron when torch-neuronx is installed (with options: laplace_passes.lowering.neuron_compiler).
    "stablehlo": StableHLOCompiler(),
    "iree": IreeCompiler(),
    "neuron": NeuronCompiler(),
}



def compile_config(options: dict[str, Any] | None) -> CompileConfig:
    """The options of one compile, validated, with `inner` resolved among `INNER_COMPILERS`."""
    return CompileConfig.from_options(options, INNER_COMPILERS)


def laplace_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict[str, Any] | None = None,
                    mode: str | None = None) -> Callable:
    _refuse_a_mode(mode)
    if (options or {}).get("report") is None:  # a wrong value (0, "", []) is refused by compile_config, not replaced
        options = {**(options or {}), "report": report_of_this_call()}
    return compile_fx(gm, example_inputs, compile_config(options))


def _refuse_a_mode(mode: str | None) -> None:
    """torch.compile hands its `mode` to a custom backend, in place of `options` (it takes one or the other)."""
    if mode not in (None, "default"):
        raise ValueError(
            f"torch.compile(..., backend='laplace', mode={mode!r}): mode is a setting of Inductor's own backend; "
            "the laplace backend takes its settings as options= (target, inner, ...), and torch.compile accepts "
            "mode or options, not both. For Inductor after the laplace passes: options={'inner': 'inductor'}, "
            "with Inductor's own settings in torch._inductor.config (e.g. max_autotune = True)"
        )


def report_of_this_call() -> Report:
    """One report for every graph Dynamo compiles during one call of a compiled function.

    torch.compile(model, backend="laplace") hands each graph of a call to the backend on its own (a graph break
    makes several); `last_report()` should describe the whole call, the call that returned or raised. The graphs
    of one call are compiled while the call's outermost Dynamo wrapper frame is still running, so the report
    lives in that frame's locals: it is found again by the call's later graphs and dies with the call (no
    global state that a later call could mistake for its own).
    """
    outermost = _outermost_dynamo_frame(sys._getframe(1))
    if outermost is None:
        return Report()
    try:
        return outermost.f_locals.setdefault(_REPORT_LOCAL, Report())
    except (AttributeError, TypeError):  # a frame whose locals take no extra name: one report per graph
        return Report()


_REPORT_LOCAL = "__laplace_passes_report__"
_EVAL_FRAME = os.path.join("torch", "_dynamo", "eval_frame.py")


def _outermost_dynamo_frame(frame):
    """The outermost frame of Dynamo's wrapper around a compiled function (None outside any)."""
    outermost = None
    while frame is not None:
        if frame.f_code.co_filename.endswith(_EVAL_FRAME):
            outermost = frame
        frame = frame.f_back
    return outermost


def __getattr__(name: str):
    """`registered_backend`: what the `torch_dynamo_backends` entry point names (setup.cfg).

    Dynamo loads it when a user first writes torch.compile(..., backend="laplace"),
    before it traces anything: the moment to `prepare_to_trace` (fla's replacements).
    Importing this module does nothing of the kind.
    """
    if name == "registered_backend":
        prepare_to_trace()
        return laplace_backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
