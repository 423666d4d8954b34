"""An fla GLA model run eagerly in plain PyTorch: the oracle for the laplace backend on fla models.

Independent of `laplace_passes`: GLA is the token loop of fla's own
`naive_recurrent_gla`, written out of place (`gla`; fla's writes each output
row in place, which makes autograd quadratic in T: minutes at T = 2048), and
checked against fla's function in tests/test_fla_model.py; everything else is
a formula written here from the maths (RMSNorm, swish gate, SwiGLU MLP, short
convolution, cross entropy). It reads
the weights of an `fla.models.GLAForCausalLM` and supports its default flags
(fuse_norm, fuse_swiglu, fuse_cross_entropy; the fused forms compute the same
maths), attn_mode chunk / fused_recurrent, and use_short_conv.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def gla(q, k, v, gk, initial_state=None):
    """fla's naive_recurrent_gla, out of place: (o in q's dtype, final state fp32); layout [B, T, H, D]."""
    dtype = q.dtype
    q, k, v, gk = (t.transpose(1, 2).float() for t in (q, k, v, gk))
    B, H, T, K = q.shape
    h = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float()
    outputs = []
    for i in range(T):
        h = h * gk[:, :, i].exp()[..., None] + k[:, :, i, :, None] * v[:, :, i, None, :]
        outputs.append((q[:, :, i, :, None] * K ** -0.5 * h).sum(-2))
    return torch.stack(outputs, dim=1).to(dtype), h


def rms_norm(x, weight, eps):
    x32 = x.float()
    y = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def swish(x):
    return x * torch.sigmoid(x)


def short_conv(x, conv):
    """Causal depthwise convolution over time + swish (fla's ShortConvolution, no cache)."""
    W = conv.weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), conv.weight, conv.bias, padding=W - 1, groups=x.shape[-1])[..., : x.shape[1]]
    return swish(y.transpose(1, 2))


def attention(layer, x, state=None):
    """fla's GatedLinearAttention layer (output gate, fused norm + swish); returns (out, final state [B,H,K,V])."""
    B, T, _ = x.shape
    q, k, v = (F.linear(x, p.weight) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    if layer.use_short_conv:
        q, k, v = short_conv(q, layer.q_conv1d), short_conv(k, layer.k_conv1d), short_conv(v, layer.v_conv1d)
    low, high = layer.gk_proj
    gk = F.linear(F.linear(x, low.weight), high.weight, high.bias)
    H, K, V = layer.num_heads, layer.head_k_dim, layer.head_v_dim
    q, k, gk = (t.reshape(B, T, H, K) for t in (q, k, gk))
    v = v.reshape(B, T, H, V)
    gk = F.logsigmoid(gk) / layer.gate_logit_normalizer
    o, final = gla(q, k, v, gk, state)
    g = F.linear(x, layer.g_proj.weight).reshape(B, T, H, V)
    norm = layer.g_norm_swish_gate if layer.fuse_norm_and_gate else layer.g_norm
    o = rms_norm(o, norm.weight, norm.eps) * swish(g)  # fused or not, fla's default gate is swish
    return F.linear(o.reshape(B, T, H * V), layer.o_proj.weight), final


def mlp(block, x):
    m = block.mlp
    return F.linear(swish(F.linear(x, m.gate_proj.weight)) * F.linear(x, m.up_proj.weight), m.down_proj.weight)


def forward(model, ids, states=None):
    """(logits [B, T, vocab], final state per layer) of `model` on token ids; `states` continues a sequence."""
    x = F.embedding(ids, model.model.embeddings.weight)
    finals = []
    for i, block in enumerate(model.model.layers):
        h, final = attention(block.attn, rms_norm(x, block.attn_norm.weight, block.attn_norm.eps),
                             None if states is None else states[i])
        finals.append(final)
        x = x + h
        x = x + mlp(block, rms_norm(x, block.mlp_norm.weight, block.mlp_norm.eps))
    x = rms_norm(x, model.model.norm.weight, model.model.norm.eps)
    return F.linear(x, model.lm_head.weight), finals


def cross_entropy(logits, labels):
    """fla's causal LM loss: predict labels shifted left by one, mean over the positions with a target."""
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1).reshape(-1)
    rows = logits.reshape(targets.shape[0], -1).float()
    valid = targets != IGNORE
    picked = rows.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    losses = (torch.logsumexp(rows, dim=1) - picked) * valid
    return losses.sum() / valid.sum()


def greedy_generate(model, ids, new_tokens):
    """Greedy continuation by the token recurrence: prefill once, then one token at a time from the states."""
    logits, states = forward(model, ids)
    tokens = [ids]
    for _ in range(new_tokens):
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(next_token)
        logits, states = forward(model, next_token, states)
    return torch.cat(tokens, dim=1)
