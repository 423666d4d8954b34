"""Lowering the transformed ATen graphs: StableHLO, IREE on the CPU, TorchNeuron, a Neuron preflight.

Inner compilers (``inner=`` of `laplace_passes.compile` / the backend options):

    "stablehlo"   torch-mlir lowers every ATen graph to StableHLO (op counts in the
                  report); the graph then runs eagerly            -> stablehlo.StableHLOCompiler
    "iree"        that StableHLO compiled by IREE (llvm-cpu) and run: training
                  steps execute the lowered IR on the CPU          -> iree.IreeCompiler
    "neuron"      each graph handed to TorchNeuron's compiler, after the preflight;
                  a clear error when torch-neuronx is absent      -> neuron.NeuronCompiler

Each is one `laplace_passes.infra.inner.InnerCompiler` object; `laplace_passes.driver.backend`
maps the names to them. This package depends on the compile machinery below
it (`laplace_passes.driver.compile_fx.capture_graphs` for `preflight` and
`export_stablehlo`), never on the front door above it.

Functions:

    export_stablehlo(model_or_fn, *inputs, target=, out_dir=)   one .mlir per graph + manifest.json
    preflight(model_or_fn, *inputs, target="trn2")              what neuronx-cc / TorchNeuron will reject
    neuronx_cc_command(mlir_path, target="trn2")                 the neuronx-cc command TorchNeuron runs
    neuron_compiler(options, strict_preflight=True)              inner="neuron" with TorchNeuron options

Also: legalize.py (the ATen passes that make our graphs lowerable: gate
checks become clamps, slice_scatter bounds made static, diagonal as a
strided slice), checks.py (the preflight's checks), diagnose.py (which node
torch-mlir failed on), export.py, calibrate.py (the graph-size formula on
StableHLO, which the budget's estimate is calibrated against).

All of them need the `lowering` extra (torch-mlir, iree-base-compiler,
iree-base-runtime), imported only when used. Lowered graphs clamp gates
instead of checking them: a positive gate is not refused there.
"""

from laplace_passes.lowering.diagnose import LoweringError
from laplace_passes.lowering.iree import IreeCompiler, IreeModule
from laplace_passes.lowering.neuron import (
    NeuronCompiler,
    NeuronUnavailableError,
    neuron_compiler,
    neuronx_cc_command,
)
from laplace_passes.lowering.preflight import Finding, PreflightCompiler, PreflightError
from laplace_passes.lowering.stablehlo import LoweredGraph, StableHLOCompiler, lower_to_stablehlo

__all__ = [
    "Finding",
    "IreeCompiler",
    "IreeModule",
    "LoweredGraph",
    "LoweringError",
    "NeuronCompiler",
    "NeuronUnavailableError",
    "PreflightCompiler",
    "PreflightError",
    "StableHLOCompiler",
    "lower_to_stablehlo",
    "neuron_compiler",
    "neuronx_cc_command",
]
