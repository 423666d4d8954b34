"""fla's GLA-family models run eagerly on fla's own reference code: the oracle for the laplace backend.

Inside `reference_kernels()` every fla function those models call that would reach Triton is swapped, in
every loaded fla module, for fla's own reference (`rms_norm_ref`, `group_norm_ref`, the gated
`rms_norm_ref`, `rotary_embedding_ref`, `token_shift_ref`, `naive_recurrent_gla`,
`naive_recurrent_simple_gla`, `naive_recurrent_rwkv6`, `naive_recurrent_gsa`) or, where fla has none
(LightNet's additive gate, the activations, the loss), the formula written here. Nothing here imports
`laplace_passes`. Packed batches (`cu_seqlens`, what fla's layers make of an attention mask) run the
reference sequence by sequence.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys

import torch
import torch.nn.functional as F
from fla.modules.norm.layernorm import group_norm_ref, layer_norm_ref, rms_norm_ref
from fla.modules.norm.layernorm_gated import rms_norm_ref as gated_rms_norm_ref
from fla.modules.rotary.ops import rotary_embedding_ref
from fla.modules.token_shift import token_shift_ref
from fla.ops.gla.naive import naive_recurrent_gla
from fla.ops.gsa.naive import naive_recurrent_gsa
from fla.ops.rwkv6.recurrent_naive import naive_recurrent_rwkv6
from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

# -- norms and activations -------------------------------------------------------------------------------


def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    return rms_norm_ref(x, weight, bias, residual=residual, eps=eps, prenorm=prenorm, upcast=True)


def layer_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, is_rms_norm=False):
    ref = rms_norm_ref if is_rms_norm else layer_norm_ref
    return ref(x, weight, bias, residual=residual, eps=eps, prenorm=prenorm, upcast=True)


def group_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False,
               is_rms_norm=False, num_groups=1):
    return group_norm_ref(x, weight, bias, num_groups, residual=residual, eps=eps, is_rms_norm=is_rms_norm,
                          prenorm=prenorm, upcast=True)


def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                   eps=1e-6):
    assert activation in ("swish", "silu") and residual is None
    return gated_rms_norm_ref(x, weight, bias, z=g, eps=eps)


def rms_norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-5,
                    prenorm=False, residual_in_fp32=False):
    y = rms_norm_ref(x, norm_weight, norm_bias, residual=residual, eps=eps, prenorm=prenorm, upcast=True)
    y, kept = y if prenorm else (y, None)
    out = F.linear(y, linear_weight.to(y.dtype), None if linear_bias is None else linear_bias.to(y.dtype))
    return (out, kept) if prenorm else out


def rms_norm_swish_gate_linear(x, g, norm_weight, norm_bias, linear_weight, linear_bias, residual=None,
                               prenorm=False, residual_in_fp32=False, eps=1e-6):
    assert residual is None and not prenorm
    y = gated_rms_norm_ref(x, norm_weight, norm_bias, z=g, eps=eps)
    return F.linear(y, linear_weight.to(y.dtype), None if linear_bias is None else linear_bias.to(y.dtype))


def swiglu_linear(x, y, weight, bias):
    return F.linear(x * torch.sigmoid(x) * y, weight, bias)


def swish(x):
    return x * torch.sigmoid(x)


def swish_fwd(x, output_contiguous=False):
    return (x.float() * torch.sigmoid(x.float())).to(x.dtype)


def swish_bwd(x, dy, output_contiguous=False):
    sigmoid = torch.sigmoid(x.float())
    return (dy.float() * sigmoid * (1 + x.float() * (1 - sigmoid))).to(x.dtype)


def sqrelu_fwd(x):
    # fla's own is a torch.compile'd function: swapped so the reference runs eagerly, without an Inductor
    # compile per test (Dynamo's caches are reset between tests).
    return F.relu(x.float()).square().to(x.dtype)


def sqrelu_bwd(g, x):
    return (2.0 * g * F.relu(x.float())).to(x.dtype)


def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                  cp_context=None, **kwargs):
    """A depthwise convolution over past tokens (training forward only: no cache, no packed batch)."""
    assert initial_state is None and not output_final_state and cu_seqlens is None and residual is None
    T, W = x.shape[1], weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2).float(), weight.float()[:, None, :], None if bias is None else bias.float(),
                 padding=W - 1, groups=x.shape[-1])[..., :T].transpose(1, 2)
    if activation in ("silu", "swish"):
        y = y * torch.sigmoid(y)
    return y.to(x.dtype), None


# -- sequence by sequence ---------------------------------------------------------------------------------


def per_sequence(run, tensors, cu_seqlens, initial_state):
    """`run(tensors, initial_state) -> (o, final)` on each sequence of a packed batch, outputs concatenated."""
    if cu_seqlens is None:
        return run(tensors, initial_state)
    outputs, finals = [], []
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        state = None if initial_state is None else _select(initial_state, n)
        o, final = run([t[:, start:end] for t in tensors], state)
        outputs.append(o)
        finals.append(final)
    return torch.cat(outputs, 1), _stack(finals)


def _select(state, n):
    if isinstance(state, (tuple, list)):
        return type(state)(None if s is None else s[n:n + 1] for s in state)
    return state[n:n + 1]


def _stack(finals):
    if finals[0] is None:
        return None
    if isinstance(finals[0], (tuple, list)):
        return type(finals[0])(torch.cat(parts) for parts in zip(*finals))
    return torch.cat(finals)


def rotary_embedding(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     chunk_indices=None):
    if cu_seqlens is None:
        offsets = seqlen_offsets.tolist() if torch.is_tensor(seqlen_offsets) else [seqlen_offsets] * x.shape[0]
        return torch.cat([_rotate(x[b:b + 1], cos, sin, o, interleaved) for b, o in enumerate(offsets)])
    offsets = seqlen_offsets.tolist() if torch.is_tensor(seqlen_offsets) else [seqlen_offsets] * len(cu_seqlens)
    pieces = [_rotate(x[:, a:b], cos, sin, offsets[n], interleaved)
              for n, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))]
    return torch.cat(pieces, 1)


def _rotate(x, cos, sin, offset, interleaved):
    T = x.shape[1]
    assert offset + T <= cos.shape[0]
    return rotary_embedding_ref(x, cos[offset:offset + T], sin[offset:offset + T], interleaved)


def token_shift(x, cu_seqlens=None, cache=None, output_cache=False, chunk_indices=None):
    delta = token_shift_ref(x, cu_seqlens)
    if cache is not None:
        assert cu_seqlens is None
        delta = torch.cat([(cache.reshape(x.shape[0], -1) - x[:, 0])[:, None], delta[:, 1:]], 1)
    if not output_cache:
        return delta
    last = x[:, -1] if cu_seqlens is None else x[0, cu_seqlens[1:] - 1]
    return delta, last


# -- recurrences ----------------------------------------------------------------------------------------


def _gla_state_first(state, state_v_first):
    return None if state is None else (state.transpose(-1, -2) if state_v_first else state)


def gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
        cu_seqlens=None, **kwargs):
    """fla's chunk_gla / fused_recurrent_gla through naive_recurrent_gla (its scale is K ** -0.5)."""
    K = q.shape[-1]
    factor = 1.0 if scale is None else scale / K ** -0.5

    def run(tensors, state):
        q_, k_, v_, g_ = tensors
        o, final = naive_recurrent_gla(q_ * factor, k_, v_, g_, initial_state=state, output_final_state=True)
        return o, final

    o, final = per_sequence(run, [q, k, v, g], cu_seqlens, _gla_state_first(initial_state, state_v_first))
    return o, (_gla_state_first(final, state_v_first) if output_final_state else None)


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                        reverse=False, state_v_first=False, cu_seqlens=None, **kwargs):
    assert gv is None and not reverse and gk is not None
    return gla(q, k, v, gk, scale, initial_state, output_final_state, state_v_first, cu_seqlens)


def retention(q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False, state_v_first=False,
              cu_seqlens=None, **kwargs):
    decays = (1 - 2.0 ** (-5.0 - torch.arange(q.shape[2], dtype=torch.float))).log()

    def run(tensors, state):
        q_, k_, v_ = tensors
        return naive_recurrent_simple_gla(q_, k_, v_, decays.expand(*q_.shape[:3]), scale=scale, initial_state=state,
                                          output_final_state=True)

    o, final = per_sequence(run, [q, k, v], cu_seqlens, _gla_state_first(initial_state, state_v_first))
    return o, (_gla_state_first(final, state_v_first) if output_final_state else None)


def simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
               state_v_first=False, cu_seqlens=None, **kwargs):
    def run(tensors, state):
        q_, k_, v_, g_ = tensors
        return naive_recurrent_simple_gla(q_, k_, v_, g_, scale=scale, initial_state=state, output_final_state=True)

    gates = g if g_gamma is None else (g if g is not None else 0) + g_gamma
    o, final = per_sequence(run, [q, k, v, gates], cu_seqlens, _gla_state_first(initial_state, state_v_first))
    return o, (_gla_state_first(final, state_v_first) if output_final_state else None)


def rwkv6(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False, reverse=False, cu_seqlens=None,
          **kwargs):
    def run(tensors, state):
        o, final = naive_recurrent_rwkv6(*(t.transpose(1, 2) for t in tensors), u, scale=scale, initial_state=state,
                                         output_final_state=True)
        return o.transpose(1, 2), final

    o, final = per_sequence(run, [r, k, v, w], cu_seqlens, initial_state)
    return o, (final if output_final_state else None)


def gsa(q, k, v, s, g=None, scale=None, initial_state=None, output_final_state=False, reverse=False,
        cu_seqlens=None, **kwargs):
    def run(tensors, state):
        o, (hk, hv) = naive_recurrent_gsa(*tensors, scale=scale, initial_state=state, output_final_state=True)
        return o, (hk, hv)

    o, final = per_sequence(run, [q, k, v, s, g], cu_seqlens, initial_state)
    return o, (list(final) if output_final_state else None)


def lightnet(q, k, v, scale=None, initial_state=None, output_final_state=False, state_v_first=False, cu_seqlens=None):
    """LightNet from its equations: z_t = log(exp(z_{t-1}) + exp(k_t)), keys exp(k_t - z_t), decays
    exp(z_{t-1} - z_t); then GLA with those keys and decays."""
    h0, z0 = (None, None) if initial_state is None else initial_state

    def run(tensors, state):
        q_, k_, v_ = tensors
        h, z = state if state is not None else (None, None)
        keys, gates, z_final = additive_gate(k_.float(), z)
        o, final = naive_recurrent_gla(q_, keys.to(q_.dtype), v_, gates.to(q_.dtype), initial_state=h,
                                       output_final_state=True)
        return o, (final, z_final)

    state = None if h0 is None and z0 is None else (_gla_state_first(h0, state_v_first), z0)
    o, (final, z) = per_sequence(run, [q, k, v], cu_seqlens, state)
    return o, ((_gla_state_first(final, state_v_first) if output_final_state else None), z)


def additive_gate(x, z0=None):
    """z_t = log(exp(z_{t-1}) + exp(x_t)), k_t = exp(x_t - z_t), g_t = z_{t-1} - z_t (0 with nothing before)."""
    z = torch.full_like(x[:, 0], -math.inf) if z0 is None else z0[:, 0].float()
    keys, gates = [], []
    for t in range(x.shape[1]):
        new = torch.logaddexp(z, x[:, t])
        keys.append(torch.exp(x[:, t] - new))
        gates.append(torch.where(torch.isneginf(z), torch.zeros_like(z), z - new))
        z = new
    return torch.stack(keys, 1), torch.stack(gates, 1), z[:, None]


def cross_entropy_forward(self, logits, target):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1), ignore_index=self.ignore_index)


REFERENCES = {
    "fla.modules.norm.layernorm.rms_norm": rms_norm,
    "fla.modules.norm.layernorm.layer_norm": layer_norm,
    "fla.modules.norm.layernorm.group_norm": group_norm,
    "fla.modules.norm.layernorm.rms_norm_linear": rms_norm_linear,
    "fla.modules.norm.fused_norm_gate.rms_norm_gated": rms_norm_gated,
    "fla.modules.norm.fused_norm_gate.rms_norm_swish_gate_linear": rms_norm_swish_gate_linear,
    "fla.modules.activations.swiglu_linear": swiglu_linear,
    "fla.modules.activations.swish": swish,
    "fla.modules.activations.ops.swish_fwd": swish_fwd,  # SwishFunction, what ACT2FN["swish"] applies
    "fla.modules.activations.ops.swish_bwd": swish_bwd,
    "fla.modules.activations.ops.sqrelu_fwd": sqrelu_fwd,  # SquaredReLUFunction, RWKV-6's channel mix
    "fla.modules.activations.ops.sqrelu_bwd": sqrelu_bwd,
    "fla.modules.rotary.ops.rotary_embedding": rotary_embedding,
    "fla.modules.causal_conv1d.ops.causal_conv1d": causal_conv1d,
    "fla.modules.token_shift.token_shift": token_shift,
    "fla.ops.gla.chunk.chunk_gla": gla,
    "fla.ops.gla.fused_recurrent.fused_recurrent_gla": fused_recurrent_gla,
    "fla.ops.simple_gla.chunk.chunk_simple_gla": simple_gla,
    "fla.ops.simple_gla.fused_recurrent.fused_recurrent_simple_gla": simple_gla,
    "fla.ops.retention.chunk.chunk_retention": retention,
    "fla.ops.retention.fused_recurrent.fused_recurrent_retention": retention,
    "fla.ops.rwkv6.chunk.chunk_rwkv6": rwkv6,
    "fla.ops.rwkv6.fused_recurrent.fused_recurrent_rwkv6": rwkv6,
    "fla.ops.gsa.chunk.chunk_gsa": gsa,
    "fla.ops.gsa.fused_recurrent.fused_recurrent_gsa": gsa,
    "fla.ops.lightnet.chunk.chunk_lightnet": lightnet,
    "fla.ops.lightnet.fused_recurrent.fused_recurrent_lightnet": lightnet,
}


def _resolve(qualified: str):
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def reference_kernels():
    """fla's functions swapped for their references in every loaded fla module, and its loss for cross entropy."""
    from fla.modules import FusedCrossEntropyLoss

    # id of each original -> (original, its reference): one pass over fla's modules finds them all (a pass per
    # function took 0.15 s a call, 44 calls in test_fla_family_models.py). The first name of a function wins.
    references = {}
    for qualified, reference in REFERENCES.items():
        original = _resolve(qualified)
        references.setdefault(id(original), (original, reference))

    def reference_for(value):
        found = references.get(id(value))
        return found[1] if found is not None and found[0] is value else None

    swapped = []
    for name, module in list(sys.modules.items()):
        if name.startswith("fla") and module is not None:
            for attribute, value in list(vars(module).items()):
                if (reference := reference_for(value)) is not None:
                    swapped.append((module, attribute, value))
                    setattr(module, attribute, reference)
                elif isinstance(value, dict):  # dispatch tables such as ACT2FN
                    for key, entry in list(value.items()):
                        if (reference := reference_for(entry)) is not None:
                            swapped.append((value, key, entry))
                            value[key] = reference
    loss_forward = FusedCrossEntropyLoss.forward
    FusedCrossEntropyLoss.forward = cross_entropy_forward
    try:
        yield
    finally:
        FusedCrossEntropyLoss.forward = loss_forward
        for owner, key, value in reversed(swapped):
            if isinstance(owner, dict):
                owner[key] = value
            else:
                setattr(owner, key, value)
