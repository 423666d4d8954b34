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

from typing import Any, Callable, Mapping

import torch.fx

from laplace_passes.driver.compile_fx import compile_fx, prepare_to_trace
from laplace_passes.driver.config import CompileConfig
from laplace_passes.infra.inner import TORCH_COMPILERS, InnerCompiler
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


def laplace_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict[str, Any] | None = None) -> Callable:
    return compile_fx(gm, example_inputs, compile_config(options))


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
