"""The canonical GLA op: `laplace::gla`, and its public wrapper `gla`.

The op is the token-by-token recurrence (docs/DESIGN.md section 3.1), kept as one node
in Dynamo and AOT graphs so that the re-tiling pass can find it:

    S_t = diag(exp(gk_t)) S_{t-1} + k_t^T v_t
    o_t = scale * q_t S_t

It is the reference every other implementation is tested against. Its backward
is the explicit reverse-time recurrence (a second op), so a graph that keeps
the op (a declined site) still has a traceable backward.

Layout follows flash-linear-attention: q, k, gk ``[B, T, H, K]``, v
``[B, T, H, V]``, state ``[B, H, K, V]``. Computation is fp32 whatever the
input dtype; the output is cast back to the input dtype, the final state is
fp32 (as in fla).
"""

from __future__ import annotations

import torch
from torch import Tensor

from laplace_passes.infra.checks import check_flag, check_gla_args, resolve_scale
from laplace_passes.infra.targets import RECURRENT_READOUTS

# `origin` names where a site came from ("laplace.gla", "fla.chunk_gla", ...),
# so the report can answer "which of my calls was re-tiled?".
LAPLACE_ORIGIN = "laplace.gla"


@torch.library.custom_op("laplace::check_gates", mutates_args=())
def check_gates(gk: Tensor, origin: str = LAPLACE_ORIGIN) -> Tensor:
    """Return a copy of `gk`, raising ValueError when a gate is positive or NaN.

    `gk` is the log of a per-channel decay in (0, 1], so it must be <= 0. A
    positive value makes exp(G) grow without bound inside a chunk and the
    result silently becomes inf/NaN; we refuse it instead. It is an op (not a
    Python check) so that it also runs inside compiled graphs. `origin` is the
    site's (the call, or how a recognised loop was written), for the message.
    """
    # One pass: the largest gate is NaN when any gate is (amax propagates NaN), and NaN <= 0 is False.
    ok = gk.numel() == 0 or bool(gk.amax() <= 0)
    if not ok:
        found = "NaN" if bool(gk.isnan().any()) else gk.max().item()
        raise ValueError(_gate_error(found, origin))
    return gk.clone()


def _gate_error(found, origin: str) -> str:
    if is_call_name(origin):  # the user called a GLA function and gave it gk
        return ("gk must be <= 0 everywhere (it is the log of a decay in (0, 1]); "
                f"found {found} (use F.logsigmoid(x) or -F.softplus(x) to produce gates)")
    # A loop the user wrote was recognised as GLA ("GLA in plain PyTorch" in docs/passes.md): they never wrote
    # a gk, so the message speaks of their decay and of how to keep their loop.
    # The check sees the gates, log(decay): NaN there is a NaN decay or the log of a negative one (tanh, a cosine).
    decay = ("a negative or NaN decay (its log, the gate, is NaN)" if found == "NaN"  # exp: inf past its range
             else f"a decay of {float(torch.tensor(found).exp()):.6g} (log {found:.6g})")
    return (f"a recognised GLA loop ({origin}) met {decay} at run time; the GLA op it was rewritten into "
            "needs every decay in [0, 1] and no NaN, which the graph does not show. Compile with "
            "options={'recognise_gla': False} to run the loop as written, or give decays that stay in [0, 1] "
            "(e.g. a sigmoid)")


def is_call_name(origin: str) -> bool:
    """Whether a site's origin names a function the user called ("laplace.gla", "fla.chunk_gla", with what the
    call was made of in brackets: "fla.chunk_gla[cu_seqlens]", "fla.chunk_gsa[slots]"), not a loop recognition
    rewrote (its origin is the loop's form in words)."""
    return origin.split("[", 1)[0].replace(".", "_").isidentifier()


@check_gates.register_fake
def _check_gates_fake(gk: Tensor, origin: str = LAPLACE_ORIGIN) -> Tensor:
    return torch.empty_like(gk)


def _check_gates_backward(ctx, grad: Tensor):
    return grad, None


check_gates.register_autograd(_check_gates_backward)


def _states(k, v, gk, initial_state):
    """S_0 (the initial state, zeros by default), then S_1 ... S_T, in fp32; and exp(gk)."""
    B, T, H, K = k.shape
    kf, vf = k.float(), v.float()
    decay = gk.float().exp()
    h = k.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32) if initial_state is None else initial_state.float()
    states = [h]
    for t in range(T):
        h = h * decay[:, t, :, :, None] + kf[:, t, :, :, None] * vf[:, t, :, None, :]
        states.append(h)
    return states, decay


def _recurrence_states(q, k, v, gk, initial_state):
    """Run the recurrence in fp32; return (states [T+1, B, H, K, V], decay)."""
    states, decay = _states(k, v, gk, initial_state)
    return torch.stack(states), decay


def check_readout(readout: str, name: str = "readout") -> None:
    if readout not in RECURRENT_READOUTS:
        raise ValueError(f"{name} must be one of {RECURRENT_READOUTS}, got {readout!r}")


def gla_recurrence(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Tensor | None, scale: float,
    readout: str = "matmul",
) -> tuple[Tensor, Tensor]:
    """The token recurrence in standard ops, one state update per token: (o in q's dtype, final state fp32).

    What `laplace::gla` computes, written step by step: the re-tiling pass
    gives it to short sites (decode), where tracing it makes T straight-line
    state updates instead of a padded chunk. Gates are not checked here.

    Batch and heads are folded into one dimension and every input is split
    per token once (`unbind`), so a traced token is four ops (two products,
    a sum, a [1, K] @ [K, V] matmul) instead of a dozen index and einsum
    ops: a 64-token eval step traces several times faster.

    `readout`: "matmul" reads each output as that [1, K] @ [K, V] product,
    bit for bit the reference op's result; "reduce" as (q_t^T * S) summed
    over K (five ops per token), which a fusing compiler puts in the state
    update's kernel, so the state is read once per token instead of twice:
    the `cpu` target's choice (`HardwareTarget.recurrent_readout`). Sums in
    another order, so equal to the reference op within fp32 rounding.
    """
    check_readout(readout)
    B, T, H, K = q.shape
    V = v.shape[-1]

    def per_token(x: Tensor, rows: int, cols: int) -> tuple[Tensor, ...]:
        # [B, T, H, D] -> T tensors [B*H, rows, cols] (one of rows/cols is D, the other 1).
        return _contiguous(x.float()).transpose(1, 2).reshape(B * H, T, rows, cols).unbind(1)

    h = (q.new_zeros(B * H, K, V, dtype=torch.float32) if initial_state is None
         else initial_state.float().reshape(B * H, K, V))
    outputs = []
    reduce = readout == "reduce"
    queries = per_token(q, K, 1) if reduce else per_token(q, 1, K)
    decays = per_token(gk.float().exp(), K, 1)
    for q_t, k_t, v_t, decay_t in zip(queries, per_token(k, K, 1), per_token(v, 1, V), decays):
        h = h * decay_t + k_t * v_t
        outputs.append((q_t * h).sum(1, keepdim=True) if reduce else torch.bmm(q_t, h))
    if T:
        o = torch.cat(outputs, dim=1).view(B, H, T, V).transpose(1, 2)
    else:
        o = q.new_zeros(B, 0, H, V, dtype=torch.float32)
        # No token updated the state, so h is still a view of the caller's initial state: a final
        # state returned as that view would let an in-place update of it (a decode buffer) write the caller's.
        h = h.clone()
    return (o * scale).to(q.dtype), h.view(B, H, K, V)


def _contiguous(x: Tensor) -> Tensor:
    """`x` in a layout its fake tensor and its run-time value agree on, before it is transposed and reshaped.

    Traced (AOT Autograd), a reshape becomes a view or a copy by the fake
    tensor's strides, and the eager inner compiler then runs that choice on
    the real tensor. Some CPU kernels return a contiguous tensor where their
    meta function keeps the input's strides (``F.logsigmoid`` of a transposed
    tensor): the transposed fake is then contiguous, a view of it is traced,
    and that view fails on the real, transposed tensor. A tensor the fake
    calls non-contiguous is copied (contiguous on both sides); a contiguous
    one costs nothing.
    """
    return x.contiguous()


@torch.library.custom_op("laplace::gla", mutates_args=())
def gla_op(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Tensor | None, scale: float, origin: str
) -> tuple[Tensor, Tensor]:
    """Token-by-token GLA. Returns (o in q's dtype, final state in fp32)."""
    check_gates(gk)
    states, _ = _recurrence_states(q, k, v, gk, initial_state)
    o = torch.einsum("bthk,tbhkv->bthv", q.float(), states[1:]) * scale
    final_state = states[-1] if q.shape[1] else states[-1].clone()  # T = 0: an op's output may not alias an input
    return o.to(q.dtype), final_state


@gla_op.register_fake
def _gla_fake(q, k, v, gk, initial_state, scale, origin):
    B, T, H, K = q.shape
    V = v.shape[-1]
    return q.new_empty(B, T, H, V), q.new_empty(B, H, K, V, dtype=torch.float32)


@torch.library.custom_op("laplace::gla_backward", mutates_args=())
def gla_backward_op(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Tensor | None, scale: float,
    grad_o: Tensor, grad_final_state: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Reverse-time recurrence: gradients of (o, final state) w.r.t. q, k, v, gk, initial_state.

    With dS the gradient reaching S_t from later tokens:
        dS_t   = dS + scale * q_t^T do_t
        dq_t   = scale * S_t do_t        dk_t = dS_t v_t       dv_t = k_t dS_t
        dgk_t  = exp(gk_t) * rowsum(S_{t-1} * dS_t)
        dS     = diag(exp(gk_t)) dS_t     (the gradient of S_{t-1})
    """
    states, decay = _recurrence_states(q, k, v, gk, initial_state)
    qf, kf, vf = q.float(), k.float(), v.float()
    do = grad_o.float()
    T = q.shape[1]
    dS = grad_final_state.float().clone()
    dq, dk, dv, dgk = (torch.empty_like(t, dtype=torch.float32) for t in (q, k, v, gk))
    for t in range(T - 1, -1, -1):
        dS = dS + scale * qf[:, t, :, :, None] * do[:, t, :, None, :]
        dq[:, t] = scale * torch.einsum("bhkv,bhv->bhk", states[t + 1], do[:, t])
        dk[:, t] = torch.einsum("bhkv,bhv->bhk", dS, vf[:, t])
        dv[:, t] = torch.einsum("bhkv,bhk->bhv", dS, kf[:, t])
        dgk[:, t] = decay[:, t] * (states[t] * dS).sum(-1)
        dS = dS * decay[:, t, :, :, None]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dgk.to(gk.dtype), dS


@gla_backward_op.register_fake
def _gla_backward_fake(q, k, v, gk, initial_state, scale, grad_o, grad_final_state):
    B, T, H, K = q.shape
    V = v.shape[-1]
    state = q.new_empty(B, H, K, V, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(gk), state


def _gla_setup_context(ctx, inputs, output):
    q, k, v, gk, initial_state, scale, _origin = inputs
    ctx.save_for_backward(q, k, v, gk, initial_state)
    ctx.scale = scale
    ctx.has_initial_state = initial_state is not None


def _gla_backward(ctx, grad_o, grad_final_state):
    q, k, v, gk, initial_state = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(q, shape=(*q.shape[:3], v.shape[-1]))
    if grad_final_state is None:
        B, _, H, K = q.shape
        grad_final_state = q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32)
    dq, dk, dv, dgk, dh0 = gla_backward_op(q, k, v, gk, initial_state, ctx.scale, grad_o, grad_final_state)
    if ctx.has_initial_state:
        dh0 = dh0.to(initial_state.dtype)
    else:
        dh0 = None
    return dq, dk, dv, dgk, dh0, None, None


gla_op.register_autograd(_gla_backward, setup_context=_gla_setup_context)


def refuse_double_backward(op_name: str):
    """An autograd formula for a backward op that says, by name, that it has none.

    Without one, a gradient of a gradient (`create_graph=True`, then a second
    backward) fails with torch's "no autograd formula was registered" naming
    an internal op. Only that second backward raises: a first backward with
    `create_graph=True` that never differentiates through the op works.
    """

    def backward(ctx, *grads):
        raise NotImplementedError(
            f"laplace_passes: double backward (a gradient of a gradient) through {op_name} is not supported: "
            "its backward has no derivative of its own"
        )

    return backward


gla_backward_op.register_autograd(refuse_double_backward("laplace_passes.gla"))


def gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gk: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Gated linear attention with fla's layout and semantics.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; gk: ``[B, T, H, K]``, the log
            of the per-channel decay (must be <= 0).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` or None (zeros).
        output_final_state: also return the state after the last token (fp32).

    Returns ``(o, final_state or None)``; ``o`` has v's shape and q's dtype.

    Eagerly this runs the token-by-token recurrence (the reference). Under
    ``torch.compile(backend="laplace")`` the call is one graph node, which the
    re-tiling pass replaces by `chunked_gla` at the target's chunk size.
    """
    check_gla_args(q, k, v, gk, initial_state, scale)
    check_flag("output_final_state", output_final_state)
    o, final_state = gla_op(q, k, v, gk, initial_state, resolve_scale(scale, q.shape[-1]), LAPLACE_ORIGIN)
    return o, (final_state if output_final_state else None)
