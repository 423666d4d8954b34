"""fla's other GLA-family recurrences as `laplace::gla` sites: simple GLA, RetNet, LightNet, RWKV6, GSA.

Each is the GLA recurrence S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t with its own gates
(`gla_calls.gla_site` keeps fla's conventions: default scale, `state_v_first`, fp32 final states, packed
batches):

    simple GLA   g [B, T, H] per head (+ g_gamma [H]), the same for every key: a stride-0 view over K
    RetNet       the fixed decays log(1 - 2 ** (-5 - h)) of fla's `chunk_retention`, one per head
    LightNet     keys and gates from the additive gate (`shared_ops.fused_additive_gate`); its final
                 log-normalizer returned beside the state, as fla does
    RWKV6        an exclusive readout with a per-key bonus u [H, K]:
                     o_t = scale r_t (S_{t-1} + diag(u) k_t^T v_t),   S_t = diag(exp(w_t)) S_{t-1} + k_t^T v_t
                 exactly GLA on k, v, w shifted one token later (its state after token t is S_{t-1}),
                 plus the bonus scale (r_t . (u * k_t)) v_t, and the final state one update further
    GSA          two passes over M slots: hk [K, M] gated along M (a value gate, which GLA has not: one
                 GLA head of value width 1 per slot), a softmax over slots, then hv [M, V] gated along M,
                 which is GLA with M as the key dimension

What the op cannot express (`reverse=True`, unknown keywords) is left to fla and reported
(`laplace_passes.fla.not_replaced`), as for GLA's own calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laplace_passes.fla.gla_calls import gla_site
from laplace_passes.fla.not_replaced import leave_to_fla
from laplace_passes.fla.packing import PackedSequences
from laplace_passes.fla.shared_ops import fused_additive_gate


def _refused(reverse: bool, kwargs: dict, allowed: tuple = ("chunk_size",)) -> str | None:
    if reverse:
        return "reverse=True (right-to-left recurrence) has no laplace::gla form"
    unknown = sorted(set(kwargs) - set(allowed))
    return f"unknown keyword arguments {unknown}" if unknown else None


def _left_to_fla(original, name: str, reason: str, tensors: tuple, arguments: dict, like):
    return leave_to_fla(original, name, reason, tensors, arguments, like)


def _head_gates(q, g, g_gamma):
    """[B, T, H] gates per head (+ [H] fixed ones) as [B, T, H, K]: the same value for every key, a view."""
    B, T, H, K = q.shape
    gates = torch.zeros(B, T, H, dtype=torch.float32, device=q.device)
    if g is not None:
        gates = gates + g.float()
    if g_gamma is not None:
        gates = gates + g_gamma.float()[None, None, :]
    return gates[..., None].expand(B, T, H, K)


def _placeholder(q, v, initial_state, output_final_state, cu_seqlens):
    o = q.new_zeros(*q.shape[:3], v.shape[-1])
    if not output_final_state:
        return o, None
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return o, q.new_zeros(N, q.shape[2], q.shape[3], v.shape[-1], dtype=torch.float32)


# -- simple GLA and RetNet ----------------------------------------------------------------------------------

def _simple_gla(original, name, q, k, v, g, g_gamma, scale, initial_state, output_final_state, reverse,
                state_v_first, cu_seqlens, kwargs):
    """simple GLA (and RetNet, whose gates are fixed per head): one site, gates a view over the keys."""
    reason = _refused(reverse, kwargs)
    if reason is not None:
        arguments = dict(g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                         **kwargs, **({"reverse": reverse} if reverse else {}))
        return _left_to_fla(original, name, reason, (q, k, v), arguments,
                            lambda: _placeholder(q, v, initial_state, output_final_state, cu_seqlens))
    return gla_site(q, k, v, _head_gates(q, g, g_gamma).to(q.dtype), scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                    origin=name)


def chunk_simple_gla_factory(original):
    def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                         state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        return _simple_gla(original, "fla.chunk_simple_gla", q, k, v, g, g_gamma, scale, initial_state,
                           output_final_state, False, state_v_first, cu_seqlens, kwargs)

    return chunk_simple_gla


def fused_recurrent_simple_gla_factory(original):
    def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                                   output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None,
                                   **kwargs):
        return _simple_gla(original, "fla.fused_recurrent_simple_gla", q, k, v, g, g_gamma, scale, initial_state,
                           output_final_state, reverse, state_v_first, cu_seqlens, kwargs)

    return fused_recurrent_simple_gla


def retention_decays(H: int, device) -> torch.Tensor:
    """fla's RetNet gates: log(1 - 2 ** (-5 - h)) for head h, in fp32."""
    return (1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float, device=device))).log()


def chunk_retention_factory(original):
    def chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                        **kwargs):
        state_v_first = kwargs.pop("state_v_first", False)
        return _simple_gla(original, "fla.chunk_retention", q, k, v, None, retention_decays(q.shape[2], q.device),
                           scale, initial_state, output_final_state, False, state_v_first, cu_seqlens, kwargs)

    return chunk_retention


def fused_recurrent_retention_factory(original):
    def fused_recurrent_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False,
                                  state_v_first=False, cu_seqlens=None, **kwargs):
        if "transpose_state_layout" in kwargs:  # fla's deprecated name for state_v_first
            state_v_first = state_v_first or kwargs.pop("transpose_state_layout")
        return _simple_gla(original, "fla.fused_recurrent_retention", q, k, v, None,
                           retention_decays(q.shape[2], q.device), scale, initial_state, output_final_state, reverse,
                           state_v_first, cu_seqlens, kwargs)

    return fused_recurrent_retention


# -- LightNet -----------------------------------------------------------------------------------------------

def _lightnet(name, q, k, v, scale, initial_state, output_final_state, state_v_first, cu_seqlens):
    h0, z0 = (None, None) if initial_state is None else initial_state
    keys, gates, z_final = fused_additive_gate(k, z0, cu_seqlens)
    o, state = gla_site(q, keys, v, gates, scale=scale, initial_state=h0, output_final_state=output_final_state,
                        state_v_first=state_v_first, cu_seqlens=cu_seqlens, origin=name)
    return o, (state, z_final)


def chunk_lightnet(q, k, v, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
                   cu_seqlens=None):
    return _lightnet("fla.chunk_lightnet", q, k, v, scale, initial_state, output_final_state, state_v_first,
                     cu_seqlens)


def fused_recurrent_lightnet(q, k, v, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
                             cu_seqlens=None):
    return _lightnet("fla.fused_recurrent_lightnet", q, k, v, scale, initial_state, output_final_state,
                     state_v_first, cu_seqlens)


# -- RWKV6 --------------------------------------------------------------------------------------------------

def _shifted(x, packed: PackedSequences | None):
    """x[t-1] at each token, zero at each sequence's first token (x [B, T, H, D])."""
    previous = F.pad(x, (0, 0, 0, 0, 1, -1))
    if packed is None:
        return previous
    return torch.where((packed.position == 0)[None, :, None, None], torch.zeros_like(previous), previous)


def _last_tokens(x, packed: PackedSequences | None):
    """Each sequence's last token: x[:, -1] [B, H, D], or [N, H, D] of a packed batch."""
    return x[:, -1] if packed is None else x[0, (packed.ends - 1).clamp(min=0)]


def rwkv6(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, origin):
    """RWKV6 through one GLA site on the shifted sequence (module docstring); returns (o, final state)."""
    T = r.shape[1]
    packed = PackedSequences.from_cu_seqlens(cu_seqlens, T) if cu_seqlens is not None else None
    scale = r.shape[-1] ** -0.5 if scale is None else scale
    before, state = gla_site(r, _shifted(k, packed), _shifted(v, packed), _shifted(w, packed), scale=scale,
                             initial_state=initial_state, output_final_state=True, state_v_first=False,
                             cu_seqlens=cu_seqlens, origin=origin)
    bonus = scale * (r.float() * u.float() * k.float()).sum(-1, keepdim=True) * v.float()
    o = (before.float() + bonus).to(v.dtype)
    if not output_final_state:
        return o, None
    if T == 0:
        return o, state
    decay, key, value = (_last_tokens(x, packed).float() for x in (w, k, v))
    final = decay.exp()[..., None] * state + key[..., None] * value[..., None, :]
    if packed is not None:  # an empty sequence keeps its initial state
        empty = (packed.ends == packed.starts)[:, None, None, None]
        final = torch.where(empty, state, final)
    return o, final


def _rwkv6_call(original, name, r, k, v, w, u, scale, initial_state, output_final_state, reverse, cu_seqlens,
                kwargs):
    reason = _refused(reverse, kwargs)
    if reason is not None:
        arguments = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                         cu_seqlens=cu_seqlens, **kwargs, **({"reverse": reverse} if reverse else {}))
        return _left_to_fla(original, name, reason, (r, k, v, w, u), arguments,
                            lambda: _placeholder(r, v, initial_state, output_final_state, cu_seqlens))
    return rwkv6(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, name)


def chunk_rwkv6_factory(original):
    def chunk_rwkv6(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                    cu_seqlens_cpu=None, **kwargs):
        return _rwkv6_call(original, "fla.chunk_rwkv6", r, k, v, w, u, scale, initial_state, output_final_state,
                           False, cu_seqlens, kwargs)

    return chunk_rwkv6


def fused_recurrent_rwkv6_factory(original):
    def fused_recurrent_rwkv6(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False,
                              reverse=False, cu_seqlens=None):
        return _rwkv6_call(original, "fla.fused_recurrent_rwkv6", r, k, v, w, u, scale, initial_state,
                           output_final_state, reverse, cu_seqlens, {})

    return fused_recurrent_rwkv6


# -- GSA ----------------------------------------------------------------------------------------------------

def gsa(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens, origin):
    """GSA's two passes (module docstring); returns (o, [hk [N, H, K, M], hv [N, H, M, V]] or None)."""
    B, T, HQ, K = q.shape
    H, M = k.shape[2], s.shape[-1]
    groups = HQ // H
    scale = K ** -0.5 if scale is None else scale
    hk0, hv0 = (None, None) if initial_state is None else initial_state
    if groups > 1:  # keys and slots shared by `groups` query heads
        k, v, s, g = (x.repeat_interleave(groups, 2) for x in (k, v, s, g))
        hk0, hv0 = (x.repeat_interleave(groups, 1) if x is not None else None for x in (hk0, hv0))
    per_slot = lambda x: x[:, :, :, None, :].expand(B, T, HQ, M, K).reshape(B, T, HQ * M, K)  # noqa: E731
    h1 = None if hk0 is None else hk0.transpose(-1, -2).reshape(hk0.shape[0], HQ * M, K, 1)
    gates = g[..., None].expand(B, T, HQ, M, K).reshape(B, T, HQ * M, K).to(q.dtype)
    ok, hk = gla_site(per_slot(q), per_slot(k), s.reshape(B, T, HQ * M, 1), gates, scale=scale,
                      initial_state=h1, output_final_state=output_final_state, state_v_first=False,
                      cu_seqlens=cu_seqlens, origin=f"{origin}[slots]")
    slots = ok.reshape(B, T, HQ, M).float().softmax(-1).to(q.dtype)
    o, hv = gla_site(slots, s, v, g, scale=1.0, initial_state=hv0, output_final_state=output_final_state,
                     state_v_first=False, cu_seqlens=cu_seqlens, origin=f"{origin}[values]")
    if not output_final_state:
        return o.to(q.dtype), None
    hk = hk.reshape(hk.shape[0], HQ, M, K).transpose(-1, -2)
    if groups > 1:
        hk, hv = hk[:, ::groups], hv[:, ::groups]
    return o.to(q.dtype), [hk, hv]


def _gsa_call(original, name, q, k, v, s, g, scale, initial_state, output_final_state, reverse, cu_seqlens,
              kwargs):
    reason = _refused(reverse, kwargs) or (None if g is not None else "GSA without slot gates g")
    if reason is not None:
        arguments = dict(g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                         cu_seqlens=cu_seqlens, **kwargs, **({"reverse": reverse} if reverse else {}))
        return _left_to_fla(original, name, reason, (q, k, v, s), arguments,
                            lambda: (q.new_zeros(*q.shape[:3], v.shape[-1]), None))
    return gsa(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens, name)


def chunk_gsa_factory(original):
    def chunk_gsa(q, k, v, s, g=None, scale=None, initial_state=None, output_final_state=False, checkpoint_level=2,
                  cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        return _gsa_call(original, "fla.chunk_gsa", q, k, v, s, g, scale, initial_state, output_final_state, False,
                         cu_seqlens, kwargs)

    return chunk_gsa


def fused_recurrent_gsa_factory(original):
    def fused_recurrent_gsa(q, k, v, s, g=None, scale=None, initial_state=None, output_final_state=False,
                            reverse=False, cu_seqlens=None):
        return _gsa_call(original, "fla.fused_recurrent_gsa", q, k, v, s, g, scale, initial_state,
                         output_final_state, reverse, cu_seqlens, {})

    return fused_recurrent_gsa


SUBSTITUTES = {
    "fla.ops.lightnet.chunk.chunk_lightnet": chunk_lightnet,
    "fla.ops.lightnet.fused_recurrent.fused_recurrent_lightnet": fused_recurrent_lightnet,
}

SUBSTITUTE_FACTORIES = {
    "fla.ops.simple_gla.chunk.chunk_simple_gla": chunk_simple_gla_factory,
    "fla.ops.simple_gla.fused_recurrent.fused_recurrent_simple_gla": fused_recurrent_simple_gla_factory,
    "fla.ops.retention.chunk.chunk_retention": chunk_retention_factory,
    "fla.ops.retention.fused_recurrent.fused_recurrent_retention": fused_recurrent_retention_factory,
    "fla.ops.rwkv6.chunk.chunk_rwkv6": chunk_rwkv6_factory,
    "fla.ops.rwkv6.fused_recurrent.fused_recurrent_rwkv6": fused_recurrent_rwkv6_factory,
    "fla.ops.gsa.chunk.chunk_gsa": chunk_gsa_factory,
    "fla.ops.gsa.fused_recurrent.fused_recurrent_gsa": fused_recurrent_gsa_factory,
}
