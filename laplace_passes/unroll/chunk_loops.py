"""Expanding GLA chunk-loop ops into straight-line ATen code.

NOTE [unrolling a chunk-loop op: before and after]
Before (an AOT forward graph, T = 2048, trn2):

    chunked_gla = torch.ops.laplace.chunked_gla.default(view_1, view_3, getitem_2, check_gates, None, 0.177, 128, 16, False)
    getitem_3 = chunked_gla[0]

After: the op's body (`chunked_forward`, or `chunked_backward` for
`laplace::chunked_gla_backward` in the backward graph) traced with make_fx at
these static shapes, so its loop over the 16 chunks is 16 copies of the
state update, and copied in place of the node:

    constant_pad_nd = aten.constant_pad_nd(view_1, [0, 0, 0, 0, 0, 0]) ...
    exp = aten.exp(threshold) ...                                              # token decays
    mul_20 = aten.mul(select_4, zeros); add_2 = aten.add(mul_20, select_5)      # chunk 0
    ...                                                                        # chunks 1..15
    getitem_3 = the traced output

Where the target keeps the state recurrence whole (`HardwareTarget.chunk_recurrence`
"op", the cpu target, with an inner compiler that runs torch ops), the trace
calls `laplace::chunk_recurrence` instead of unrolling it: the 16 copies above
are one node, and the graph has the same nodes at any T:

    chunk_recurrence = torch.ops.laplace.chunk_recurrence.default(bmm, unsqueeze_3, None, False)

Traces are cached per signature and input layout, so the layers of a model share one trace
(and, within one fake mode, the graphs of one Dynamo graph: NOTE [traces
shared within a fake mode] below).
A symbolic batch size is traced as it is: the body's shapes read it from
its inputs (`sym_size` nodes), so one graph takes every batch. Any other
symbolic size (T, heads, head dims) declines the op: it stays in the graph
as a runtime loop, which takes any size (NOTE [dynamic T] in
`laplace_passes.fx.retile`).
The trace runs in the host graph's fake mode, so every new node carries a
fake value in `meta["val"]` like the rest of an AOT graph.

NOTE [traces shared within a fake mode]
A training step's backward graph is passed through the passes twice in
one process: as it is sent to the helper process ahead of its compile and
as it compiles (NOTE [backward graphs generated in the helper process] in
`laplace_passes/driver/backward_ahead.py`), each time with a pass of its
own. Tracing the backward body is most of those passes (tiny at T = 2048
on trn2: about 1.3 of 2.4 s), and its result is the same both times: the
same op, arguments of the same signature, the same fake mode (one per
Dynamo graph: its forward and backward share it) and the same
decompositions. So traces are kept across expanders too, for the last
`SHARED_TRACES` (op, signature, input strides, recurrence, decompositions,
fake mode): a trace's fake values belong to its fake mode, and a graph of
another mode traces its own.

NOTE [traces reused across fake modes]
A body traced at static shapes is the same graph in every fake mode; only
its fake values belong to one. A later compile of the same shapes in
another mode (the model compiled again, `inspect` or `preflight` then
`compile`, a model in eval and then in train mode, a Dynamo recompile
that keeps the GLA shapes) would trace it again at about a millisecond a
node. The last `TRACES_ACROSS_MODES` static-shape traces are kept without
their values, under the same key as above less the mode; a hit copies the
graph and runs it on the new mode's fake inputs (`GraphsAcrossModes`),
about a third of a trace. The key also holds what else a trace depends on
(`trace_state`: AOT's Python dispatcher, on while `inspect` traces a
backward and off when `.backward()` compiles one, records views otherwise;
CPU autocast). A symbolic batch is traced with the host's own
symbols and is never reused in another mode.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from laplace_passes.ops.chunked import CHUNK_LOOP_OPS, chunk_recurrence_op
from laplace_passes.ops.chunked_backward import chunked_backward
from laplace_passes.ops.chunked_forward import ChunkLayout, chunk_recurrence, chunked_forward
from laplace_passes.infra.fx_helpers import (
    GraphsAcrossModes, GraphsByFakeMode, fake_tensor, fake_value, has_fake_value, provenance_of, trace_state,
)
from laplace_passes.infra.pass_base import Declined
from laplace_passes.unroll.inline import inline_graph, replace_tuple_result

# The body each chunk-loop op runs (given what runs its recurrence), and the name the report gives its loop.
_BODIES: dict = {
    CHUNK_LOOP_OPS[0]: ("laplace.chunked_gla",
                        lambda *args, recurrence: chunked_forward(*args[:-1], recurrence=recurrence)),  # no save_residuals
    CHUNK_LOOP_OPS[1]: ("laplace.chunked_gla_backward",
                        lambda *args, recurrence: chunked_backward(*args, recurrence=recurrence)),
}
# What the traced body's recurrence over chunks becomes (`HardwareTarget.chunk_recurrence`).
_RECURRENCES = {"unrolled": chunk_recurrence, "op": chunk_recurrence_op}
# Where each op's (scale, chunk_size, sub_chunk_size) arguments begin: after its tensors
# (q, k, v, gk, initial_state; the backward's grad_o, grad_final_state, states, scores).
_SETTINGS_AT = {CHUNK_LOOP_OPS[0]: 5, CHUNK_LOOP_OPS[1]: 9}


def is_chunk_loop(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _BODIES


def loop_kind(node: torch.fx.Node) -> str:
    return loop_name(node.target)


def loop_name(op) -> str:
    """What the report calls a chunk-loop op's loop: "laplace.chunked_gla", "laplace.chunked_gla_backward"."""
    return _BODIES[op][0]


def body_of(op, args: Sequence, is_tensor: Sequence[bool], recurrence: str) -> Callable:
    """The op's body as a function of its tensor arguments (`is_tensor`), the other `args` bound.

    `recurrence`: "unrolled" (one state update per chunk) or "op" (one `laplace::chunk_recurrence`).
    """
    return _bind_constants(functools.partial(_BODIES[op][1], recurrence=_RECURRENCES[recurrence]), args, is_tensor)


def chunk_count(node: torch.fx.Node) -> int:
    """The loop's trip count (chunks); Declined when it is not known statically."""
    q = fake_tensor(node.args[0])
    if q is None:
        raise Declined("no shape information on q")
    T = q.shape[1]
    if not isinstance(T, int):
        raise Declined(f"kept as a runtime loop: T is dynamic ({T}); the op counts its chunks at run time")
    dynamic = [f"{s}" for s in _sizes_beyond_batch(node) if not isinstance(s, int)]
    if dynamic:
        # One copy of the body per chunk needs the chunk count; the op itself takes any size.
        raise Declined(f"kept as a runtime loop: a dynamic size other than the batch ({dynamic[0]}); the body "
                       "is traced with a symbolic batch only")
    at = _SETTINGS_AT[node.target]
    scale, chunk_size, sub_chunk_size = node.args[at : at + 3]
    return ChunkLayout.plan(T, chunk_size, sub_chunk_size).n_chunks


def _sizes_beyond_batch(node: torch.fx.Node) -> list:
    """Every size of the op's tensor arguments but the leading batch dimension (the only one traced symbolically)."""
    return [size for a in node.args for size in getattr(fake_tensor(a), "shape", ())[1:]]


class ChunkLoopExpander:
    """Traces each chunk-loop op's body once per signature and inlines it.

    `recurrence`: "unrolled" (one state update per chunk) or "op" (the
    recurrence kept as one `laplace::chunk_recurrence` node).
    """

    def __init__(self, decompositions: dict | None = None, recurrence: str = "unrolled") -> None:
        if recurrence not in _RECURRENCES:
            raise ValueError(f"recurrence must be one of {tuple(_RECURRENCES)}, got {recurrence!r}")
        self.decompositions = decompositions or {}
        self.recurrence = recurrence
        self._traces: dict[tuple, torch.fx.GraphModule] = {}
        self._shared_key = (recurrence, frozenset(self.decompositions.items()))

    def expand(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
        """Replace `node` by its traced body (Declined when an input has no shape to trace it with)."""
        tensor_args = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if not all(has_fake_value(a) for a in tensor_args):
            raise Declined("an input has no fake value to trace the loop body with")
        traced = self._trace(node)
        with gm.graph.inserting_before(node):
            outputs = inline_graph(gm, traced, tensor_args, provenance_of(node))
        replace_tuple_result(gm.graph, node, outputs)

    def _trace(self, node: torch.fx.Node) -> torch.fx.GraphModule:
        fakes = [fake_value(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
        tensors = [f for f in fakes if isinstance(f, torch.Tensor)]
        key = (node.target, tuple(_signature(f) for f in fakes), tuple(map(_layout, tensors)))
        if key not in self._traces:
            fake_mode, shared_key = detect_fake_mode(tensors), (*key, self._shared_key)
            traced = _SHARED.get(fake_mode, shared_key)
            if traced is None:
                traced = self._traced_or_reused(node, tensors, shared_key)
                _SHARED.put(fake_mode, shared_key, traced)
            self._traces[key] = traced
        return self._traces[key]

    def _traced_or_reused(self, node: torch.fx.Node, tensors: list[torch.Tensor], key: tuple) -> torch.fx.GraphModule:
        """The body traced on `tensors`, or at static shapes a trace of another fake mode given their values
        (NOTE [traces reused across fake modes])."""
        static = all(isinstance(size, int) for t in tensors for size in t.shape)
        key = (*key, trace_state())
        reused = _ACROSS_MODES.get(key, tensors) if static else None
        if reused is not None:
            return reused
        body = body_of(node.target, node.args, [isinstance(a, torch.fx.Node) for a in node.args], self.recurrence)
        traced = self._traced(body, tensors, static)
        if static:
            _ACROSS_MODES.put(key, traced)
        return traced

    def _traced(self, body: Callable, tensors: list[torch.Tensor], static: bool) -> torch.fx.GraphModule:
        """`body` traced on the host graph's fake tensors, in their fake mode.

        Static shapes: make_fx's fake tracing. A symbolic batch: traced as
        real tensors inside the host's fake mode, so the sizes come from the
        inputs (`sym_size` nodes) with the host's own symbols.
        """
        if static:
            return make_fx(body, decomposition_table=self.decompositions, tracing_mode="fake")(*tensors)
        with detect_fake_mode(tensors):
            return make_fx(body, decomposition_table=self.decompositions, tracing_mode="real")(*tensors)


SHARED_TRACES = 4  # traces kept across expanders (NOTE [traces shared within a fake mode])
_SHARED = GraphsByFakeMode(SHARED_TRACES)
TRACES_ACROSS_MODES = 8  # static-shape traces kept for any fake mode (NOTE [traces reused across fake modes])
_ACROSS_MODES = GraphsAcrossModes(TRACES_ACROSS_MODES)


def _layout(tensor: torch.Tensor) -> tuple:
    """Strides and offset, part of a trace's key: the trace records the views and copies its inputs'
    layout calls for (a `contiguous` of a contiguous input records nothing), so a site reuses only a trace
    made on inputs laid out as its own."""
    return tuple(map(str, tensor.stride())), str(tensor.storage_offset())


def _signature(value) -> tuple:
    if isinstance(value, torch.Tensor):  # a symbolic size by its name: SymInts do not hash
        return ("tensor", tuple(map(str, value.shape)), value.dtype, str(value.device))
    return ("value", value)


def _bind_constants(body: Callable, args: Sequence, is_tensor: Sequence[bool]) -> Callable:
    """`body` as a function of the op's tensor arguments only (None and numbers bound)."""
    constants = [None if t else a for a, t in zip(args, is_tensor)]

    def traced_body(*tensors):
        supplied = iter(tensors)
        return body(*(next(supplied) if t else c for t, c in zip(is_tensor, constants)))

    return traced_body
