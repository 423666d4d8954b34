"""Chunked GLA in standard PyTorch ops: the form the re-tiling pass emits.

The sequence is cut into chunks of C tokens (C = the target's partition count,
128 on trn2). Per chunk n, with G the inclusive cumulative sum of gk inside the
chunk, G_last its last row and S_n the state entering the chunk:

    O_n     = scale * (Q * exp(G)) S_n  +  tril(A) V
    A_ij    = scale * sum_k Q_ik K_jk exp(G_ik - G_jk)          (j <= i)
    S_{n+1} = diag(exp(G_last)) S_n + (K * exp(G_last - G))^T V

NOTE [stable intra-chunk scores]
Factorising A as (Q * exp(G - a)) (K * exp(a - G))^T with one anchor `a` per
chunk overflows fp32 once the decay accumulated in the chunk passes ~88 (with
128-token chunks and gates logsigmoid(x)/0.1 it does). So the chunk is split
into sub-chunks of Cs rows. A query sub-chunk i uses the anchor a_i = G at its
first row:
  * key sub-chunks j < i: (Q_i * exp(G_i - a_i)) @ (K_j * exp(a_i - G_j))^T,
    both exponents <= 0 because G is non-increasing and a_i lies in the past
    of the rows of i and the future of the rows of j;
  * the diagonal block j == i: sum_k Q_ck K_dk exp(G_ck - G_dk) elementwise
    over a [Cs, Cs, K] tensor, exponent <= 0 for d <= c.
Every exponent is clamped at 0 *before* exp (`_decay`), including entries
that the causal mask then discards: an inf there would turn into NaN in the backward
(0 * inf), even though the forward masks it away.

NOTE [flushing tiny decays]
Strong gates drive exp(G) far below fp32's smallest normal number (1.2e-38).
Denormal operands make CPU matmuls about 100x slower, so every decay factor
below exp(-FLUSH_BELOW) (about 1e-13) is set to exactly 0. The terms dropped
weigh less than 1e-13 against the token's own term (weight 1): far under fp32
rounding. GPUs and Trainium flush denormals in hardware; this does it in the
graph, so it holds for every backend.

Padding: T is padded with zero tokens to a multiple of C (q = k = v = 0 and
gk = 0 leave the state untouched); each chunk is padded likewise to a multiple
of Cs. Padded rows come after every real row, so causality hides them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from laplace_passes._checks import check_chunk_size, check_gla_args, resolve_scale
from laplace_passes.gla import check_gates

DEFAULT_SUB_CHUNK = 16
FLUSH_BELOW = 30.0  # see NOTE [flushing tiny decays]


def _decay(exponent: Tensor) -> Tensor:
    """exp(exponent) for exponent <= 0 (larger values are clamped), exactly 0 below -FLUSH_BELOW."""
    factor = torch.exp(exponent.clamp(min=-FLUSH_BELOW, max=0.0))
    return torch.where(exponent < -FLUSH_BELOW, 0.0, factor)


def chunk_plan(seq_len: int, chunk_size: int) -> dict:
    """How a sequence of `seq_len` tokens is tiled: what the report shows per site."""
    n_chunks = max(1, math.ceil(seq_len / chunk_size))
    return {
        "T": seq_len,
        "chunk_size": chunk_size,
        "n_chunks": n_chunks,
        "padding": n_chunks * chunk_size - seq_len,
    }


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
) -> tuple[Tensor, Tensor | None]:
    """GLA computed chunk by chunk; same contract as `laplace_passes.gla`.

    `chunk_size` is the tokens per chunk (the target's partition count when the
    re-tiling pass calls this); `sub_chunk_size` the rows that share one
    anchor in the intra-chunk scores (see NOTE above). Any T, K, V; inputs in
    fp32, bf16 or fp16, computed in fp32, output in the input dtype, final
    state in fp32.
    """
    check_gla_args(q, k, v, gk, initial_state, scale)
    check_chunk_size("chunk_size", chunk_size)
    check_chunk_size("sub_chunk_size", sub_chunk_size)
    scale = resolve_scale(scale, q.shape[-1])
    gk = check_gates(gk)

    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    Cs = min(sub_chunk_size, C)
    plan = chunk_plan(T, C)
    N = plan["n_chunks"]

    # [B, T, H, D] fp32 -> [B, H, N, C', D], C' = C padded to whole sub-chunks.
    qc, kc, vc, gc = (_to_chunks(x.float(), plan["padding"], N, C, Cs) for x in (q, k, v, gk))
    qc = qc * scale
    G = gc.cumsum(-2)
    G_last = G[..., -1:, :]  # padded rows have gk = 0, so the last row is the chunk's

    scores = _intra_chunk_scores(qc, kc, G, Cs)  # [B, H, N, C', C'], causal
    o_intra = scores @ vc

    # Inter-chunk: the only sequential part, one state update per chunk.
    q_decayed = qc * _decay(G)
    k_to_end = kc * _decay(G_last - G)
    chunk_updates = k_to_end.transpose(-1, -2) @ vc  # [B, H, N, K, V]
    chunk_decay = _decay(G_last).transpose(-1, -2)  # [B, H, N, K, 1]
    state = q.new_zeros(B, H, K, V, dtype=torch.float32)
    if initial_state is not None:
        state = initial_state.float()
    entering_states = []
    for n in range(N):
        entering_states.append(state)
        state = chunk_decay[:, :, n] * state + chunk_updates[:, :, n]
    o_inter = q_decayed @ torch.stack(entering_states, dim=2)

    o = _from_chunks(o_intra + o_inter, T, C)
    return o.to(q.dtype), (state if output_final_state else None)


def _to_chunks(x: Tensor, pad_tokens: int, n_chunks: int, chunk: int, sub_chunk: int) -> Tensor:
    """[B, T, H, D] -> [B, H, N, C', D] with zero rows padding T and each chunk."""
    B, _, H, D = x.shape
    # contiguous: matmuls over a transposed [B, T, H, D] view take a strided
    # path that is an order of magnitude slower on CPU.
    x = F.pad(x, (0, 0, 0, 0, 0, pad_tokens)).transpose(1, 2).contiguous()
    x = x.reshape(B, H, n_chunks, chunk, D)
    pad_rows = -chunk % sub_chunk
    return F.pad(x, (0, 0, 0, pad_rows)) if pad_rows else x


def _from_chunks(x: Tensor, seq_len: int, chunk: int) -> Tensor:
    """[B, H, N, C', D] -> [B, T, H, D], dropping every padded row."""
    B, H, N, _, D = x.shape
    return x[..., :chunk, :].reshape(B, H, N * chunk, D)[:, :, :seq_len].transpose(1, 2)


def _intra_chunk_scores(q: Tensor, k: Tensor, G: Tensor, sub: int) -> Tensor:
    """tril(A) for every chunk: [B, H, N, C, K] x 2 -> [B, H, N, C, C] (C a multiple of `sub`)."""
    *lead, C, K = q.shape
    S = C // sub
    q_sub = q.reshape(*lead, S, sub, K)
    G_sub = G.reshape(*lead, S, sub, K)
    anchors = G_sub[..., :1, :]  # [.., S, 1, K]: first row of each query sub-chunk

    # Blocks against earlier key sub-chunks: one matmul per query sub-chunk
    # against the whole chunk, keeping only key sub-chunks before it.
    q_anchored = q_sub * _decay(G_sub - anchors)
    k_anchored = k.unsqueeze(-3) * _decay(anchors - G.unsqueeze(-3))  # [.., S, C, K]
    off_diag = q_anchored @ k_anchored.transpose(-1, -2)  # [.., S, sub, C]
    key_sub = torch.arange(C, device=q.device) // sub
    query_sub = torch.arange(S, device=q.device)
    earlier = (key_sub[None, :] < query_sub[:, None])[:, None, :]  # [S, 1, C]
    off_diag = torch.where(earlier, off_diag, 0.0).reshape(*lead, C, C)

    # Diagonal blocks, elementwise with their own causal mask.
    k_sub = k.reshape(*lead, S, sub, K)
    gap = G_sub.unsqueeze(-2) - G_sub.unsqueeze(-3)  # [.., S, c, d, K], <= 0 where d <= c
    diag = (q_sub.unsqueeze(-2) * k_sub.unsqueeze(-3) * _decay(gap)).sum(-1)  # [.., S, sub, sub]
    causal = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril()
    diag = torch.where(causal, diag, 0.0)
    eye = torch.eye(S, dtype=diag.dtype, device=q.device)
    block_diag = (diag.unsqueeze(-2) * eye[:, None, :, None]).reshape(*lead, C, C)  # [.., S, c, S, d]
    return off_diag + block_diag
