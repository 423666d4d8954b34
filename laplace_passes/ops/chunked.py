"""Chunked GLA: `chunked_gla`, and the GLA chunk-loop ops that carry it through the compiler.

Two custom ops carry the chunked computation through Dynamo and AOT Autograd
as single nodes ("GLA chunk-loop ops"), so the backward is the explicit one
this project wrote, not whatever autograd would save:

    laplace::chunked_gla(q, k, v, gk, initial_state?, scale, chunk_size, sub_chunk_size, save_residuals)
        -> (o, final_state, states, scores)                   body: chunked_forward.chunked_forward
    laplace::chunked_gla_backward(q, k, v, gk, initial_state?, grad_o, grad_final_state?, states?, scores?,
                                  scale, chunk_size, sub_chunk_size)
        -> (dq, dk, dv, dgk, dh0)                             body: chunked_backward.chunked_backward

The first op's autograd calls the second, saving q, k, v, gk and
initial_state, and with `save_residuals` the two residuals the backward
would otherwise recompute: the states entering each chunk and tril(A) (see
NOTE [explicit chunked backward]; `chunked_gla_saved_bytes` counts them).
Its residual outputs are not differentiable. AOT Autograd puts the
forward op in the forward graph and the backward op in the backward graph;
the unroll pass (`laplace_passes.unroll`) then replaces each by a static
trace of its body: straight-line ATen code with one step per chunk.

Run eagerly, each op runs its body directly (a Python loop over chunks).
The mathematics and its numerical-stability measures: `chunked_forward`
(NOTE [stable intra-chunk scores], NOTE [flushing tiny decays]) and
`chunked_backward` (NOTE [explicit chunked backward]).
"""

from __future__ import annotations

import torch
from torch import Tensor

from laplace_passes.infra.checks import check_chunk_size, check_flag, check_gla_args, resolve_scale
from laplace_passes.ops.chunked_forward import DEFAULT_SUB_CHUNK, ChunkLayout, chunk_plan, chunk_recurrence, chunked_forward
from laplace_passes.ops.chunked_backward import chunked_backward
from laplace_passes.infra.fx_helpers import tensor_bytes
from laplace_passes.ops.gla import check_gates, refuse_double_backward


@torch.library.custom_op("laplace::chunked_gla", mutates_args=())
def chunked_gla_op(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Tensor | None,
    scale: float, chunk_size: int, sub_chunk_size: int, save_residuals: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Chunked GLA forward: (o in q's dtype, final state, states entering each chunk, tril(A), in fp32).

    Gates are not checked here. `save_residuals` says only what the autograd
    formula keeps: the residuals are returned either way (computed anyway).
    """
    return chunked_forward(q, k, v, gk, initial_state, scale, chunk_size, sub_chunk_size)


@chunked_gla_op.register_fake
def _chunked_gla_fake(q, k, v, gk, initial_state, scale, chunk_size, sub_chunk_size, save_residuals):
    B, T, H, K = q.shape
    V = v.shape[-1]
    layout = ChunkLayout.plan(T, chunk_size, sub_chunk_size)  # T may be a SymInt
    N, rows = layout.n_chunks, layout.padded_chunk
    return (q.new_empty(B, T, H, V), q.new_empty(B, H, K, V, dtype=torch.float32),
            q.new_empty(B, H, N, K, V, dtype=torch.float32), q.new_empty(B, H, N, rows, rows, dtype=torch.float32))




@torch.library.custom_op("laplace::chunked_gla_backward", mutates_args=())
def chunked_gla_backward_op(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Tensor | None,
    grad_o: Tensor, grad_final_state: Tensor | None, states: Tensor | None, scores: Tensor | None,
    scale: float, chunk_size: int, sub_chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The explicit backward: (dq, dk, dv, dgk in the inputs' dtypes, dh0 in fp32); residuals None are recomputed."""
    return chunked_backward(
        q, k, v, gk, initial_state, grad_o, grad_final_state, states, scores, scale, chunk_size, sub_chunk_size
    )


@chunked_gla_backward_op.register_fake
def _chunked_gla_backward_fake(q, k, v, gk, initial_state, grad_o, grad_final_state, states, scores,
                               scale, chunk_size, sub_chunk_size):
    B, _, H, K = q.shape
    dh0 = q.new_empty(B, H, K, v.shape[-1], dtype=torch.float32)
    # Contiguous, as the body returns them whatever the inputs' strides (empty_like would keep a transposed q's).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), gk.new_empty(gk.shape), dh0


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, gk, initial_state, scale, chunk_size, sub_chunk_size, save_residuals = inputs
    _, _, states, scores = output
    ctx.mark_non_differentiable(states, scores)
    residuals = (states, scores) if save_residuals else (None, None)
    ctx.save_for_backward(q, k, v, gk, initial_state, *residuals)
    ctx.settings = (scale, chunk_size, sub_chunk_size)


def _backward(ctx, grad_o: Tensor | None, grad_final_state: Tensor | None, _grad_states, _grad_scores):
    q, k, v, gk, initial_state, states, scores = ctx.saved_tensors
    if grad_o is None:  # only the final state was used
        grad_o = q.new_zeros(*q.shape[:3], v.shape[-1])
    dq, dk, dv, dgk, dh0 = chunked_gla_backward_op(
        q, k, v, gk, initial_state, grad_o, grad_final_state, states, scores, *ctx.settings
    )
    d_initial = None if initial_state is None else dh0.to(initial_state.dtype)
    return dq, dk, dv, dgk, d_initial, None, None, None, None


chunked_gla_op.register_autograd(_backward, setup_context=_setup_context)
chunked_gla_backward_op.register_autograd(refuse_double_backward("laplace_passes.chunked_gla"))

CHUNK_LOOP_OPS = (torch.ops.laplace.chunked_gla.default, torch.ops.laplace.chunked_gla_backward.default)


@torch.library.custom_op("laplace::chunk_recurrence", mutates_args=())
def chunk_recurrence_op(terms: Tensor, decay: Tensor, start: Tensor | None, reverse: bool) -> tuple[Tensor, Tensor]:
    """`chunk_recurrence` as one op: (the state entering each chunk [B, H, N, K, V], the state after the last).

    What the unroll pass leaves in place of the unrolled recurrence where the
    target keeps it whole (`HardwareTarget.chunk_recurrence`, the cpu target):
    one node whatever the number of chunks, doing the Python loop's
    arithmetic (a product, then a sum, per chunk), so the same values bit
    for bit; fp32 inputs take `_recurrence_in_place`. It appears in ATen
    graphs only, after autograd, and has no autograd formula of its own.
    """
    if terms.dtype == decay.dtype == torch.float32 and terms.shape[2] > 0:
        return _recurrence_in_place(terms, decay, start, reverse)
    entering, final = chunk_recurrence(terms, decay, start, reverse)
    return entering, (final.clone() if final is start else final)  # no chunks: no output may alias an input


def _recurrence_in_place(terms: Tensor, decay: Tensor, start: Tensor | None, reverse: bool) -> tuple[Tensor, Tensor]:
    """`chunk_recurrence`, each state written once, straight into its chunk's slot of the stacked result.

    The loop's `decay * h + terms` as a product into the slot and a sum in
    place: the same two roundings, no temporaries, and no stack copying N
    states at the end (on cpu that copy and the temporaries took about a
    third of the op's time).
    """
    B, H, N, K, V = terms.shape
    entering = terms.new_empty(B, H, N, K, V)
    order = range(N - 1, -1, -1) if reverse else range(N)
    first = entering[:, :, order[0]]
    if start is None:
        first.zero_()
    else:
        first.copy_(start)  # a bf16 start widens exactly, as the loop's start.float()
    previous, step = first, order[0]
    for n in order[1:]:
        slot = entering[:, :, n]
        torch.mul(decay[:, :, step], previous, out=slot)
        slot.add_(terms[:, :, step])
        previous, step = slot, n
    return entering, decay[:, :, step] * previous + terms[:, :, step]


@chunk_recurrence_op.register_fake
def _chunk_recurrence_fake(terms, decay, start, reverse):
    B, H, N, K, V = terms.shape
    return terms.new_empty(B, H, N, K, V), terms.new_empty(B, H, K, V)


def chunked_gla_saved_bytes(q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Tensor | None,
                            residuals: tuple[Tensor, Tensor] | None = None) -> int:
    """Bytes `laplace::chunked_gla` keeps for its backward: its inputs, and the residuals when it saves them.

    Accepts fake or meta tensors: only shapes and dtypes are read (symbolic
    sizes at the traced example's values).
    """
    kept = [q, k, v, gk] + ([initial_state] if initial_state is not None else []) + list(residuals or ())
    return sum(tensor_bytes(t) for t in kept)


def chunked_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gk: Tensor,
    *,
    chunk_size: int = 128,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    sub_chunk_size: int = DEFAULT_SUB_CHUNK,
    save_residuals: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """GLA computed chunk by chunk; same contract as `laplace_passes.gla`.

    `chunk_size` is the tokens per chunk (the target's partition count when the
    re-tiling pass installs this); `sub_chunk_size` the rows of the leaves of
    the intra-chunk halving, computed elementwise (NOTE [stable intra-chunk
    scores] in `laplace_passes.ops.chunked_forward`; 4 runs fastest on a CPU). Any T, K,
    V; inputs in fp32, bf16 or fp16, computed in fp32, output in the input
    dtype, final state in fp32; an empty batch, heads or sequence gives the
    reference's empty result. The backward is the explicit reverse
    recurrence over chunks (`laplace_passes.ops.chunked_backward`); with
    `save_residuals` (the default, as the `cpu` target) the forward keeps the
    states entering each chunk and tril(A) for it, B*H*N*(K*V + C'*C') fp32
    values, where without them the backward recomputes both (less memory,
    about 1.1x slower on a CPU: `benchmarks/bench_gla.py --recompute-residuals`).
    """
    check_gla_args(q, k, v, gk, initial_state, scale)
    check_chunk_size("chunk_size", chunk_size)
    check_chunk_size("sub_chunk_size", sub_chunk_size)
    check_flag("output_final_state", output_final_state)
    check_flag("save_residuals", save_residuals)
    scale = resolve_scale(scale, q.shape[-1])
    o, final_state, _, _ = chunked_gla_op(
        q, k, v, check_gates(gk), initial_state, scale, chunk_size, sub_chunk_size, save_residuals
    )
    return o, (final_state if output_final_state else None)


__all__ = ["CHUNK_LOOP_OPS", "chunk_plan", "chunked_gla", "chunked_gla_saved_bytes"]
