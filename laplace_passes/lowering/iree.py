"""Compile StableHLO with IREE for the host CPU and run it: the `iree` inner compiler.

inner="iree" runs every ATen graph (forward, backward, ...) through the
StableHLO that torch-mlir produced, compiled by IREE's llvm-cpu backend, so a
training step really executes the lowered IR: what Trainium would receive,
checked for numbers on a laptop.

    lowered = lower_to_stablehlo(gm)
    module = IreeModule(lowered)          # iree.compiler.compile_str(..., input_type="stablehlo")
    outputs = module(*tensors)            # torch tensors in, torch tensors out

Tensors cross as NumPy arrays (bf16 through ml_dtypes, a dependency of
iree-base-runtime); only CPU tensors can.

IREE's runtime objects are nanobind instances, and nanobind reports every
instance still alive at interpreter shutdown ("nanobind: leaked ...
instances", over a hundred lines). Dynamo's caches keep compiled functions,
and so our modules, alive until then; an exit handler, registered when the
first module is made, releases every module's runtime objects before
shutdown instead.
"""

from __future__ import annotations

import atexit
import gc
import re
import warnings
import weakref

import torch
import torch.fx
from functorch.compile import make_boxed_func

from laplace_passes.lowering import _deps
from laplace_passes.lowering.stablehlo import LoweredGraph, StableHLOCompiler, lowered_graph

# Code for this machine's CPU (the module runs where it is compiled); without
# a CPU named, IREE warns and targets a generic, slow x86-64.
DEFAULT_FLAGS = ("--iree-llvmcpu-target-cpu=host",)
# IREE's input conversion demotes f64 to f32 by default, changing the module's
# signature and its arithmetic: a graph that takes or returns float64 would
# refuse its float64 inputs at the call, and float64 math inside a float32
# graph (x.double() + 1e8 - 1e8, for precision) would lose what it was for.
# A graph with any f64 keeps it (`flags_for`).
# IREE's CPU backend links no float64 tanh or sin, though: a graph whose f64
# math does not link is compiled demoted after all, its float64 inputs cast to
# float32 on the way in and its float64 outputs cast back on the way out (what
# the demotion did before, without the refused call), with a warning, since it
# then computes that math in f32.
KEEP_F64 = "--iree-input-demote-f64-to-f32=false"


def flags_for(lowered: LoweredGraph) -> tuple[str, ...]:
    """The compile flags for `lowered`: f64 kept where the module has any (the clean-up leaves only the model's)."""
    return DEFAULT_FLAGS + ((KEEP_F64,) if "f64" in lowered.text else ())


def _compile_keeping_f64(lowered: LoweredGraph, flags: tuple[str, ...]) -> tuple[bytes, bool]:
    """(the module, whether its float64 was demoted to float32 because IREE could not link its f64 math)."""
    try:
        return compile_vmfb(lowered.text, flags), False
    except Exception as error:  # noqa: BLE001 (iree.compiler's CompilerToolError; anything else is raised again)
        if KEEP_F64 not in flags or "undefined symbol" not in str(error):
            raise
        symbols = sorted(set(re.findall(r"undefined symbol: (\w+)", str(error))))
        warnings.warn(f"IREE's CPU backend has no float64 {', '.join(symbols)}: this graph's float64 math is "
                      "compiled demoted to float32 (inner='stablehlo' runs it in float64)", stacklevel=2)
        return compile_vmfb(lowered.text, tuple(f for f in flags if f != KEEP_F64)), True


def compile_vmfb(stablehlo_text: str, flags: tuple[str, ...] = DEFAULT_FLAGS) -> bytes:
    """StableHLO module text -> an IREE VM flatbuffer for the llvm-cpu backend."""
    compiler = _deps.iree_compiler()
    return compiler.compile_str(
        stablehlo_text, target_backends=["llvm-cpu"], input_type="stablehlo", extra_args=list(flags)
    )


class _Runtime:
    """One module's IREE runtime objects, in one place that `release_runtime_objects` can empty.

    A holder, not attributes of IreeModule: the wrappers AOT Autograd and
    make_boxed_func put around a module copy its __dict__ (functools.wraps),
    so attributes would live on in every copy.
    """

    def __init__(self, context, main) -> None:
        self.context = context  # keeps the module's device and buffers alive
        self.main = main


_LIVE_RUNTIMES: weakref.WeakSet = weakref.WeakSet()


def release_runtime_objects() -> None:
    """Drop the IREE runtime objects of every live IreeModule (they cannot be called afterwards)."""
    for runtime in list(_LIVE_RUNTIMES):
        runtime.context = runtime.main = None
    gc.collect()  # IREE's bound functions and their context reference each other


class IreeModule:
    """A lowered graph compiled by IREE, callable with torch tensors."""

    def __init__(self, lowered: LoweredGraph, flags: tuple[str, ...] | None = None) -> None:
        runtime = _deps.iree_runtime()
        self.lowered = lowered
        self.vmfb, self.demoted = _compile_keeping_f64(lowered, flags_for(lowered) if flags is None else flags)
        context = runtime.SystemContext(config=runtime.Config("local-task"))
        context.add_vm_module(runtime.VmModule.copy_buffer(context.instance, self.vmfb))
        self._runtime = _Runtime(context, context.modules.module["main"])
        if not _LIVE_RUNTIMES:
            atexit.unregister(release_runtime_objects)  # registered once, however many modules come and go
            atexit.register(release_runtime_objects)
        _LIVE_RUNTIMES.add(self._runtime)

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        """Outputs in the ATen graph's order (None where the graph returns None)."""
        main = self._runtime.main
        if main is None:
            raise RuntimeError("this IREE module's runtime objects were released (release_runtime_objects)")
        if len(inputs) != len(self.lowered.inputs):
            raise TypeError(f"the module takes {len(self.lowered.inputs)} tensors, got {len(inputs)}")
        if self.demoted:  # the module takes and returns f32 where the graph has f64 (`_compile_keeping_f64`)
            inputs = tuple(t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.float64 else t for t in inputs)
        results = main(*(_to_numpy(t, spec.name) for t, spec in zip(inputs, self.lowered.inputs, strict=True)))
        if not isinstance(results, (tuple, list)):
            results = (results,)
        outputs = [_to_torch(r.to_host()) for r in results]
        if self.demoted:
            outputs = [o.double() if spec.dtype == "float64" else o for o, spec in zip(outputs, self.lowered.outputs)]
        return self.lowered.assemble_outputs(outputs)


def _to_numpy(tensor: torch.Tensor, name: str):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"input {name} is a {type(tensor).__name__}; IREE modules take tensors only")
    if tensor.device.type != "cpu":
        raise ValueError(f"input {name} is on {tensor.device}; inner='iree' runs on the CPU only")
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _to_torch(array) -> torch.Tensor:
    import numpy as np  # present: iree-base-runtime depends on it

    # Copied: the host view may be backed by a buffer IREE reuses.
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True))


class IreeCompiler(StableHLOCompiler):
    """inner="iree": lowered exactly as inner="stablehlo", then compiled by IREE and run on every call."""

    name = "iree"

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str):
        module = IreeModule(lowered_graph(gm, example_inputs))
        return make_boxed_func(module)

    def check_available(self) -> None:
        _deps.check_iree()
