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
128-token chunks and gates logsigmoid(x)/0.1 it does). So the chunk is split
into sub-chunks of Cs rows. A query sub-chunk i uses the anchor a_i = G at its
first row:
  * key sub-chunks j < i: (Q_i * exp(G_i - a_i)) @ (K_j * exp(a_i - G_j))^T,
    both exponents <= 0 because G is non-increasing and a_i lies in the past
    of the rows of i and the future of the rows of j (the key factor is
    built in two pieces: NOTE [three-factor anchors]);
  * the diagonal block j == i: split the same way again (NOTE [nested
    sub-chunks]: 16-row blocks into 4-row groups), and the smallest diagonal
    blocks computed elementwise, sum_k Q_ck K_dk exp(G_ck - G_dk) over a
    [.., 4, 4, K] tensor, exponent <= 0 for d <= c.
Every exponent is clamped at 0 *before* exp (`_decay`), including entries
that the causal mask then discards: an inf there would turn into NaN in a
backward (0 * inf), even though the forward masks it away.

NOTE [three-factor anchors]
The key factor exp(a_i - G_j) is the one [.., S, C, K] tensor of the chunked
form (one copy of the keys per query sub-chunk), so it is built without an
exp per element: with b_j = G at the last row of key sub-chunk j,

    exp(a_i - G_k) = exp(a_i - b_j) * exp(b_j - G_k)       (row k in sub-chunk j < i)

The second factor is one [.., C, K] tensor shared by every query sub-chunk,
the first one number per (i, j, channel), [.., S, S, K]; the big tensor is a
single broadcast product of the two. Both exponents are <= 0 for j < i (b_j
lies between the rows of j and a_i), so nothing overflows, and each factor
is flushed on its own (NOTE [flushing tiny decays]): a term is dropped only
when one of its three factors (query, between, key) is below exp(-30), which
implies the whole decay is. A gate of -30 (a reset) lies inside exactly one
of the three spans, so decays across a reset stay exactly 0. Every term is
still exp(G_q - G_k) or 0, so the backward's dG rule holds unchanged.

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
gk = 0 leave the state untouched); each chunk is padded likewise to a multiple
of Cs. Padded rows come after every real row, so causality hides them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from laplace_passes._checks import check_chunk_size

DEFAULT_SUB_CHUNK = 16
FLUSH_BELOW = 30.0  # see NOTE [flushing tiny decays]


def _decay(exponent: Tensor) -> Tensor:
    """exp(exponent) for exponent <= 0 (larger values clamped to 0), exactly 0 at or below -FLUSH_BELOW.

    Three elementwise kernels: these tensors are the largest in the
    computation ([.., Cs, Cs, K] and [.., S, C, K]), so each pass counts.
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
    sub: int  # Cs: rows per sub-chunk
    n_chunks: int  # N

    @classmethod
    def plan(cls, seq_len: int, chunk_size: int, sub_chunk_size: int) -> ChunkLayout:
        sub = min(sub_chunk_size, chunk_size)
        return cls(seq_len, chunk_size, sub, chunk_plan(seq_len, chunk_size)["n_chunks"])

    @property
    def padded_chunk(self) -> int:
        """C': C rounded up to whole sub-chunks."""
        return math.ceil(self.chunk / self.sub) * self.sub

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


def nested_sub_chunks(sub: int) -> tuple[int, ...]:
    """Sub-chunk sizes, outermost first: each level's diagonal blocks are split again, by 4.

    NOTE [nested sub-chunks]: the diagonal blocks are the costly part
    (elementwise over [.., Cs, Cs, K]). Splitting each 16-row block into
    4-row groups, anchored the same way, turns most of it into small
    matmuls: elementwise work per token and channel drops from
    C/16 + 16 = 24 to C/16 + 16/4 + 4 = 16 (C = 128).
    """
    sizes = [sub]
    while sizes[-1] > 4 and sizes[-1] % 4 == 0:
        sizes.append(sizes[-1] // 4)
    return tuple(sizes)


class IntraChunk:
    """The sub-chunk factors of tril(A) (NOTE [stable intra-chunk scores]).

    Built once from q (scaled), k and G in the chunk layout, [.., C, K];
    `scores()` gives tril(A), `gradients(dA)` the gradients of q and k
    through it, so the explicit backward reuses the decays it computes for
    both. `sizes` are the sub-chunk sizes, outermost first: the diagonal
    blocks of one level are the chunks of the next (NOTE [nested
    sub-chunks]); the last level's are computed elementwise.
    """

    def __init__(self, q: Tensor, k: Tensor, G: Tensor, sizes: tuple[int, ...]) -> None:
        *lead, C, K = q.shape
        sub = sizes[0]
        S = C // sub
        self.sub, self.n_sub, self.chunk = sub, S, C
        self.q_sub = q.reshape(*lead, S, sub, K)
        self.k_sub = k.reshape(*lead, S, sub, K)
        G_sub = G.reshape(*lead, S, sub, K)
        anchors = G_sub[..., :1, :]  # [.., S, 1, K]: first row of each query sub-chunk
        ends = G_sub[..., -1:, :]  # [.., S, 1, K]: last row of each key sub-chunk

        # Blocks against earlier key sub-chunks, in three factors (NOTE [three-factor
        # anchors]): each query sub-chunk i against the whole chunk, keeping only
        # key sub-chunks j before it.
        self.q_anchor_decay = _decay(G_sub - anchors)  # [.., S, sub, K]: exp(G_q - a_i)
        self.k_end_decay = _decay(ends - G_sub)  # [.., S, sub, K]: exp(b_j - G_k)
        self.between = _decay(anchors - ends.transpose(-3, -2)).unsqueeze(-2)  # [.., S_i, S_j, 1, K]: exp(a_i - b_j)
        self.q_anchored = self.q_sub * self.q_anchor_decay
        k_ended = (self.k_sub * self.k_end_decay).unsqueeze(-4)  # [.., 1, S_j, sub, K]
        self.k_anchored = (k_ended * self.between).reshape(*lead, S, C, K)  # the only [.., S, C, K] tensor
        key_sub = torch.arange(C, device=q.device) // sub
        query_sub = torch.arange(S, device=q.device)
        self.earlier = (key_sub[None, :] < query_sub[:, None])[:, None, :]  # [S, 1, C]

        # Diagonal blocks: the next level, or elementwise with exponent G_c - G_d per (c, d).
        self.inner = IntraChunk(self.q_sub, self.k_sub, G_sub, sizes[1:]) if len(sizes) > 1 else None
        if self.inner is None:
            self.diag_decay = _decay(G_sub.unsqueeze(-2) - G_sub.unsqueeze(-3))  # [.., S, c, d, K]
            self.causal = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril()

    def scores(self) -> Tensor:
        """tril(A): [.., C, C]."""
        *lead, S, sub, _ = self.q_sub.shape
        off_diag = self.q_anchored @ self.k_anchored.transpose(-1, -2)  # [.., S, sub, C]
        off_diag = torch.where(self.earlier, off_diag, 0.0).reshape(*lead, self.chunk, self.chunk)
        return off_diag + self._place_diagonal(self._diagonal_scores())

    def gradients(self, d_scores: Tensor) -> tuple[Tensor, Tensor]:
        """Gradients of (scaled) q and k, [.., C, K] each, given the gradient of tril(A)."""
        *lead, S, sub, K = self.q_sub.shape
        d_off = torch.where(self.earlier, d_scores.reshape(*lead, S, sub, self.chunk), 0.0)
        dq = (d_off @ self.k_anchored) * self.q_anchor_decay  # [.., S, sub, K]
        # Per key sub-chunk j: its rows of d_off^T [sub, C] against every query
        # row scaled by exp(a_i - b_j): one matmul contracting all C queries, not
        # S products contracting `sub` rows each and summed afterwards.
        d_off_t = d_off.reshape(*lead, self.chunk, self.chunk).transpose(-1, -2).reshape(*lead, S, sub, self.chunk)
        between_t = self.between.transpose(-4, -3).contiguous()  # [.., S_j, S_i, 1, K], small
        q_between = (self.q_anchored.unsqueeze(-4) * between_t).reshape(*lead, S, self.chunk, K)  # [.., S_j, C, K]
        dk = ((d_off_t @ q_between) * self.k_end_decay).reshape(*lead, self.chunk, K)
        dq_diag, dk_diag = self._diagonal_gradients(self._take_diagonal(d_scores))  # [.., S, sub, K] each
        return (dq + dq_diag).reshape(*lead, self.chunk, K), dk + dk_diag.reshape(*lead, self.chunk, K)

    def _diagonal_scores(self) -> Tensor:
        """tril of each diagonal block: [.., S, sub, sub]."""
        if self.inner is not None:
            return self.inner.scores()
        diag = (self.q_sub.unsqueeze(-2) * self.k_sub.unsqueeze(-3) * self.diag_decay).sum(-1)
        return torch.where(self.causal, diag, 0.0)

    def _diagonal_gradients(self, d_diag: Tensor) -> tuple[Tensor, Tensor]:
        if self.inner is not None:
            return self.inner.gradients(d_diag)
        weighted = self.diag_decay * torch.where(self.causal, d_diag, 0.0).unsqueeze(-1)  # [.., S, c, d, K]
        dq = (weighted * self.k_sub.unsqueeze(-3)).sum(-2)
        dk = (weighted * self.q_sub.unsqueeze(-2)).sum(-3)
        return dq, dk

    def _place_diagonal(self, diag: Tensor) -> Tensor:
        """[.., S, sub, sub] blocks -> [.., C, C] block-diagonal matrix."""
        *lead, S, sub, _ = diag.shape
        eye = torch.eye(S, dtype=diag.dtype, device=diag.device)
        return (diag.unsqueeze(-2) * eye[:, None, :, None]).reshape(*lead, self.chunk, self.chunk)

    def _take_diagonal(self, x: Tensor) -> Tensor:
        """[.., C, C] -> its [.., S, sub, sub] diagonal blocks.

        A mask and a sum rather than torch.diagonal: a contiguous result whose
        layout no later rewrite of `diagonal` (for lowering) can change.
        """
        *lead, _, _ = x.shape
        blocks = x.reshape(*lead, self.n_sub, self.sub, self.n_sub, self.sub)
        eye = torch.eye(self.n_sub, dtype=x.dtype, device=x.device)
        return (blocks * eye[:, None, :, None]).sum(-2)


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
    scores = IntraChunk(x.q, x.k, x.G, nested_sub_chunks(x.layout.sub)).scores()  # [B, H, N, C', C'], causal
    q_decay, k_decay, chunk_decay = x.inter_chunk_decays()
    states, final_state = entering_states(x.k * k_decay, x.v, chunk_decay, initial_state)
    o = causal_matmul(scores, x.v) + (x.q * q_decay) @ states
    return x.layout.from_chunks(o, q.dtype), final_state
