"""The `neuron` inner compiler: each ATen graph handed to TorchNeuron (torch-neuronx).

TorchNeuron's own pipeline (docs/DESIGN.md sections 6 and 8) is Dynamo -> AOT Autograd
(its forward compiler, reused for the backward) -> torch-mlir -> StableHLO ->
neuronx-cc -> NEFF. Our passes need the ATen graphs, so we run AOT Autograd
ourselves and call TorchNeuron's ATen-graph compiler with each graph, with
TorchNeuron's decomposition table. Its internal names come from a source
snapshot of torch-neuronx 2.13/2.14 and may change between releases, so they
are resolved at run time (`NEURON_ENTRY_POINTS`) and a missing one is a
clear error, never a fallback to another compiler.

Before a graph is handed over, the Neuron preflight
(`laplace_passes.lowering.preflight`) checks it; its findings are in the
report, and by default any finding stops the compile (`PreflightError`,
from the `require_clean_preflight` pass) instead of a neuronx-cc failure
minutes later.

TorchNeuron's constraints are honoured: shapes are static (preflight finds
dynamic ones; `laplace_passes.compile` uses dynamic=False) and `mode` is
"default" (the only mode it supports; the `laplace` backend never takes
another).

How TorchNeuron's own `neuron` backend calls AOT Autograd, and what we do
(its source: torch_neuronx/neuron_dynamo_backend/backend.py,
`create_neuron_backend`, public copy github.com/parmoham-aws/test-repo-parmoham
at 98154b8; its documentation: awsdocs-neuron.readthedocs-hosted.com,
torch/compile/reference-torch-compile.html):

    aot_autograd(fw_compiler=..., keep_inference_input_mutations=True, decompositions=...)
      fw_compiler     one compiler for forward, backward and inference graphs, ending in
                      neuron_backend_fx_compiler(gm, inputs, analysis, options): ours are three
                      compilers of one kind, all ending in that call (`NeuronCompiler.compile`)
      partition_fn    not given: AOT Autograd's default partitioner; ours too (only inductor
                      gets the min-cut one)
      decompositions  get_compile_decomposition_table(): the same table (`decompositions`)
      keep_inference_input_mutations=True ("Prevent Copy-back"): an in-place update of a
                      buffer stays in the graph as a copy_ into the input, which TorchNeuron's
                      FunctionalizeCopyInplacePass turns into an output its executor writes back;
                      we set it too (`keep_inference_input_mutations` below), so the buffer is
                      not copied back a second time by AOT Autograd's wrapper
      options["dynamic"] = False, and its DynamicShapeAnalysis refuses symbols: we force
                      dynamic=False and the preflight reports symbolic sizes
      mode            other than "default": TorchNeuron warns and falls back; we refuse (clearer)

Not matched: TorchNeuron runs `preprocess_graph` (AliasingAnalysis) on the
Dynamo graph before AOT Autograd and hands its result as the third argument,
which becomes `mhlo.input_output_alias` (outputs written into the memory of
the inputs they alias). The inner compiler sees only ATen graphs, so we hand
None: no aliasing is declared, every output gets its own buffer (correct,
more device memory).
"""

from __future__ import annotations

import importlib
import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch.fx

from laplace_passes.infra.inner import InnerCompiler
from laplace_passes.infra.targets import HardwareTarget, get_target, runtime_target

# (module, attribute) of each TorchNeuron entry point we call.
NEURON_ENTRY_POINTS = {
    "compile_fx": ("torch_neuronx.neuron_dynamo_backend.backend", "neuron_backend_fx_compiler"),
    "decompositions": ("torch_neuronx.neuron_dynamo_backend.decompositions", "get_compile_decomposition_table"),
}

# TorchNeuron's executor otherwise falls back to running the graph eagerly
# when the NEFF fails to execute: a silent fallback we never want.
NO_FALLBACK_ENV = "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"

NEURON_UNAVAILABLE = (
    "inner='neuron' hands the ATen graphs to TorchNeuron (the torch-neuronx package), which is not "
    "installed here ({error}). torch-neuronx and neuronx-cc come from the AWS Neuron SDK's own pip "
    "repository (the PyPI projects of those names are placeholders) and run on Trainium instances "
    "(trn1, trn2) with the Neuron driver and runtime: install them there, beside torch 2.13 or 2.14, "
    "as the Neuron SDK setup guide describes. Without Trainium, see and check exactly what it would "
    "receive with inner='stablehlo' or inner='iree', laplace_passes.export_stablehlo(...) and "
    "laplace_passes.preflight(...). laplace_passes never falls back to another compiler."
)

# The neuronx-cc command TorchNeuron runs on the StableHLO bytecode it lowered, in its order
# (torch-neuronx csrc/core/compilation/NeuronCompiler.cpp and csrc/core/KernelExecution.cpp,
# public copy github.com/parmoham-aws/test-repo-parmoham at 98154b8):
#   neuronx-cc compile module.mlir --framework XLA --target trn2 --lnc 2 -O2 --model-type transformer
#       --auto-cast=none $NEURON_CC_FLAGS --output module.neff
# --lnc and --auto-cast come from the target (laplace_passes.infra.targets, sources there).
NEURON_TARGETS = ("trn1", "trn2")
# Extra flags, appended last: neuronx-cc takes the right-most of competing options, so they win
# (the CLI reference; the Neuron docs: "pass the same options through NEURON_CC_FLAGS").
NEURON_CC_FLAGS_ENV = "NEURON_CC_FLAGS"


# What the report says when a Neuron compile meets dynamic dimensions.
NEURON_ADVICE = (
    "Neuron compiles static shapes only: the dynamic dimensions above are compiled once per concrete "
    "shape (one neuronx-cc compile each, as TorchNeuron does). To compile once, keep the dimension static "
    "(laplace_passes.compile's default dynamic=False, no torch._dynamo.mark_dynamic, "
    "torch._dynamo.mark_static), or pad token inputs to a few lengths: "
    "laplace_passes.compile(model, seq_buckets=[...]) (causal models)"
)


class NeuronUnavailableError(ImportError):
    """torch-neuronx, or one of the entry points we call in it, is missing."""


@dataclass(frozen=True)
class NeuronEntryPoints:
    compile_fx: Callable  # (gm, example_inputs, pre_processing_analysis_info, options) -> boxed callable
    decompositions: Callable[[], dict]
    version: str


def resolve_torch_neuronx() -> NeuronEntryPoints:
    """Find TorchNeuron's ATen-graph compiler and decomposition table, or explain what is missing."""
    try:
        torch_neuronx = importlib.import_module("torch_neuronx")
    except ImportError as error:
        raise NeuronUnavailableError(NEURON_UNAVAILABLE.format(error=error)) from error
    version = getattr(torch_neuronx, "__version__", "unknown version")
    found = {}
    for role, (module_name, attribute) in NEURON_ENTRY_POINTS.items():
        try:
            found[role] = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise NeuronUnavailableError(
                f"torch-neuronx {version} is installed but has no {module_name}.{attribute} ({error}); "
                "laplace_passes calls TorchNeuron's ATen-graph compiler by the names of torch-neuronx "
                "2.13/2.14 (laplace_passes.lowering.neuron.NEURON_ENTRY_POINTS): this release moved it"
            ) from error
    return NeuronEntryPoints(version=version, **found)


@dataclass(frozen=True)
class NeuronCompiler(InnerCompiler):
    """inner="neuron": each ATen graph to TorchNeuron's compiler, after the preflight.

    `options` are passed through to TorchNeuron's compiler (model_name, ...);
    `strict_preflight=False` reports preflight findings but hands the graph
    over anyway.
    """

    options: dict[str, Any] = field(default_factory=dict)
    strict_preflight: bool = True
    name = "neuron"
    static_shapes = True
    for_neuron = True
    legalizes = True
    # As TorchNeuron's backend (module docstring): buffer updates stay in the graph as copy_.
    keep_inference_input_mutations = True

    def __post_init__(self) -> None:
        if self.options.get("dynamic", False) is not False:
            raise ValueError("TorchNeuron compiles static shapes only: options['dynamic'] must be False")
        if self.options.get("mode", "default") != "default":
            raise ValueError(f"TorchNeuron supports mode='default' only, got mode={self.options['mode']!r}")

    def decompositions(self) -> dict:
        return resolve_torch_neuronx().decompositions()

    @property
    def preflight(self) -> str:
        return "require" if self.strict_preflight else "report"

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
        entry_points = resolve_torch_neuronx()
        os.environ.setdefault(NO_FALLBACK_ENV, "1")
        options = {**self.options, "dynamic": False}
        return entry_points.compile_fx(gm, example_inputs, None, options)


def neuron_compiler(options: dict[str, Any] | None = None, *, strict_preflight: bool = True) -> NeuronCompiler:
    """inner="neuron" with TorchNeuron `options` passed through, e.g. ``{"model_name": "gla"}``."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"neuron_compiler options must be a dict of TorchNeuron options, got {type(options).__name__}")
    if not isinstance(strict_preflight, bool):
        raise TypeError(f"strict_preflight must be a bool, got {type(strict_preflight).__name__}")
    return NeuronCompiler(dict(options or {}), strict_preflight)


def neuronx_cc_command(
    mlir_path: str | os.PathLike,
    *,
    target: str | HardwareTarget = "trn2",
    output: str | os.PathLike | None = None,
    extra_flags: tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """The neuronx-cc invocation TorchNeuron uses, for a StableHLO module exported by hand.

        neuronx-cc compile forward_0.mlirbc --framework XLA --target trn2 --lnc 2 -O2
            --model-type transformer --auto-cast=none $NEURON_CC_FLAGS --output forward_0.neff

    `--lnc` and `--auto-cast` are the target's (trn1 accepts only --lnc 1),
    `--lnc` the value of NEURON_LOGICAL_NC_CONFIG instead when that is set,
    as TorchNeuron does (a NEFF for another LNC than the runtime's does not
    load); `extra_flags`, then the words of NEURON_CC_FLAGS (both variables
    read from `env`, default os.environ) come last, so they override.
    TorchNeuron hands neuronx-cc MLIR bytecode (`export_stablehlo` writes it beside the
    text). neuronx-cc is not on PyPI, so this command is not run (or
    verified) here.
    """
    resolved = get_target(target)
    if resolved.name not in NEURON_TARGETS or resolved.logical_cores is None:
        raise ValueError(f"neuronx-cc compiles for Trainium targets {NEURON_TARGETS}, not {resolved.name!r}")
    resolved = runtime_target(resolved, env)
    path = os.fspath(mlir_path)
    output = os.fspath(output) if output is not None else os.path.splitext(path)[0] + ".neff"
    user_flags = shlex.split((os.environ if env is None else env).get(NEURON_CC_FLAGS_ENV, ""))
    return [
        "neuronx-cc", "compile", path, "--framework", "XLA", "--target", resolved.name,
        "--lnc", str(resolved.logical_cores), "-O2", "--model-type", "transformer",
        f"--auto-cast={resolved.auto_cast}", *extra_flags, *user_flags, "--output", output,
    ]


def format_command(command: list[str]) -> str:
    return shlex.join(command)
