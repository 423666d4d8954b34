"""Inner compilers: what receives each ATen graph (forward, backward, or a partition).

`inner` in the options is a name from `INNER_COMPILERS` or a callable
`(graph_module, example_inputs) -> callable` for users who bring their own
ATen-graph compiler or want to capture the graphs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch.fx
from functorch.compile import make_boxed_func

CompileFn = Callable[[torch.fx.GraphModule, list, str], Callable]


@dataclass(frozen=True)
class InnerCompiler:
    name: str
    compile: CompileFn  # (graph_module, example_inputs, kind) -> boxed callable
    # What AOT Autograd should apply before handing graphs over (None: its defaults).
    decompositions: Callable[[], dict] | None = None
    partition_fn: Callable | None = None
    # Passes this compiler needs on each ATen graph, run after the pipeline's:
    # (GraphContext) -> list of GraphPass (e.g. making the graph lowerable).
    aten_passes: Callable[[Any], list] | None = None
    # Raises, naming what to install, when a package this compiler needs is
    # missing: called when the options are read, before anything is traced.
    check_available: Callable[[], None] | None = None


def _eager(gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
    return make_boxed_func(gm.forward)


def _inductor(gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, is_backward=kind == "backward", is_inference=kind == "inference")


def _inductor_decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def _min_cut_partition(*args, **kwargs):
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(*args, **kwargs)


def _lazy(module: str, name: str) -> Callable:
    """`module.name`, imported on first call: the lowering compilers (laplace_passes.lowering)
    need torch-mlir, IREE or torch-neuronx only when they are used."""

    def call(*args):
        return getattr(importlib.import_module(module), name)(*args)

    call.__name__ = name
    return call


def _lowering(name: str, compile_fn: str, decompositions: str, passes: str, check: str | None = None) -> InnerCompiler:
    module = f"laplace_passes.lowering.{name}"
    return InnerCompiler(
        name, _lazy(module, compile_fn), decompositions=_lazy(module, decompositions), aten_passes=_lazy(module, passes),
        check_available=_lazy("laplace_passes.lowering._deps", check) if check else None,
    )


INNER_COMPILERS: dict[str, InnerCompiler] = {
    "eager": InnerCompiler("eager", _eager),
    "inductor": InnerCompiler(
        "inductor", _inductor, decompositions=_inductor_decompositions, partition_fn=_min_cut_partition
    ),
    # torch-mlir -> StableHLO (the graph then runs eagerly); that StableHLO run by IREE on the CPU;
    # TorchNeuron when torch-neuronx is installed (options: laplace_passes.lowering.neuron_compiler).
    "stablehlo": _lowering("stablehlo", "compile_stablehlo", "torch_mlir_decompositions", "torch_mlir_passes",
                           check="check_stablehlo"),
    "iree": _lowering("iree", "compile_iree", "torch_mlir_decompositions", "torch_mlir_passes", check="check_iree"),
    "neuron": _lowering("neuron", "compile_neuron", "neuron_decompositions", "neuron_passes"),
}


def resolve_inner(inner: Any) -> InnerCompiler:
    if isinstance(inner, InnerCompiler):
        return inner
    if isinstance(inner, str):
        if inner in INNER_COMPILERS:
            return INNER_COMPILERS[inner]
        raise ValueError(
            f"unknown inner compiler {inner!r}; known: {', '.join(sorted(INNER_COMPILERS))}, "
            "or a callable (graph_module, example_inputs) -> callable"
        )
    if callable(inner):
        return InnerCompiler(getattr(inner, "__name__", "custom"), _user_compiler(inner))
    raise TypeError(f"inner must be a compiler name or a callable, got {type(inner).__name__}")


def _user_compiler(fn: Callable) -> CompileFn:
    def compile_with_user_fn(gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
        compiled = fn(gm, example_inputs)
        if not callable(compiled):
            raise TypeError(f"inner compiler {fn!r} returned {type(compiled).__name__}, expected a callable")
        return compiled if getattr(compiled, "_boxed_call", False) else make_boxed_func(compiled)

    return compile_with_user_fn
