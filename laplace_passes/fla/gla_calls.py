"""fla's GLA functions as `laplace::gla` sites, with fla's full calling convention.

Each call becomes one `laplace::gla` node whose `origin` names the fla
function, so the re-tiling pass finds it and picks its form (chunked, or the
recurrent step for short sequences and decode). fla's semantics are kept:
scale K**-0.5 by default; the state ``[N, H, K, V]``, or ``[N, H, V, K]`` with
`state_v_first=True` (what fla 0.6.0's `GatedLinearAttention` layer always
passes); final state in fp32; the `(o, final_state or None)` tuple. Packed
variable-length batches (`cu_seqlens`) become one site over the packed batch
(see `laplace_passes.fla.varlen`). A call the op cannot express (value gates
`gv`, `reverse`, unknown keywords) is left to fla and reported
(`laplace_passes.fla.not_replaced`).
"""

from __future__ import annotations

import torch

from laplace_passes.infra.checks import resolve_scale
from laplace_passes.fla.not_replaced import leave_to_fla
from laplace_passes.fla.varlen import packed_gla
from laplace_passes.ops.gla import gla_op


def gla_site(q, k, v, g, *, scale, initial_state, output_final_state, state_v_first, cu_seqlens, origin):
    """One site with fla's conventions; returns (o, final_state or None)."""
    scale = resolve_scale(scale, q.shape[-1])
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    if cu_seqlens is not None:
        o, final_state = packed_gla(q, k, v, g, scale, initial_state, cu_seqlens, output_final_state,
                                    f"{origin}[cu_seqlens]")
    else:
        o, final_state = gla_op(q, k, v, g, initial_state, scale, origin)
    if not output_final_state:
        return o, None
    return o, (final_state.transpose(-1, -2) if state_v_first else final_state)


def naive_recurrent_gla_substitute(original):
    def naive_recurrent_gla(q, k, v, gk, initial_state=None, output_final_state=False):
        return gla_site(q, k, v, gk, scale=None, initial_state=initial_state, output_final_state=output_final_state,
                        state_v_first=False, cu_seqlens=None, origin="fla.naive_recurrent_gla")

    return naive_recurrent_gla


def chunk_gla_substitute(original):
    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
                  cu_seqlens=None, cu_seqlens_cpu=None):
        return gla_site(q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                        state_v_first=state_v_first, cu_seqlens=cu_seqlens, origin="fla.chunk_gla")

    return chunk_gla


def fused_recurrent_gla_substitute(original):
    def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                            reverse=False, state_v_first=False, cu_seqlens=None, **kwargs):
        if "transpose_state_layout" in kwargs:  # fla's deprecated name for state_v_first
            kwargs = dict(kwargs)
            state_v_first = state_v_first or kwargs.pop("transpose_state_layout")
        reason = _unsupported(gv, reverse, kwargs)
        if reason is not None:
            arguments = dict(gk=gk, gv=gv, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, reverse=reverse, state_v_first=state_v_first,
                             cu_seqlens=cu_seqlens, **kwargs)
            return leave_to_fla(original, "fla.fused_recurrent_gla", reason, (q, k, v), arguments,
                                lambda: _placeholder(q, v, initial_state, output_final_state, cu_seqlens))
        if gk is None:  # no key gates: no decay
            gk = q.new_zeros(q.shape, dtype=q.dtype)
        return gla_site(q, k, v, gk, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                        state_v_first=state_v_first, cu_seqlens=cu_seqlens, origin="fla.fused_recurrent_gla")

    return fused_recurrent_gla


def _placeholder(q, v, initial_state, output_final_state, cu_seqlens):
    """Outputs shaped like fla's: o [B, T, H, V] in q's dtype, and the final state if asked."""
    o = q.new_zeros(*q.shape[:3], v.shape[-1])
    if not output_final_state:
        return o, None
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = q.new_zeros(N, q.shape[2], q.shape[3], v.shape[-1], dtype=torch.float32)
    return o, state if initial_state is None else state.view(initial_state.shape)


def _unsupported(gv, reverse, kwargs) -> str | None:
    if gv is not None:
        return "value gates (gv) have no laplace::gla form"
    if reverse:
        return "reverse=True (right-to-left recurrence) has no laplace::gla form"
    if kwargs:
        return f"unknown keyword arguments {sorted(kwargs)}"
    return None


SUBSTITUTE_FACTORIES = {
    "fla.ops.gla.naive.naive_recurrent_gla": naive_recurrent_gla_substitute,
    "fla.ops.gla.chunk.chunk_gla": chunk_gla_substitute,
    "fla.ops.gla.fused_recurrent.fused_recurrent_gla": fused_recurrent_gla_substitute,
}
