"""GLA chunk-loop ops whose bodies Inductor compiles once per signature, for every site of that signature.

NOTE [chunk-loop bodies compiled once]
Inlined, each GLA site's chunked body (`chunk_loops`) is several hundred
ATen nodes of the host graph, and Inductor compiles the sites of a model's
layers one by one although they are the same code at the same shapes: for
`tiny`'s training step, two thirds of the graphs' nodes were its two
layers' bodies. With an inner compiler that runs Python-callable ops
(Inductor) and a target that keeps the state recurrence whole (the cpu
target, `HardwareTarget.chunk_recurrence` "op"), the unroll pass leaves a
chunk-loop op that shares its signature with another site of its graph as
its twin below, same arguments:

Before (an AOT forward graph, two layers):

    chunked_gla = torch.ops.laplace.chunked_gla.default(view_1, view_3, getitem_2, None, None, 0.177, 64, 8, True)
    chunked_gla_1 = torch.ops.laplace.chunked_gla.default(view_9, view_11, getitem_7, None, None, 0.177, 64, 8, True)

After:

    chunked_gla = torch.ops.laplace.chunked_gla_inductor.default(view_1, view_3, getitem_2, None, None, 0.177, 64, 8, True)
    chunked_gla_1 = torch.ops.laplace.chunked_gla_inductor.default(view_9, view_11, getitem_7, None, None, 0.177, 64, 8, True)

Inductor compiles the host graph around them (an opaque call each). Each
signature (op, every tensor's shape, strides, dtype and device, the
constant arguments) gets the same body the unroll pass would inline
(`chunk_loops.body_of`, the recurrence one `laplace::chunk_recurrence`),
traced and compiled with Inductor once: just before the host graph, from
the twins' fake arguments (`compile_ahead`, NOTE [kernel builds beside the
codegen] in `laplace_passes/infra/kernel_batches.py`), or at a twin's first
call with a signature not seen before; a backward body the helper process
compiles (NOTE [bodies compiled in a helper process]) is loaded at the
backward graph's first call. Every later call with that
signature, from any site, graph or compile in the process, runs that
compiled body. The values are those of the inlined body
compiled by Inductor: the same trace, cut at the op's boundary. The twin
shares the op's fake kernel, whose strides (contiguous) are those the body
returns and Inductor keeps for a graph's outputs, so the host graph is
traced with the layout the compiled body gives (tests/test_compiled_bodies.py
compares them).

The trade, measured side by side (`benchmarks/bench_loop_bodies.py`,
docs/benchmarks.md): the first call of `tiny`'s training step at T = 2048
took 0.71x to 0.87x the seconds (one body compiled instead of one per
layer, and smaller host graphs; 0.71x since the bodies compile beside
the C++ of their host graph), and a step afterwards 1.05x to 1.12x;
two GLA sites of wide heads (H=4, K=128, V=256) in one graph ran their
forward and backward in 1.03x to 1.10x the time. The matmuls take the same time;
the rest does not fuse across the op's boundary: inlined, Inductor fuses
the two sites' elementwise work into shared kernels and into their
neighbours' (25 kernels in that backward graph), while each compiled
backward body runs 16 of its own (35 with the host graph's 3). So the
option `share_loop_bodies` (default True, for the first call the cpu
target's users wait on) can be turned off for a long run, and a site
alone in its graph, whose body is compiled once either way, is inlined.

A body Inductor fails to compile runs op by op, with a warning naming the
error (the numbers stay right). Only sites whose every size is static get
the twin; a symbolic size keeps the inlined body, which takes it.
"""

from __future__ import annotations

import os
import threading
import warnings
from concurrent.futures import Future
from typing import Callable, Sequence

import torch
import torch._guards
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx

from laplace_passes.infra import logs
from laplace_passes.infra.fx_helpers import fake_tensor
from laplace_passes.infra.inner import InductorCompiler
from laplace_passes.ops.chunked import CHUNK_LOOP_OPS, _chunked_gla_backward_fake, _chunked_gla_fake
from laplace_passes.unroll.body_helper import HELPER, BodyHelper, load_wrapper
from laplace_passes.unroll.chunk_loops import body_of, loop_name


@torch.library.custom_op("laplace::chunked_gla_inductor", mutates_args=())
def chunked_gla_inductor(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Tensor | None,
    scale: float, chunk_size: int, sub_chunk_size: int, save_residuals: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`laplace::chunked_gla`, its body compiled by Inductor once per signature (NOTE above)."""
    return BODIES.run(CHUNK_LOOP_OPS[0], (q, k, v, gk, initial_state, scale, chunk_size, sub_chunk_size,
                                          save_residuals))


@torch.library.custom_op("laplace::chunked_gla_backward_inductor", mutates_args=())
def chunked_gla_backward_inductor(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Tensor | None,
    grad_o: Tensor, grad_final_state: Tensor | None, states: Tensor | None, scores: Tensor | None,
    scale: float, chunk_size: int, sub_chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`laplace::chunked_gla_backward`, its body compiled by Inductor once per signature (NOTE above)."""
    return BODIES.run(CHUNK_LOOP_OPS[1], (q, k, v, gk, initial_state, grad_o, grad_final_state, states, scores,
                                          scale, chunk_size, sub_chunk_size))


chunked_gla_inductor.register_fake(_chunked_gla_fake)
chunked_gla_backward_inductor.register_fake(_chunked_gla_backward_fake)

# Each chunk-loop op's twin.
TWINS = {CHUNK_LOOP_OPS[0]: torch.ops.laplace.chunked_gla_inductor.default,
         CHUNK_LOOP_OPS[1]: torch.ops.laplace.chunked_gla_backward_inductor.default}
_OP_OF_TWIN = {twin: op for op, twin in TWINS.items()}


def signature(op, args: Sequence) -> tuple:
    """What one compiled body serves: the op, each tensor's layout, every other argument."""
    return (op,) + tuple(
        ("tensor", tuple(a.shape), a.stride(), a.dtype, str(a.device)) if isinstance(a, Tensor) else ("value", a)
        for a in args
    )


def signature_arguments(layouts: Sequence[tuple]) -> tuple:
    """Arguments with `layouts` (a signature without its op): fakes for its tensors, all a body's compile reads."""
    mode = FakeTensorMode()
    args = []
    for kind, *rest in layouts:
        if kind == "tensor":
            shape, stride, dtype, device = rest
            with mode:
                args.append(torch.empty_strided(shape, stride, dtype=dtype, device=device))
        else:
            args.append(rest[0])
    return tuple(args)


class CompiledBodies:
    """The process's compiled chunk-loop bodies, one per signature; compiles a missing one on first use.

    `helper`: where `compile_elsewhere` sends a body to compile beside this
    process's work (NOTE [bodies compiled in a helper process] in
    `laplace_passes.unroll.body_helper`); None: every body is compiled here.
    """

    def __init__(self, compile_body: Callable[[torch.fx.GraphModule, list], Callable] | None = None,
                 helper: BodyHelper | None = None) -> None:
        self._compile_body = compile_body or (lambda gm, fakes: InductorCompiler().compile(gm, fakes, "inference"))
        self._helper = helper
        self._lock = threading.Lock()
        self._bodies: dict[tuple, Callable[[list], Sequence[Tensor]]] = {}
        self._elsewhere: dict[tuple, Future] = {}  # signatures the helper is compiling, not loaded yet
        self.graphs: dict[tuple, torch.fx.GraphModule] = {}  # each signature's traced body, to inspect
        self.from_helper: set[tuple] = set()  # signatures whose body the helper compiled

    def __len__(self) -> int:
        return len(self._bodies)

    def signatures(self) -> set[tuple]:
        """Every signature with a body here, compiled in this process or by the helper."""
        return set(self._bodies)

    def run(self, op, args: tuple) -> tuple[Tensor, ...]:
        body = self.prepare(op, args)
        return tuple(body([a for a in args if isinstance(a, Tensor)]))

    def prepare(self, op, args: tuple) -> Callable[[list], Sequence[Tensor]]:
        """The compiled body for `args` (real or fake tensors, only their layouts are read), compiled if missing."""
        key = signature(op, args)
        with self._lock:  # one compile per signature, also when threads call at once
            if key not in self._bodies:
                future = self._elsewhere.pop(key, None)
                body = self._from_helper(op, args, key, future) if future is not None else None
                self._bodies[key] = body or self._compiled(op, args, key)
            return self._bodies[key]

    def compile_elsewhere(self, op, args: tuple) -> bool:
        """Have the helper compile the body for `args` now; the first `prepare` of its signature loads it."""
        key = signature(op, args)
        with self._lock:
            if self._helper is None or key in self._bodies or key in self._elsewhere:
                return False
            future = self._helper.submit(op, key[1:])  # the signature lays out every argument
            if future is None:
                return False
            self._elsewhere[key] = future
            return True

    def in_helper(self, op, args: tuple) -> bool:
        """The helper is compiling the body for `args` (not failed so far), not loaded here yet."""
        with self._lock:
            future = self._elsewhere.get(signature(op, args))
        return future is not None and not (future.done() and future.exception() is not None)

    def forget_helper_requests(self) -> None:
        """Drop the requests sent to the helper: in a forked child, whose replies go to the parent."""
        self._lock = threading.Lock()  # the parent's may have been held by another thread at the fork
        self._elsewhere.clear()

    def _from_helper(self, op, args: tuple, key: tuple, future: Future) -> Callable[[list], Sequence[Tensor]] | None:
        """The body the helper compiled, loaded here; None (and the reason in the log) if it has none."""
        where = f"the body of {loop_name(op)} at {_shapes(args)}"
        try:
            with logs.progress(f"loading {where}, compiled in the helper process"):
                body = load_wrapper(future.result()["source"])
        except Exception as error:  # noqa: BLE001 - compiled here instead, as without the helper
            logs.log.info("%s not compiled in the helper process (%s: %s); compiled here", where,
                          type(error).__name__, error)
            return None
        self.from_helper.add(key)
        return body

    def _compiled(self, op, args: tuple, key: tuple) -> Callable[[list], Sequence[Tensor]]:
        body = body_of(op, args, [isinstance(a, Tensor) for a in args], recurrence="op")
        shapes = _shapes(args)
        try:
            with logs.progress(f"compiling the body of {loop_name(op)} at {shapes} with inductor"):
                gm, fakes = _traced_body(op, args, body)
                self.graphs[key] = gm
                return self._compile_body(gm, fakes)
        except Exception as error:  # noqa: BLE001 - the body run op by op still computes the same numbers
            warnings.warn(f"laplace_passes: Inductor could not compile the body of {loop_name(op)} at {shapes} "
                          f"({type(error).__name__}: {error}); it runs op by op instead", stacklevel=2)
            return lambda tensors: body(*tensors)


def _shapes(args: tuple) -> str:
    return ", ".join(str(list(a.shape)) for a in args if isinstance(a, Tensor))


def compiled_source(op, args: tuple) -> str:
    """The body for `args` traced and compiled by Inductor as `BODIES` does: the wrapper module's source.

    What the helper process runs (`body_helper`); a body holding constants
    (which the source does not carry) is refused.
    """
    body = body_of(op, args, [isinstance(a, Tensor) for a in args], recurrence="op")
    gm, fakes = _traced_body(op, args, body)
    if gm.graph.find_nodes(op="get_attr"):
        raise ValueError("the body holds constants, which its wrapper's source does not carry")
    compiled = InductorCompiler().compile(gm, fakes, "inference")
    source = getattr(compiled, "source_code", None)
    if not isinstance(source, str):
        raise TypeError(f"Inductor returned {type(compiled).__name__}, not a graph compiled from source")
    return source


BODIES = CompiledBodies(helper=HELPER)
if hasattr(os, "register_at_fork"):  # a forked child compiles here what its parent asked the helper for
    os.register_at_fork(after_in_child=BODIES.forget_helper_requests)


def _traced_body(op, args: tuple, body: Callable) -> tuple[torch.fx.GraphModule, list[Tensor]]:
    """`body` (the op's, a function of its tensors) traced on fakes of `args`, and those fakes."""
    mode = FakeTensorMode()
    fakes = [_fake_in(mode, a) for a in args if isinstance(a, Tensor)]
    with mode:
        return make_fx(body, tracing_mode="real")(*fakes), fakes


def _fake_in(mode: FakeTensorMode, tensor: Tensor) -> Tensor:
    """A fake of `tensor` in `mode`; a fake of another mode (a graph's) by its layout, which is all a body reads."""
    if isinstance(tensor, FakeTensor):
        with mode:
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    return mode.from_tensor(tensor)


def compile_ahead(gm: torch.fx.GraphModule, kind: str = "inference") -> int:
    """Compile now the body each chunk-loop twin of `gm` will call; how many were compiled.

    NOTE [kernel builds beside the codegen]: compiled while the host graph
    is, not at the first call, so the C++ of one graph is built while
    Inductor generates the next. The signature comes from the twin's
    arguments' fake values: the layouts Inductor passes, as the op's inputs
    keep their traced strides (a site whose run-time layout differed would
    compile its own body at its first call, as before). A forward graph
    (`kind`) first sends the bodies its backward will call to the helper
    process (NOTE [bodies compiled in a helper process]); the backward
    graph leaves those to its first call, which loads them.
    """
    compiled_before = len(BODIES)
    twins = [(op, node) for node in gm.graph.nodes if (op := _OP_OF_TWIN.get(node.target)) is not None]
    if kind == "forward":
        for op, node in twins:
            _guarded(op, lambda: _backward_elsewhere(op, node), "sent to the helper process")
    for op, node in twins:
        _guarded(op, lambda: _compile_ahead(op, node), "compiled ahead")
    return len(BODIES) - compiled_before


def _guarded(op, step: Callable[[], None], what: str) -> None:
    try:
        step()
    except Exception as error:  # noqa: BLE001 - the twin compiles its body at its first call instead
        logs.log.info("the body of %s not %s (%s: %s); it compiles at its first call",
                      loop_name(op), what, type(error).__name__, error)


def _backward_elsewhere(op, node: torch.fx.Node) -> None:
    args = static_arguments(node)
    if op is CHUNK_LOOP_OPS[0] and args is not None:
        BODIES.compile_elsewhere(CHUNK_LOOP_OPS[1], backward_arguments(args))


def backward_arguments(forward_args: tuple) -> tuple:
    """What the backward op will take after the forward op took `forward_args`, as fakes of their layouts.

    The forward's inputs and settings, a tangent laid out as each output
    (`_backward` in `laplace_passes.ops.chunked` passes them on), and the
    residuals it saved (None when it saves none): a prediction, checked
    when the backward graph compiles, where a signature that differs is
    compiled in this process.
    """
    mode = FakeTensorMode()
    inputs = tuple(_fake_in(mode, a) if isinstance(a, Tensor) else a for a in forward_args)
    with mode:
        o, final_state, states, scores = _chunked_gla_fake(*inputs)
    residuals = (states, scores) if inputs[8] else (None, None)
    return (*inputs[:5], o, final_state, *residuals, *inputs[5:8])


def _compile_ahead(op, node: torch.fx.Node) -> None:
    args = static_arguments(node)
    # A body the helper is compiling is loaded at the host graph's first call: the host graph's codegen
    # runs meanwhile, not after a wait for the helper (its kernels are built there, nothing is left to
    # build beside this codegen).
    if args is not None and not BODIES.in_helper(op, args):
        # Compiled as at a first call: outside the host graph's tracing context (its fake mode, its
        # output strides) and Dynamo's active fake mode, which would otherwise apply to the body's graph.
        with torch._guards.tracing(None), unset_fake_temporarily():
            BODIES.prepare(op, args)


def static_arguments(node: torch.fx.Node) -> tuple | None:
    """A chunk-loop node's arguments, its tensors as their fake values; None if one is unknown or has a symbolic size."""
    args = tuple(fake_tensor(a) if isinstance(a, torch.fx.Node) else a for a in node.args)
    if any(a is None and isinstance(n, torch.fx.Node) for a, n in zip(args, node.args)):
        return None
    if not all(isinstance(size, int) for a in args if isinstance(a, Tensor) for size in a.shape):
        return None
    return args
