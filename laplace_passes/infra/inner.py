"""Inner compilers: what receives each ATen graph (forward, backward, inference, or a partition of one).

An inner compiler is one object, an `InnerCompiler`: its `compile` turns a
graph into a callable, and its hooks say what else it needs (a
decomposition table for AOT Autograd, a joint-graph partitioner, passes of
which optional passes of the declared pipeline its graphs get, packages
that must be installed).
This module holds the base class and the compilers torch itself provides;
the lowering compilers (StableHLO, IREE, TorchNeuron) are in
`laplace_passes.lowering`, and `laplace_passes.driver.backend` maps the names
users write (`inner="iree"`) to them. A callable
`(graph_module, example_inputs) -> callable` is accepted too, for users who
bring their own ATen-graph compiler or want to capture the graphs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import torch.fx
from functorch.compile import make_boxed_func

from laplace_passes.infra.fx_helpers import GraphsByFakeMode
from laplace_passes.infra.inductor_fast import (dtype_rules_set_once, fast_index_simplify, start_isa_probes,
                                               wait_for_isa_probes)


class InnerCompiler:
    """The base of every inner compiler; subclasses set `name` and implement `compile`."""

    name = "inner"  # what the report shows
    # AOT Autograd's joint-graph partitioner (None: its default).
    partition_fn: Callable | None = None
    # True: takes graphs with static shapes only; a graph with symbolic sizes is compiled once
    # per concrete shape instead (`laplace_passes.driver.shapes`).
    static_shapes = False
    # True: the graphs go to neuronx-cc (TorchNeuron, or the preflight that stands in for it), so the
    # report's advice for dynamic dimensions is Neuron's.
    for_neuron = False
    # Which of the declared pipeline's optional passes this compiler's graphs get
    # (laplace_passes.driver.pipeline; `laplace-passes inspect --passes` prints them):
    legalizes = False  # the passes that make graphs lowerable by torch-mlir (lowering/legalize.py)
    preflight = "off"  # the Neuron preflight: "off", "report" (findings in the report), "require" (stop on one)
    lowers_to_stablehlo = False  # each graph (or partition) lowered to StableHLO once, after the budget pass
    # AOT Autograd's keep_inference_input_mutations: an in-place update of an input (a buffer) stays
    # in the graph as a trailing copy_ into it, instead of a new output AOT Autograd copies back.
    keep_inference_input_mutations: bool = False
    # True: where the target keeps GLA's state recurrence whole, each GLA chunk-loop op stays one node whose
    # body this compiler's Inductor compiles once per signature, for every site (laplace_passes.unroll.compiled_bodies).
    compiles_loop_bodies = False
    # True: `compile` ends in Inductor's compile_fx_inner, whose codegen may run in the helper process
    # (laplace_passes.driver.backward_ahead).
    codegen_elsewhere = False

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
        """A boxed callable running `gm`; `kind` is "forward", "backward" or "inference"."""
        raise NotImplementedError

    def start(self) -> None:
        """Called as the backend receives a Dynamo graph, before the passes and AOT Autograd: work to start early."""

    def decompositions(self) -> dict | None:
        """What AOT Autograd should decompose before handing graphs over (None: its defaults).

        The passes, and the budget's instruction estimate, run on the graph this
        table makes: only compilers that cannot take other graphs (the lowering
        ones) set one; a compiler that merely prefers its own decompositions
        applies them in `compile` (InductorCompiler), so the estimate does not
        depend on it.
        """
        return None

    def check_available(self) -> None:
        """Raise, naming what to install, when a package this compiler needs is missing."""

    def __repr__(self) -> str:
        return f"<inner compiler {self.name!r}>"


class EagerCompiler(InnerCompiler):
    """Run each graph as Python: the graphs the passes made, executed op by op."""

    name = "eager"

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
        return make_boxed_func(gm.forward)


class InductorCompiler(InnerCompiler):
    """torch's own compiler, with its min-cut partitioner; its decompositions applied when it compiles.

    AOT Autograd and the laplace passes (the budget's estimate included) see
    the same graph as with inner="eager": Inductor's table rewrites for
    Inductor's CPU/GPU kernels (a [n, 1, K] @ [n, K, 1] bmm becomes mul + sum
    on the CPU), not what neuronx-cc is given, so it is applied here, to each
    graph or partition, after the passes. Inductor's settings apply as in
    torch.compile's Inductor, ``cpp_wrapper`` included (NOTE [the C++ wrapper]).
    """

    name = "inductor"
    # As torch.compile's own Inductor path: a buffer updated in place (a decode state) is written by
    # the kernel that computes it, not copied back from a new output after the graph.
    keep_inference_input_mutations = True
    compiles_loop_bodies = True
    codegen_elsewhere = True

    def start(self) -> None:
        # Overlaps Dynamo's graph with Inductor's g++ probes (NOTE [vector-ISA probes ahead of the codegen]).
        start_isa_probes()

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
        from torch._inductor.compile_fx import compile_fx_inner

        gm = _decomposed_for_inductor(gm, example_inputs)
        wait_for_isa_probes()
        with inductor_as_we_run_it(), _wrapper_as_configured() as wrapper:
            return compile_fx_inner(gm, example_inputs, is_backward=kind == "backward",
                                    is_inference=kind == "inference", **wrapper)

    @staticmethod
    def partition_fn(*args, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        return min_cut_rematerialization_partition(*args, **kwargs)


@contextlib.contextmanager
def _wrapper_as_configured() -> Iterator[dict]:
    """The keyword arguments and settings of Inductor's C++ wrapper, when `torch._inductor.config.cpp_wrapper`
    asks for it.

    NOTE [the C++ wrapper]: torch.compile's Inductor reads ``config.cpp_wrapper`` in `compile_fx`, which
    passes ``cpp_wrapper=True`` to `compile_fx_inner` under its C++-wrapper settings; this backend calls
    `compile_fx_inner` itself, which reads neither, so the setting was ignored and every graph got the Python
    wrapper. The same two things are done here. Unlike torch.compile, which carries the forward's setting to
    its backward, the setting is read as each graph compiles, and a backward compiles at the first backward
    call: set it for the whole run, not around the forward alone. With it, the kernels are built into the
    wrapper's own library, one g++ build per graph, not in the kernel batches (NOTE [kernels compiled
    together] in laplace_passes/infra/kernel_batches.py): a slower first compile. ``fx_wrapper`` is not
    passed: torch's own Inductor raises NotImplementedError with it on these graphs on the CPU. (On `tiny`'s
    decode step the C++ wrapper ran no faster: docs/benchmarks.md.)
    """
    from torch._inductor import config

    if not config.cpp_wrapper:
        yield {}
        return
    from torch._inductor.compile_fx import get_cpp_wrapper_config

    with config.patch(get_cpp_wrapper_config()):
        yield {"cpp_wrapper": True}


@contextlib.contextmanager
def inductor_as_we_run_it() -> Iterator[None]:
    """What `InductorCompiler.compile` runs Inductor's compile within (the helper process too).

    The same kernels, sooner: NOTE [index strides without sympy.simplify],
    NOTE [dtype rules set up once] (both in laplace_passes/infra/inductor_fast.py),
    NOTE [kernels compiled together].
    """
    from laplace_passes.infra.kernel_batches import kernels_compiled_together

    with fast_index_simplify(), dtype_rules_set_once(), kernels_compiled_together():
        yield


def _decomposed_for_inductor(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
    """`gm` traced again with Inductor's decomposition table, in its inputs' fake mode (or a new one).

    A graph decomposed within `decomposing_ahead()` is kept, and the same
    graph with inputs of the same layouts later takes that result instead of
    tracing again (the backward sent to the helper process, then compiled:
    NOTE [backward graphs generated in the helper process]).
    """
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from laplace_passes.infra.remote_codegen import request_key
    from laplace_passes.infra.report import copy_graphs

    fake_mode = detect_fake_mode(example_inputs)
    key = request_key(gm, example_inputs, [], {}) if _AHEAD.keeping or _AHEAD.kept else None
    kept = _AHEAD.kept.get(fake_mode, key, take=True) if key is not None else None
    if kept is not None:
        return kept
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        mode = "real" if fake_mode is not None else "fake"
        decomposed = make_fx(gm, decomposition_table=select_decomp_table(), tracing_mode=mode)(*example_inputs)
    if _AHEAD.keeping and key is not None:  # a backward that never compiles leaves its graph: KEPT at most
        _AHEAD.kept.put(fake_mode, key, copy_graphs(decomposed))  # Inductor changes the graph it compiles
    return decomposed


class _DecomposedAhead:
    """Graphs decomposed ahead of their compile, by `request_key`, with the fake mode of their values."""

    KEPT = 4

    def __init__(self) -> None:
        self.keeping = False
        self.kept = GraphsByFakeMode(self.KEPT)


_AHEAD = _DecomposedAhead()


@contextlib.contextmanager
def decomposing_ahead() -> Iterator[None]:
    """Within it, graphs decomposed for Inductor are kept for their compile to come (`_decomposed_for_inductor`)."""
    _AHEAD.keeping = True
    try:
        yield
    finally:
        _AHEAD.keeping = False


class CallableCompiler(InnerCompiler):
    """A user's `(graph_module, example_inputs) -> callable`."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", "custom")

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
        compiled = self.fn(gm, example_inputs)
        if not callable(compiled):
            raise TypeError(f"inner compiler {self.fn!r} returned {type(compiled).__name__}, expected a callable")
        return compiled if getattr(compiled, "_boxed_call", False) else make_boxed_func(compiled)


TORCH_COMPILERS: Mapping[str, InnerCompiler] = {"eager": EagerCompiler(), "inductor": InductorCompiler()}


def resolve_inner(inner: Any, known: Mapping[str, InnerCompiler] = TORCH_COMPILERS) -> InnerCompiler:
    """`inner` as an InnerCompiler: itself, the one `known` by that name, or a callable wrapped."""
    if isinstance(inner, InnerCompiler):
        return inner
    if isinstance(inner, str):
        if inner in known:
            return known[inner]
        raise ValueError(
            f"unknown inner compiler {inner!r}; known: {', '.join(sorted(known))}, "
            "or a callable (graph_module, example_inputs) -> callable"
        )
    if callable(inner):
        return CallableCompiler(inner)
    raise TypeError(f"inner must be a compiler name or a callable, got {type(inner).__name__}")
