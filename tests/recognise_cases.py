"""GLA written from the equations in plain PyTorch, in the spellings users write, and near misses.

Each case is `(fn, inputs)`: `fn` computes a token recurrence S_t = a_t (.) S_{t-1} + k_t (x) v_t,
o_t = q_t . S_t (or something that is not quite one) with plain torch ops only; the tests compile it
with the laplace backend and compare with `fn` run eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop

B, T, H, K, V = 2, 20, 2, 8, 6


def inputs(layout: str = "bthk", gates: str = "key", seed: int = 0, dtype=torch.float32):
    """q, k, v, g in the layout asked ("bthk" [B, T, H, K] or "bhtk"), gates per key [.., K] or per head."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K if gates == "key" else 1, generator=gen) + 2)
    if gates == "head":
        g = g[..., 0]
    tensors = [q, k, v, g]
    if layout == "bhtk":
        tensors = [x.transpose(1, 2).contiguous() for x in tensors]
    return tuple(x.to(dtype) for x in tensors)


# -- token loops ------------------------------------------------------------------------------------


def elementwise(q, k, v, g):
    """[B, T, H, K]; broadcasting products and .sum; outputs stacked; the final state returned."""
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def einsum_bhtk(q, k, v, g):
    """[B, H, T, K]; einsum; the scale folded into q; outputs stacked along T; no final state."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = torch.exp(g[:, :, t]).unsqueeze(-1) * S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t] * K ** -0.5, S))
    return torch.stack(outs, 2)


def matmul_cat(q, k, v, g):
    """matmul of [.., K, 1] @ [.., 1, V]; readout q @ S; outputs concatenated; unbind for the steps."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for q_t, k_t, v_t, g_t in zip(q.unbind(1), k.unbind(1), v.unbind(1), g.unbind(1)):
        S = g_t.exp().unsqueeze(-1) * S + k_t.unsqueeze(-1) @ v_t.unsqueeze(-2)
        outs.append((q_t.unsqueeze(-2) @ S).squeeze(-2).unsqueeze(1) * 0.5)
    return torch.cat(outs, 1), S


def outer_unbatched(q, k, v, g):
    """One sequence, one head: torch.outer, state [K, V], q_t @ S."""
    q, k, v, g = (x[0, :, 0] for x in (q, k, v, g))
    S = torch.zeros(K, V)
    outs = []
    for t in range(T):
        S = g[t].exp()[:, None] * S + torch.outer(k[t], v[t])
        outs.append(q[t] @ S)
    return torch.stack(outs), S


def preallocated(q, k, v, g):
    """Outputs written into a preallocated tensor; a given initial state."""
    S = torch.ones(B, H, K, V) * 0.1
    out = torch.zeros(B, T, H, V)
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None] + k[:, t][..., None] * v[:, t][..., None, :]
        out[:, t] = (q[:, t][..., None] * S).sum(-2)
    return out


def with_initial_state(q, k, v, g, h0):
    S = h0
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def scanned(q, k, v, g):
    """torch's scan over the time dimension."""
    def step(S, xs):
        q_t, k_t, v_t, g_t = xs
        S = S * g_t.exp()[..., None] + k_t[..., None] * v_t[..., None, :]
        return S, (q_t[..., None] * S).sum(-2)

    moved = [x.movedim(1, 0) for x in (q, k, v, g)]
    S, o = scan(step, torch.zeros(B, H, K, V), moved)
    return o.movedim(0, 1), S


def while_looped(q, k, v, g):
    """torch's while_loop with a static trip count, steps read by index_select at the counter, the readouts
    written into a buffer by index_copy."""
    def cond(i, S, out):
        return i < T

    def body(i, S, out):
        at = i.view(1)
        q_t, k_t, v_t, g_t = (torch.index_select(x, 1, at).squeeze(1) for x in (q, k, v, g))
        S = S * g_t.exp()[..., None] + k_t[..., None] * v_t[..., None, :]
        o = (q_t[..., None] * S).sum(-2)
        return i + 1, S, out.index_copy(1, at, o.unsqueeze(1))

    _, S, out = while_loop(cond, body, (torch.tensor(0), torch.zeros(B, H, K, V), torch.zeros(B, T, H, V)))
    return out, S


def head_gates(q, k, v, g):
    """Simple GLA / Mamba-2 style: one gate per head and step, g [B, T, H]."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[:, :, None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


GAMMA = 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float32))


def retnet(q, k, v, g):
    """RetNet: a fixed decay per head, no gate input."""
    S = torch.zeros(B, H, K, V)
    gamma = GAMMA[:, None, None]
    outs = []
    for t in range(T):
        S = gamma * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def linear_attention(q, k, v, g):
    """No decay at all."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def fixed_decay(q, k, v, g):
    """A decay that is one number."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = 0.9 * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1)


def hgrn2(q, k, v, g):
    """HGRN2: the key tied to the gate, k_t = 1 - exp(g_t)."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        decay = g[:, t].exp()
        S = S * decay[..., None] + (1 - decay)[..., None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def grouped_heads(q, k, v, g):
    """GQA: k and v have one head for two query heads, repeated before the loop."""
    k, v = k[:, :, :1].repeat_interleave(H, 2), v[:, :, :1].repeat_interleave(H, 2)
    return elementwise(q, k, v, g)


def grouped_broadcast(q, k, v, g):
    """GQA without a copy: one key and value head, broadcast over the query heads inside the loop."""
    k, v = k[:, :, :1], v[:, :, :1]
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def fused_projection(q, k, v, g):
    """q and k split out of one tensor along a dimension that is not the tokens' (one qk projection), then
    indexed per token: q is qk.unbind(2)[0] at every step (NOTE [values every step reads])."""
    q, k = torch.stack([q, k], 2).unbind(2)
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1), S


def in_place_sum(q, k, v, g):
    """`S += k (x) v` on the product S * a just computed, which nothing else reads (NOTE [in-place writes to
    temporaries])."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        S += k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def in_place_chain(q, k, v, g):
    """A copy of the state decayed and summed in place (`*=`, then `.add_` chained): writes to one temporary."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S.clone()
        S *= g[:, t].exp()[..., None]
        S = S.add_(k[:, t, :, :, None] * v[:, t, :, None, :])
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def add_statement(q, k, v, g):
    """`S.add_(k v)` as a statement on the product just computed: later reads name the product (NOTE [reads
    after an in-place statement])."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        S.add_(k[:, t, :, :, None] * v[:, t, :, None, :])
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def mamba2_ssd(q, k, v, g):
    """Mamba-2's recurrence: h = h exp(dt A) + (dt x) (x) B, y = h C, the state [B, H, P, N] with the
    summed N last: x is v, B is k, C is q, one decay per head (NOTE [k and v's dimensions chosen by the
    readout])."""
    dt = F.softplus(g[..., 0])  # [B, T, H]
    A = -torch.arange(1, H + 1, dtype=torch.float32)
    h = torch.zeros(B, H, V, K)
    ys = []
    for t in range(T):
        h = h * torch.exp(dt[:, t] * A)[..., None, None] + (dt[:, t, :, None] * v[:, t])[..., None] * k[:, t, :, None, :]
        ys.append((h * q[:, t, :, None, :]).sum(-1))
    return torch.stack(ys, 1), h


def decay_after_sum(q, k, v, g):
    """S_t = (S_{t-1} + k v) a_t: the token's own term decayed too, GLA with the key scaled by the decay
    (NOTE [a decay after the sum])."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = (S + k[:, t, :, :, None] * v[:, t, :, None, :]) * g[:, t].exp()[..., None]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def head_decay_after_sum(q, k, v, g):
    """The same with one decay per head (g [B, T, H]), as a method call."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = (S + k[:, t, :, :, None] * v[:, t, :, None, :]).mul(g[:, t, :, None, None].exp())
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1), S


def _loops_per_head(q, k, v, g, at):
    """A loop over the heads and, inside it, over the tokens; `at(x, t, h)` reads token t of head h."""
    outs = []
    for h in range(H):
        S = torch.zeros(B, K, V)
        per_token = []
        for t in range(T):
            S = S * at(g, t, h).exp()[..., None] + at(k, t, h)[..., None] * at(v, t, h)[..., None, :]
            per_token.append((at(q, t, h)[..., None] * S).sum(-2))
        outs.append(torch.stack(per_token, 1))
    return torch.stack(outs, 2)


def per_head_loops(q, k, v, g):
    """q[:, t, h]: one index holds a token and a head."""
    return _loops_per_head(q, k, v, g, lambda x, t, h: x[:, t, h])


def per_head_loops_bhtk(q, k, v, g):
    """The same over [B, H, T, K] inputs: the head's number comes first, q[:, h, t]."""
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    return _loops_per_head(q, k, v, g, lambda x, t, h: x[:, h, t])


W_PROJ = torch.randn(H * K, H * K, generator=torch.Generator().manual_seed(5)) / (H * K) ** 0.5


def projected_in_the_loop(q, k, v, g):
    """The keys projected inside the loop, token by token (`F.linear(x[:, t]).view(..)`): built once over
    all tokens in the rewrite, not stacked from T projections."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        k_t = F.linear(k[:, t].reshape(B, H * K), W_PROJ).view(B, H, K)
        S = S * g[:, t].exp()[..., None] + k_t[..., None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def last_token_readout(q, k, v, g):
    """Only the last state is read out (a classifier on the last token); nothing else is returned."""
    S = torch.zeros(B, H, K, V)
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
    return torch.einsum("bhk,bhkv->bhv", q[:, -1], S)


# Where two packed documents meet: the state is reset (decay 0) at these steps, in one sequence or both.
RESETS = torch.ones(B, T, 1, 1)
RESETS[:, 7] = 0
RESETS[1, 13] = 0


def masked_reset(q, k, v, g):
    """A trained decay per key (a sigmoid, not written exp(x)) times a 0/1 mask that resets the state."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        decay = torch.sigmoid(g[:, t]) * RESETS[:, t]
        S = decay[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def saturated_decay(q, k, v, x):
    """A decay 1 - sigmoid(x): exactly 0 in fp32 once x passes about 17 (a saturated gate)."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = (1 - torch.sigmoid(x[:, t]))[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def decay_as_given(q, k, v, a):
    """The decay itself is the input, [B, T, H, K] values in [0, 1]."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = a[:, t, :, :, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


# -- near misses: every one must be left alone, with its reason -----------------------------------------


def extra_term(q, k, v, g):
    S = torch.zeros(B, H, K, V)
    bias = torch.linspace(0, 1, K * V).view(K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :] + 0.01 * bias
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def positive_gate(q, k, v, g):
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * torch.exp(F.softplus(g[:, t]) * 0.01)[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def reads_previous_output(q, k, v, g):
    S = torch.zeros(B, H, K, V)
    o = torch.zeros(B, H, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * (v[:, t] + 0.1 * o)[..., None, :]
        o = (q[:, t, :, :, None] * S).sum(-2)
        outs.append(o)
    return torch.stack(outs, 1), S


def vector_state(q, k, v, g):
    S = torch.zeros(B, H, K)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp() + k[:, t] * q[:, t]
        outs.append(S)
    return torch.stack(outs, 1), S


def value_decay_after_sum(q, k, v, g):
    """(S + k v) decayed per value channel: a decay GLA does not have, whichever way it is multiplied out."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = (S + k[:, t, :, :, None] * v[:, t, :, None, :]) * g[:, t, :, :V].exp()[..., None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def decay_after_sum_final_only(q, k, v, g):
    """(S + k v) a_t with only the final state returned: each product has one user, so the sums are read as
    the states (NOTE [a decay after the sum]) and the first step, from the zeros, has no decay."""
    S = torch.zeros(B, H, K, V)
    for t in range(T):
        S = (S + k[:, t, :, :, None] * v[:, t, :, None, :]) * g[:, t].exp()[..., None]
    return S


def backwards(q, k, v, g):
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in reversed(range(T)):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def state_through_tanh(q, k, v, g):
    """A near miss: the update reads its previous state through an op the algebra does not read."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = torch.tanh(S) * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


# -- the quadratic (parallel) form ----------------------------------------------------------------------


def causal_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def quadratic_head_gates(q, k, v, g):
    """Simple GLA's parallel form: per-head gates g [B, T, H], D = exp(G_i - G_j) masked, [B, H, T, T]."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)                                  # [B, H, T]
    D = torch.exp(G[..., :, None] - G[..., None, :]).masked_fill(~causal_mask(T), 0)
    return ((q @ k.transpose(-1, -2) * K ** -0.5) * D) @ v           # [B, H, T, V]


def quadratic_einsum(q, k, v, g):
    """The same with einsum and tril, [B, T, H, K] in and out."""
    G = g.cumsum(1)                                                   # [B, T, H]
    D = torch.exp(G[:, :, None, :] - G[:, None, :, :]).tril(0) if False else \
        torch.exp(G.transpose(1, 2)[..., :, None] - G.transpose(1, 2)[..., None, :]).tril()
    scores = torch.einsum("bihk,bjhk->bhij", q, k) * D
    return torch.einsum("bhij,bjhv->bihv", scores, v)


def quadratic_cumprod(q, k, v, g):
    """Decays multiplied: D = P_i / P_j with P = cumprod(exp(g))."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    P = g.transpose(1, 2).exp().cumprod(-1)
    D = torch.where(causal_mask(T), P[..., :, None] / P[..., None, :], 0.0)
    return ((q @ k.transpose(-1, -2)) * D) @ v


def _masked_by(q, k, v, g, select):
    """(q k^T (.) D) v with D = select(causal mask, G_i - G_j): the mask and its fill as `select` writes them."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)
    return ((q @ k.transpose(-1, -2)) * select(causal_mask(T), G[..., :, None] - G[..., None, :])) @ v


def quadratic_zeros_like_fill(q, k, v, g):
    """The mask's fill a tensor of zeros: where(causal, exp(G_i - G_j), zeros_like(...))."""
    return _masked_by(q, k, v, g, lambda causal, d: torch.where(causal, d.exp(), torch.zeros_like(d)))


def quadratic_zeros_like_fill_first(q, k, v, g):
    """The same, the fill first: where(upper, zeros_like(...), exp(G_i - G_j))."""
    return _masked_by(q, k, v, g, lambda causal, d: torch.where(~causal, torch.zeros_like(d), d.exp()))


def quadratic_full_like_fill(q, k, v, g):
    """Filled with full_like(..., 0.5): later keys kept at half weight, not causal."""
    return _masked_by(q, k, v, g, lambda causal, d: torch.where(causal, d.exp(), torch.full_like(d, 0.5)))


def quadratic_ones_like_fill(q, k, v, g):
    """The same filled with ones: every later key kept with weight 1, not causal."""
    return _masked_by(q, k, v, g, lambda causal, d: torch.where(causal, d.exp(), torch.ones_like(d)))


def quadratic_retnet(q, k, v, g):
    """RetNet's parallel form: gamma ** (i - j), one decay per head, masked."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    position = torch.arange(T, dtype=torch.float32)
    D = (GAMMA[:, None, None] ** (position[:, None] - position[None, :])) * causal_mask(T)
    return ((q @ k.transpose(-1, -2)) * D) @ v


def quadratic_tril_before_exp(q, k, v, g):
    """fla's naive_parallel_simple_gla spelling, the diagonal named: the differences masked with 0 before the exp
    (exp(0) = 1 above the diagonal), then masked again after it."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)
    D = (G.unsqueeze(-1) - G.unsqueeze(-2)).tril(diagonal=0).exp().tril()
    return ((q @ k.transpose(-1, -2) * K ** -0.5) * D) @ v


def quadratic_constant_decay(q, k, v, g):
    """RetNet's D built as fla's naive_retention does, from ranges only, the bool mask first: (i >= j) times
    exp2((i - j) log2(gamma)), so D is a constant of the graph (no gamma ** (i - j) op to read: its values say it)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    s = (1 - q.new_tensor(2.0).pow(-5.0 - q.new_tensor(range(H)))).log2()
    n = q.new_tensor(range(T))
    D = n.unsqueeze(-1).ge(n) * torch.exp2((n.unsqueeze(-1) - n) * s.view(-1, 1, 1))
    return torch.einsum("bhqk,bhkd->bhqd", torch.einsum("bhqd,bhkd,hqk->bhqk", q, k, D), v)


def quadratic_constant_not_powers(q, k, v, g):
    """A near miss: a constant causal D whose entries 1 / (1 + |i - j|) are no decay raised to i - j."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    n = torch.arange(T, dtype=torch.float32)
    D = (1.0 / (1.0 + (n[:, None] - n[None, :]).abs())) * causal_mask(T)
    return ((q @ k.transpose(-1, -2)) * D) @ v


def quadratic_tril_before_exp_only(q, k, v, g):
    """A near miss: the differences masked with 0 before the exp and no mask after it (D = 1 above the diagonal)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)
    D = (G.unsqueeze(-1) - G.unsqueeze(-2)).tril().exp()
    return ((q @ k.transpose(-1, -2)) * D) @ v


def quadratic_linear(q, k, v, g):
    """Causal linear attention, no decay: the mask alone."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return ((q @ k.transpose(-1, -2)) * causal_mask(T)) @ v


def quadratic_scores_masked(q, k, v, g):
    """Causal linear attention with its scores masked as a whole, in place (fla's chunked linear attention):
    NOTE [a product masked as a whole]."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return (q @ k.transpose(-1, -2)).masked_fill_(torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1), 0) @ v


def quadratic_scores_masked_upper(q, k, v, g):
    """A near miss: the scores masked as a whole, but below the diagonal (each query reads the keys after it)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return torch.where(causal_mask(T).T, q @ k.transpose(-1, -2), 0) @ v


def quadratic_unmasked(q, k, v, g):
    """A near miss: exp(G_i - G_j) without a mask, so every query reads every later key too."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)
    D = torch.exp(G[..., :, None] - G[..., None, :])
    return ((q @ k.transpose(-1, -2)) * D) @ v


def quadratic_upper_mask(q, k, v, g):
    """A near miss: masked, but the upper triangle (each query reads the keys after it)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)
    D = torch.exp(G[..., None, :] - G[..., :, None]).triu()
    return ((q @ k.transpose(-1, -2)) * D) @ v


def quadratic_log_mask(q, k, v, g):
    """The mask in log space, before the exp: exp(masked_fill(G_i - G_j, i < j, -inf)), [B, T, S, H]."""
    G = g.cumsum(1)                                                   # [B, T, H]
    D = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~causal_mask(T)[None, :, :, None], float("-inf")).exp()
    return torch.einsum("btsh,bshv->bthv", torch.einsum("bthk,bshk->btsh", q, k) * D, v)


def quadratic_log_upper_mask(q, k, v, g):
    """A near miss in log space: exp(G_i - G_j), but -inf below the diagonal (each query reads the keys after it)."""
    G = g.cumsum(1)
    upper = causal_mask(T).T
    D = torch.where(upper[None, :, :, None], G[:, :, None, :] - G[:, None, :, :], float("-inf")).exp()
    return torch.einsum("btsh,bshv->bthv", torch.einsum("bthk,bshk->btsh", q, k) * D, v)


def quadratic_fill_first(q, k, v, g):
    """Both masks written fill first, where(upper, fill, x): -inf inside the exp, then 0 after it."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)
    upper = ~causal_mask(T)
    D = torch.where(upper, 0.0, torch.where(upper, float("-inf"), G[..., :, None] - G[..., None, :]).exp())
    return ((q @ k.transpose(-1, -2)) * D) @ v


def quadratic_zero_fill_before_exp(q, k, v, g):
    """The differences zeroed before the exp by a bool mask (the diagonal too, where they are 0 already), the
    causal mask after it: exp(masked_fill(G_i - G_j, j >= i, 0)).tril()."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(-1), 0).exp().tril()
    return ((q @ k.transpose(-1, -2)) * D) @ v


def quadratic_zero_fill_below_before_exp(q, k, v, g):
    """A near miss: a zero fill before the exp that also zeroes differences below the diagonal (a band of keys
    2 to 4 tokens back decays by 1, not by its gates)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)
    band = torch.ones(T, T, dtype=torch.bool).tril(-2) & ~torch.ones(T, T, dtype=torch.bool).tril(-5)
    D = (G[..., :, None] - G[..., None, :]).masked_fill(band | ~causal_mask(T), 0).exp().tril()
    return ((q @ k.transpose(-1, -2)) * D) @ v


def quadratic_scores_masked_fill_first(q, k, v, g):
    """Causal linear attention, the scores masked as a whole with the fill written first: where(upper, 0, A)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return torch.where(~causal_mask(T), 0.0, q @ k.transpose(-1, -2)) @ v


def quadratic_mask_changed_in_place(q, k, v, g):
    """A near miss: the causal mask built, then changed in place (queries from 5 on drop the first 2 keys), before
    D reads it; the change is no value of the graph's, so neither the reading nor the random check sees it."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)
    mask = causal_mask(T)
    mask[5:, :2] = False
    D = torch.where(mask, G[..., :, None] - G[..., None, :], float("-inf")).exp()
    return ((q @ k.transpose(-1, -2)) * D) @ v


def quadratic_decay_changed_in_place(q, k, v, g):
    """A near miss: D zeroed in place beyond 4 tokens back by a masked_fill_ whose result nothing reads."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)
    D = torch.exp(G[..., :, None] - G[..., None, :]).masked_fill(~causal_mask(T), 0)
    D.masked_fill_(torch.ones(T, T, dtype=torch.bool).tril(-5), 0)
    return ((q @ k.transpose(-1, -2)) * D) @ v


def quadratic_mask_from_values(q, k, v, g):
    """A near miss: besides the causal mask, keys with an entry over 1.5 are dropped (a mask computed from the
    inputs' values, which random inputs in (-1, 1) never trigger)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)
    large = (k.abs().amax(-1) > 1.5)[..., None, :]                  # [B, H, 1, T]
    D = torch.where(~causal_mask(T) | large, float("-inf"), G[..., :, None] - G[..., None, :]).exp()
    return ((q @ k.transpose(-1, -2)) * D) @ v


def quadratic_key_gates(q, k, v, g):
    """GLA's own gates (one per key) in the parallel form: D [B, H, T, T, K], one einsum."""
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    G = g.cumsum(2)                                                   # [B, H, T, K]
    D = torch.exp(G[:, :, :, None, :] - G[:, :, None, :, :]) * causal_mask(T)[:, :, None]
    return torch.einsum("bhik,bhjk,bhijk,bhjv->bhiv", q, k, D, v)


# -- a user's own chunked algorithm ------------------------------------------------------------------------

CHUNK = 4


def chunked_simple_gla(q, k, v, g):
    """fla's naive_chunk_simple_gla, rewritten without einops: per-head gates, chunks of 4 tokens."""
    q, k, v, g = (x.transpose(1, 2) for x in (q * K ** -0.5, k, v, g))
    n = T // CHUNK
    q, k, v = (x.reshape(B, H, n, CHUNK, -1) for x in (q, k, v))
    decay = g.reshape(B, H, n, CHUNK).cumsum(-1)
    L_mask = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).tril().exp().tril()
    S = k.new_zeros(B, H, K, V)
    o = torch.zeros_like(v)
    for i in range(n):
        q_i, k_i, v_i = q[:, :, i], k[:, :, i], v[:, :, i]
        attn = q_i @ k_i.transpose(-1, -2) * L_mask[:, :, i]
        o_inter = (q_i * decay[:, :, i, :, None].exp()) @ S
        o[:, :, i] = o_inter + attn @ v_i
        S = S * decay[:, :, i, -1, None, None].exp() + \
            (k_i * (decay[:, :, i, -1, None] - decay[:, :, i]).exp()[..., None]).transpose(-1, -2) @ v_i
    return o.reshape(B, H, T, V).transpose(1, 2), S


def chunked_gla(q, k, v, g):
    """A chunked GLA with gates per key, [B, H, n, C, K], chunks of 5 tokens, in the state's [K, V] layout."""
    C = 5
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    n = T // C
    q, k, v, g = (x.reshape(B, H, n, C, -1) for x in (q, k, v, g))
    G = g.cumsum(-2)                                                  # inside each chunk
    S = torch.zeros(B, H, K, V)
    outs = []
    causal = torch.ones(C, C).tril()
    for i in range(n):
        q_i, k_i, v_i, G_i = q[:, :, i], k[:, :, i], v[:, :, i], G[:, :, i]
        scores = torch.einsum("bhik,bhjk,bhijk->bhij", q_i, k_i, (G_i[:, :, :, None] - G_i[:, :, None]).exp())
        intra = (scores * causal) @ v_i
        outs.append((q_i * G_i.exp()) @ S + intra)
        S = S * G_i[:, :, -1, :, None].exp() + (k_i * (G_i[:, :, -1:] - G_i).exp()).transpose(-1, -2) @ v_i
    return torch.stack(outs, 2).reshape(B, H, T, V).transpose(1, 2), S


def chunked_gla_without_s0(q, k, v, g):
    """chunked_gla with no S_0: the first chunk's output is its intra-chunk part and its state its own product."""
    C = 5
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    n = T // C
    q, k, v, g = (x.reshape(B, H, n, C, -1) for x in (q, k, v, g))
    G = g.cumsum(-2)
    S, outs = None, []
    causal = torch.ones(C, C).tril()
    for i in range(n):
        q_i, k_i, v_i, G_i = q[:, :, i], k[:, :, i], v[:, :, i], G[:, :, i]
        scores = torch.einsum("bhik,bhjk,bhijk->bhij", q_i, k_i, (G_i[:, :, :, None] - G_i[:, :, None]).exp())
        intra = (scores * causal) @ v_i
        outs.append(intra if S is None else (q_i * G_i.exp()) @ S + intra)
        update = (k_i * (G_i[:, :, -1:] - G_i).exp()).transpose(-1, -2) @ v_i
        S = update if S is None else S * G_i[:, :, -1, :, None].exp() + update
    return torch.stack(outs, 2).reshape(B, H, T, V).transpose(1, 2), S


def chunked_gla_by_slices(q, k, v, g):
    """chunked_gla with each chunk sliced out of the sequence (g[:, :, i:i + C]), not reshaped into chunks."""
    C = 5
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    S, outs = torch.zeros(B, H, K, V), []
    causal = torch.ones(C, C).tril()
    for i in range(0, T, C):
        q_i, k_i, v_i, G_i = q[:, :, i:i + C], k[:, :, i:i + C], v[:, :, i:i + C], g[:, :, i:i + C].cumsum(2)
        scores = torch.einsum("bhik,bhjk,bhijk->bhij", q_i, k_i, (G_i[:, :, :, None] - G_i[:, :, None]).exp())
        outs.append((q_i * G_i.exp()) @ S + (scores * causal) @ v_i)
        S = S * G_i[:, :, -1, :, None].exp() + (k_i * (G_i[:, :, -1:] - G_i).exp()).transpose(-1, -2) @ v_i
    return torch.cat(outs, 2).transpose(1, 2), S


def _gates_written_in_place(q, k, v, g, halved_before: bool = False, doubled_after_step: int | None = None):
    """The elementwise loop with its gates written in place: halved before the loop reads them, or doubled after
    one step (after the last: after the loop, before its outputs are stacked)."""
    g = g * 1.0
    S = q.new_zeros(B, H, K, V)
    if halved_before:
        g.mul_(0.5)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
        if t == doubled_after_step:
            g.mul_(2.0)
    return torch.stack(outs, 1), S, g


def gates_changed_after_the_loop(q, k, v, g):
    """A near miss: the gates doubled in place after the loop and before its outputs are stacked (a GLA call
    placed where the outputs are read would read the doubled gates)."""
    return _gates_written_in_place(q, k, v, g, doubled_after_step=T - 1)


def gates_changed_inside_the_loop(q, k, v, g):
    """A near miss: the gates doubled in place halfway through the loop (its later steps read the new gates)."""
    return _gates_written_in_place(q, k, v, g, doubled_after_step=T // 2)


def quadratic_gates_changed_after_the_decays(q, k, v, g):
    """A near miss: the gates doubled in place after D is built from them, before the form is read."""
    g = g * 1.0
    G = g.transpose(1, 2).cumsum(-1)
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~causal_mask(T), float("-inf")).exp()
    g.mul_(2.0)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return ((q @ k.transpose(-1, -2)) * D) @ v, g


def gates_changed_while_steps_are_read(q, k, v, g):
    """A near miss: each step's output added up as it comes (the results' first reader is step 0's sum) and the
    later half of the gates doubled through a slice halfway through: steps after it read the new gates."""
    g = g * 1.0
    S = q.new_zeros(B, H, K, V)
    total = q.new_zeros(B, H, V)
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        total = total + (q[:, t, :, :, None] * S).sum(-2)
        if t == T // 2:
            g[:, T // 2 + 1:] *= 2.0
    return total, S


def gates_changed_before_the_loop_reads_them(q, k, v, g):
    """Written in place after the state is allocated but before the loop reads the gates: the GLA call sees the
    write as the loop did (a GLA site)."""
    return _gates_written_in_place(q, k, v, g, halved_before=True)


def decay_halved_after_the_loop(q, k, v, decay):
    """Per-key gates [B, T, H, K] given as they are (a buffer, a global), step t reading its own, halved in place
    after the loop (before its outputs are stacked): tests/test_recognise_names.py."""
    S, outs = q.new_zeros(B, H, K, V), []
    for t in range(T):
        S = S * decay[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    decay.mul_(0.5)
    return torch.stack(outs, 1), S


# Gates this module keeps in a global of its own, read here (Dynamo names the global
# G['__import_tests_dot_recognise_cases'].GATES_KEPT_HERE when a function of another module calls this one).
GATES_KEPT_HERE = inputs("bthk", "key")[3].clone()


def gates_kept_here_halved_after_the_loop(q, k, v):
    return decay_halved_after_the_loop(q, k, v, GATES_KEPT_HERE)
