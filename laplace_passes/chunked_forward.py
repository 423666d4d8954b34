"""Chunked GLA forward in standard PyTorch ops: the computation the re-tiling pass installs.

The sequence is cut into chunks of C tokens (C = the target's partition count,
128 on trn2). Per chunk n, with G the inclusive cumulative sum of gk inside the
chunk, G_last its last row and S_n the state entering the chunk:

    O_n     = scale * (Q * exp(G)) S_n  +  tril(A) V
    A_ij    = scale * sum_k Q_ik K_jk exp(G_ik - G_jk)          (j <= i)
    S_{n+1} = diag(exp(G_last)) S_n + (K * exp(G_last - G))^T V

This module holds the forward (`chunked_forward`) and the pieces the explicit
backward (`laplace_passes.chunked_backward`) shares with it. Both are plain
functions of tensors whose only Python loop is the one over chunks, so a
trace at a static shape (`make_fx`) is straight-line code with one state
update per chunk. The public entry point, `chunked_gla`, and the
`laplace::chunked_gla` op that carries the explicit backward live in
`laplace_passes.chunked`.

NOTE [stable intra-chunk scores]
Factorising A as (Q * exp(G - a)) (K * exp(a - G))^T with one anchor `a` per
chunk overflows fp32 once the decay accumulated in the chunk passes ~88 (with
128-token chunks and gates logsigmoid(x)/0.1 it does). So tril(A) is built
by halving (`IntraChunk`): a block of P rows is its two diagonal halves
(halved again, recursively) plus one off-diagonal block, queries of the
second half against keys of the first, which is a single matmul with one
anchor a = G at the last row of the first half:

    A[second, first] = (Q_2 * exp(G_2 - a)) @ (K_1 * exp(a - G_1))^T

Both exponents are <= 0 because G is non-increasing along rows and `a` lies
in the future of every key and the past of every query, so nothing
overflows; each factor is flushed on its own (NOTE [flushing tiny decays]):
a term is dropped only when its query or key factor is below exp(-30),
which implies the whole decay exp(G_q - G_k) is. A gate of -30 (a reset)
lies on one side of the anchor, so decays across a reset stay exactly 0,
and every term is still exp(G_q - G_k) or 0, so the backward's dG rule
holds unchanged.

Each token is a query or a key of exactly one off-diagonal block per level,
so every level costs one [.., C, K] elementwise pass and no tensor grows
beyond [.., C, K] (an anchor per query sub-chunk instead would need a copy
of the keys for each query sub-chunk, [.., C/Cs, C, K]). Blocks
are halved down to `sub_chunk_size` rows, the leaves, whose scores are
computed elementwise, one diagonal at a time: for each offset d < Cs, row c
of every leaf against row c - d,

    A[c, c - d] = sum_k Q_ck K_(c-d)k exp(G_ck - G_(c-d)k)      (exponent <= 0)

over [.., Cs - d, K] slices, so only the lower triangle is computed:
(Cs + 1) / 2 products per token and channel, and no [.., Cs, Cs, K] tensor.
The leaf size trades that elementwise work against more, smaller matmuls:
on trn2's size model 16-row leaves give the fewest instructions, on a CPU
4-row leaves run fastest (`HardwareTarget.sub_chunk_size`).
Every exponent is clamped at 0 *before* exp (`_decay`): each is <= 0 by
construction, and the clamp guarantees it, so no exp can be inf (which a
backward would turn into NaN, 0 * inf).

NOTE [flushing tiny decays]
Strong gates drive exp(G) far below fp32's smallest normal number (1.2e-38).
Denormal operands make CPU matmuls about 100x slower, so every decay factor
whose exponent is at or below -FLUSH_BELOW (exp(-30), about 1e-13) is set to
exactly 0. The terms dropped weigh less than 1e-13 against the token's own
term (weight 1): far under fp32 rounding. GPUs and Trainium flush denormals in
hardware; this does it in the graph, so it holds for every backend.
Each gate is also clamped at -FLUSH_BELOW before the cumulative sum (its
gradient is 0 below): any decay through such a gate is flushed anyway, and an
unclamped one would break G. A gate of -inf (a hard reset, or fp16 overflow)
makes G_i - G_j = -inf - (-inf) = NaN; a finite but huge one (-1e7) pushes G
so far that the small gates after it fall below fp32's rounding step of G.

NOTE [non-finite values stay causal]
tril(A) V is one matmul whose masked entries are exact zeros, and IEEE says
0 * inf = NaN: an inf in v at token j would turn every row of the chunk
non-finite, outputs before j included, though no earlier token depends on
it (the recurrence keeps them finite). `causal_matmul` multiplies by v with
its non-finite entries zeroed and marks as NaN exactly the (row, channel)
pairs at or after a non-finite entry of that channel. The explicit backward's
tril(A)^T dO is the same product backwards in time (`reverse=True`). Other
masked products are `torch.where`, which never multiplies.

Padding: T is padded with zero tokens to a multiple of C (q = k = v = 0 and
gk = 0 leave the state untouched); each chunk is padded likewise to Cs * 2^m
rows, the fewest that halve evenly down to leaves of at most Cs rows (no
padding when C and Cs are powers of two). Padded rows come after every real
row, so causality hides them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from laplace_passes._checks import check_chunk_size

# Leaf rows of the intra-chunk halving for a direct call (eager, on the host CPU, where
# 4-row leaves run fastest: benchmarks/bench_gla.py); targets set their own.
DEFAULT_SUB_CHUNK = 4
FLUSH_BELOW = 30.0  # see NOTE [flushing tiny decays]


def _decay(exponent: Tensor) -> Tensor:
    """exp(exponent) for exponent <= 0 (larger values clamped to 0), exactly 0 at or below -FLUSH_BELOW.

    Three elementwise kernels, on the [.., C, K]-sized decay tensors, which
    every level of the intra-chunk halving computes again: each pass counts.
    exp(-inf) is exactly 0 and has gradient 0.
    """
    exponent = F.threshold(exponent.clamp(max=0.0), -FLUSH_BELOW, -math.inf)
    return torch.exp(exponent)


def causal_matmul(scores: Tensor, x: Tensor, reverse: bool = False) -> Tensor:
    """`scores @ x` for a lower-triangular `scores` [.., C, C] (`scores^T @ x` with `reverse`), x [.., C, V].

    A non-finite x[j, c] reaches rows i >= j (i <= j with `reverse`) of
    channel c only, as NaN; see NOTE [non-finite values stay causal].
    """
    product = (scores.transpose(-1, -2) if reverse else scores) @ torch.where(torch.isfinite(x), x, 0.0)
    # x * 0 is 0 where x is finite and NaN where it is not; its running sum
    # along the rows is NaN from the first non-finite entry on, 0 elsewhere.
    poison = x * 0.0
    poison = poison.flip(-2).cumsum(-2).flip(-2) if reverse else poison.cumsum(-2)
    return product + poison


def chunk_plan(seq_len: int, chunk_size: int) -> dict:
    """How a sequence of `seq_len` tokens is tiled: what the report shows per site."""
    check_chunk_size("chunk_size", chunk_size)
    if isinstance(seq_len, bool) or (isinstance(seq_len, int) and seq_len < 0):  # a SymInt passes
        raise ValueError(f"seq_len must be a non-negative int, got {seq_len!r}")
    n_chunks = max(1, math.ceil(seq_len / chunk_size))
    return {
        "T": seq_len,
        "chunk_size": chunk_size,
        "n_chunks": n_chunks,
        "padding": n_chunks * chunk_size - seq_len,
    }


@dataclass(frozen=True)
class ChunkLayout:
    """Where a [B, T, H, D] tensor's rows go in the [B, H, N, C', D] chunk layout."""

    seq_len: int
    chunk: int  # C: real rows per chunk
    sub: int  # Cs: rows per leaf of the intra-chunk halving
    n_chunks: int  # N

    @classmethod
    def plan(cls, seq_len: int, chunk_size: int, sub_chunk_size: int) -> ChunkLayout:
        sub = min(sub_chunk_size, chunk_size)
        return cls(seq_len, chunk_size, sub, chunk_plan(seq_len, chunk_size)["n_chunks"])

    @property
    def padded_chunk(self) -> int:
        """C': the fewest rows, at least C, that halve evenly into leaves of at most Cs rows.

        Cs * 2^m: C itself when C / Cs is a power of two (128 and 16, or 64 and 4).
        """
        leaves = math.ceil(self.chunk / self.sub)
        return self.sub * (1 << (leaves - 1).bit_length())

    def to_chunks(self, x: Tensor) -> Tensor:
        """[B, T, H, D] -> [B, H, N, C', D] in fp32, zero rows padding T and each chunk."""
        B, _, H, D = x.shape
        pad_tokens = self.n_chunks * self.chunk - self.seq_len
        # contiguous: matmuls over a transposed [B, T, H, D] view take a strided
        # path that is an order of magnitude slower on CPU.
        x = x.float()
        if pad_tokens:  # a zero-width pad would still copy the tensor
            x = F.pad(x, (0, 0, 0, 0, 0, pad_tokens))
        x = x.transpose(1, 2).contiguous()
        x = x.reshape(B, H, self.n_chunks, self.chunk, D)
        pad_rows = self.padded_chunk - self.chunk
        return F.pad(x, (0, 0, 0, pad_rows)) if pad_rows else x

    def from_chunks(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """[B, H, N, C', D] -> contiguous [B, T, H, D] in `dtype`, dropping every padded row."""
        B, H, N, _, D = x.shape
        x = x[..., : self.chunk, :].reshape(B, H, N * self.chunk, D)[:, :, : self.seq_len]
        return x.transpose(1, 2).to(dtype).contiguous()


@dataclass
class ChunkedInputs:
    """q (already scaled), k, v and the in-chunk cumulative gates G, in the chunk layout."""

    layout: ChunkLayout
    q: Tensor  # scale * Q
    k: Tensor
    v: Tensor
    gates: Tensor  # gk, unclamped (the backward masks the clamped ones)
    G: Tensor  # cumsum of the clamped gk inside each chunk: non-increasing along rows
    G_last: Tensor  # [.., 1, K]: the last row (padded rows have gk = 0, so it is the chunk's)

    @classmethod
    def build(cls, q, k, v, gk, scale: float, chunk_size: int, sub_chunk_size: int) -> ChunkedInputs:
        layout = ChunkLayout.plan(q.shape[1], chunk_size, sub_chunk_size)
        qc, kc, vc, gc = (layout.to_chunks(x) for x in (q, k, v, gk))
        G = gc.clamp(min=-FLUSH_BELOW).cumsum(-2)  # NOTE [flushing tiny decays]
        return cls(layout, qc * scale, kc, vc, gc, G, G[..., -1:, :])

    def inter_chunk_decays(self) -> tuple[Tensor, Tensor, Tensor]:
        """exp(G) for queries, exp(G_last - G) for keys, exp(G_last) per chunk as [B, H, N, K, 1]."""
        return _decay(self.G), _decay(self.G_last - self.G), _decay(self.G_last).transpose(-1, -2)


@dataclass
class _Halving:
    """One level of IntraChunk: `n` blocks of 2h rows, each split into halves of h rows."""

    half: int
    q_decay: Tensor  # [.., n, h, K]: exp(G - a) on the second halves (the queries)
    k_decay: Tensor  # [.., n, h, K]: exp(a - G) on the first halves (the keys)
    q_anchored: Tensor  # q * q_decay
    k_anchored: Tensor  # k * k_decay


class IntraChunk:
    """tril(A) by recursive halving (NOTE [stable intra-chunk scores]).

    Built once from q (scaled), k and G in the chunk layout, [.., C, K],
    with C = Cs * 2^m (`ChunkLayout.padded_chunk`); `scores()` gives tril(A),
    `gradients(dA)` the gradients of q and k through it, so the explicit
    backward reuses the decays computed here for both. Each level is one
    matmul between the halves of every block; blocks of `leaf` rows (or
    fewer, or odd) are computed elementwise, one diagonal at a time.
    """

    def __init__(self, q: Tensor, k: Tensor, G: Tensor, leaf: int) -> None:
        *self.lead, C, K = q.shape
        self.chunk = C
        self.levels: list[_Halving] = []
        size = C
        while size > leaf and size % 2 == 0:
            self.levels.append(self._halve(q, k, G, size))
            size //= 2
        self.leaf = size
        self.q_leaf, self.k_leaf, G_leaf = (x.reshape(*self.lead, C // size, size, K) for x in (q, k, G))
        # Diagonal d of every leaf: rows c >= d against rows c - d. Its decays
        # exp(G_c - G_(c-d)), [.., n, leaf - d, K] (none on the main diagonal:
        # exp(0) = 1), and a constant [leaf, leaf] with ones on it.
        self.diagonal_decays = [None] + [_decay(G_leaf[..., d:, :] - G_leaf[..., : size - d, :])
                                         for d in range(1, size)]
        self.diagonals = [F.pad(torch.eye(size - d, dtype=q.dtype, device=q.device), (0, d, d, 0)) for d in range(size)]

    def _halve(self, q: Tensor, k: Tensor, G: Tensor, size: int) -> _Halving:
        h, K = size // 2, q.shape[-1]
        q_halves, k_halves, G_halves = (x.reshape(*self.lead, self.chunk // size, 2, h, K) for x in (q, k, G))
        anchor = G_halves[..., 0, -1:, :]  # [.., n, 1, K]: the last row of each first half
        q_decay = _decay(G_halves[..., 1, :, :] - anchor)
        k_decay = _decay(anchor - G_halves[..., 0, :, :])
        return _Halving(h, q_decay, k_decay, q_halves[..., 1, :, :] * q_decay, k_halves[..., 0, :, :] * k_decay)

    def scores(self) -> Tensor:
        """tril(A): [.., C, C], assembled from the leaves up."""
        blocks = self._leaf_scores()  # [.., C/leaf, leaf, leaf]
        for level in reversed(self.levels):
            h = level.half
            halves = blocks.reshape(*self.lead, -1, 2, h, h)
            lower_left = level.q_anchored @ level.k_anchored.transpose(-1, -2)  # [.., n, h, h]
            top = F.pad(halves[..., 0, :, :], (0, h))
            bottom = torch.cat([lower_left, halves[..., 1, :, :]], dim=-1)
            blocks = torch.cat([top, bottom], dim=-2)  # [.., n, 2h, 2h]
        return blocks.reshape(*self.lead, self.chunk, self.chunk)

    def gradients(self, d_scores: Tensor) -> tuple[Tensor, Tensor]:
        """Gradients of (scaled) q and k, [.., C, K] each, given the gradient of tril(A).

        Only the entries tril(A) is built from are read: the upper triangle of
        `d_scores` is ignored.
        """
        lead, C = self.lead, self.chunk
        dq_parts, dk_parts = [], []
        blocks = d_scores
        for level in self.levels:
            h = level.half
            quarters = blocks.reshape(*lead, -1, 2, h, 2, h)
            d_lower_left = quarters[..., 1, :, 0, :]  # [.., n, h, h]
            dq = (d_lower_left @ level.k_anchored) * level.q_decay  # rows of the second halves
            dk = (d_lower_left.transpose(-1, -2) @ level.q_anchored) * level.k_decay  # rows of the first halves
            # Back to [.., C, K]: a zero first (second) half beside each block's rows.
            dq_parts.append(F.pad(dq.unsqueeze(-3), (0, 0, 0, 0, 1, 0)).reshape(*lead, C, -1))
            dk_parts.append(F.pad(dk.unsqueeze(-3), (0, 0, 0, 0, 0, 1)).reshape(*lead, C, -1))
            blocks = torch.stack([quarters[..., 0, :, 0, :], quarters[..., 1, :, 1, :]], dim=-3)
        for dq, dk in self._leaf_gradients(blocks.reshape(*lead, -1, self.leaf, self.leaf)):
            dq_parts.append(dq.reshape(*lead, C, -1))
            dk_parts.append(dk.reshape(*lead, C, -1))
        return sum(dq_parts[1:], dq_parts[0]), sum(dk_parts[1:], dk_parts[0])

    def _leaf_scores(self) -> Tensor:
        """The leaves' lower triangles, [.., n, leaf, leaf], one diagonal at a time."""
        L, blocks = self.leaf, None
        for d, (decay, diagonal) in enumerate(zip(self.diagonal_decays, self.diagonals)):
            products = self.q_leaf[..., d:, :] * self.k_leaf[..., : L - d, :]
            scores = (products if decay is None else products * decay).sum(-1)  # [.., n, L - d]: A[c, c - d]
            placed = _pad_rows(scores.unsqueeze(-1), d, 0) * diagonal  # row c holds it at column c - d
            blocks = placed if blocks is None else blocks + placed
        return blocks

    def _leaf_gradients(self, d_leaf: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per diagonal, its share of the gradients of q and k, [.., n, leaf, K] each."""
        L, parts = self.leaf, []
        for d, (decay, diagonal) in enumerate(zip(self.diagonal_decays, self.diagonals)):
            d_scores = (d_leaf * diagonal).sum(-1)[..., d:].unsqueeze(-1)  # [.., n, L - d, 1]: dA[c, c - d]
            weights = d_scores if decay is None else d_scores * decay
            dq = _pad_rows(weights * self.k_leaf[..., : L - d, :], d, 0)  # rows c
            dk = _pad_rows(weights * self.q_leaf[..., d:, :], 0, d)  # rows c - d
            parts.append((dq, dk))
        return parts


def _pad_rows(x: Tensor, before: int, after: int) -> Tensor:
    """x [.., R, D] with zero rows added before and after; x itself when there are none (a pad would copy)."""
    return F.pad(x, (0, 0, before, after)) if before or after else x


def chunk_recurrence(
    terms: Tensor, decay: Tensor, start: Tensor | None, reverse: bool = False
) -> tuple[Tensor, Tensor]:
    """h = decay_n * h + terms_n over the chunks n, from `start` (zeros when None); backwards when `reverse`.

    `terms` [B, H, N, K, V], `decay` [B, H, N, K, 1]. Returns the value of h
    entering each chunk's step, stacked [B, H, N, K, V], and h after the
    last step. The forward's states and the backward's state gradients are
    this one recurrence, run forward and in reverse: the only sequential
    loops of chunked GLA, one step per chunk when traced.
    """
    B, H, N, K, V = terms.shape
    h = terms.new_zeros(B, H, K, V) if start is None else start.float()
    entering: list[Tensor] = [h] * N
    for n in reversed(range(N)) if reverse else range(N):
        entering[n] = h
        h = decay[:, :, n] * h + terms[:, :, n]
    return torch.stack(entering, dim=2), h


def entering_states(k_to_end: Tensor, v: Tensor, chunk_decay: Tensor, initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """The state entering every chunk, [B, H, N, K, V], and the final state.

    S_{n+1} = exp(G_last) * S_n + (K exp(G_last - G))^T V, every chunk's update computed at once.
    """
    return chunk_recurrence(k_to_end.transpose(-1, -2) @ v, chunk_decay, initial_state)


def chunked_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gk: Tensor,
    initial_state: Tensor | None,
    scale: float,
    chunk_size: int,
    sub_chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """GLA chunk by chunk: (o in q's dtype [B, T, H, V], final state in fp32 [B, H, K, V]).

    Arguments are not checked here (see `laplace_passes.chunked.chunked_gla`); this is
    the body of the `laplace::chunked_gla` op, differentiable by autograd too.
    """
    x = ChunkedInputs.build(q, k, v, gk, scale, chunk_size, sub_chunk_size)
    scores = IntraChunk(x.q, x.k, x.G, x.layout.sub).scores()  # [B, H, N, C', C'], causal
    q_decay, k_decay, chunk_decay = x.inter_chunk_decays()
    states, final_state = entering_states(x.k * k_decay, x.v, chunk_decay, initial_state)
    o = causal_matmul(scores, x.v) + (x.q * q_decay) @ states
    return x.layout.from_chunks(o, q.dtype), final_state
