"""Chunked GLA forward in standard PyTorch ops: the computation the re-tiling pass installs.

The sequence is cut into chunks of C tokens (C = the target's partition count,
128 on trn2). Per chunk n, with G the inclusive cumulative sum of gk inside the
chunk, G_last its last row and S_n the state entering the chunk:

    O_n     = scale * (Q * exp(G)) S_n  +  tril(A) V
    A_ij    = scale * sum_k Q_ik K_jk exp(G_ik - G_jk)          (j <= i)
    S_{n+1} = diag(exp(G_last)) S_n + (K * exp(G_last - G))^T V

This module holds the forward (`chunked_forward`) and the pieces the explicit
backward (`laplace_passes.ops.chunked_backward`) shares with it. Both are plain
functions of tensors whose only Python loop is the one over chunks, so a
trace at a static shape (`make_fx`) is straight-line code with one state
update per chunk. The public entry point, `chunked_gla`, and the
`laplace::chunked_gla` op that carries the explicit backward live in
`laplace_passes.ops.chunked`.

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
in the future of every key and the past of every query, so no factor
exceeds 1; each is flushed on its own (NOTE [flushing tiny decays]): a term
is dropped only when its query or key factor is below exp(-30), which
implies the whole decay exp(G_q - G_k) is. A gate of -30 (a reset) lies on
one side of the anchor, so decays across a reset stay exactly 0, and every
term is still exp(G_q - G_k) or 0, so the backward's dG rule holds
unchanged.

Each token is a query or a key of exactly one off-diagonal block per level,
so every level costs one [.., C, K] elementwise pass and no tensor grows
beyond [.., C, K] (an anchor per query sub-chunk instead would need a copy
of the keys for each query sub-chunk, [.., C/Cs, C, K]). Blocks
are halved down to `sub_chunk_size` rows, the leaves, whose scores are
computed elementwise, one diagonal at a time: for each offset d < Cs, row c
of every leaf against row c - d,

    A[c, c - d] = sum_k Q_ck K_(c-d)k exp(G_ck - G_(c-d)k)

over [.., Cs - d, K] slices, so only the lower triangle is computed:
(Cs + 1) / 2 products per token and channel, and no [.., Cs, Cs, K] tensor.
The leaf size trades that elementwise work against more, smaller matmuls:
on trn2's size model 16-row leaves give the fewest instructions; on a CPU
4-row leaves run fastest eagerly and 8-row ones compiled by Inductor
(`HardwareTarget.sub_chunk_size`).

NOTE [decays as products]
G itself is never formed. Every decay above is exp of a sum of gates over a
run of consecutive tokens, so it is the product of those tokens' own decays
exp(gk), taken once per token and channel (`ChunkedInputs.steps`, the only
exp of the chunked form), and built bottom-up:
  * leaf diagonal d is diagonal d - 1 times one more token's decay;
  * each leaf row has its prefix exp(G_r - G_(start-1)) and suffix
    exp(G_end - G_r) within its leaf, read off the diagonals;
  * a level's query decay exp(G - a) is a row's leaf prefix times the
    whole decays of the leaves before its leaf in the second half; its key
    decay exp(a - G) the leaf suffix times those of the leaves after it in
    the first half. Those products of whole leaves are one [.., K] row per
    leaf, built level by level as halves merge, so a level forms no
    [.., C, K] decay beyond its anchored halves (merging whole [.., C, K]
    prefixes and suffixes per level instead, a copy of each unchanged half
    per level, made the step 1.14x slower under Inductor);
  * at the top, the chunk's prefix and suffix are the inter-chunk decays
    exp(G) and exp(G_last - G), and its last prefix exp(G_last).
Every factor is at most 1, and each product is flushed (NOTE [flushing
tiny decays]), so no product overflows and none goes denormal. A decay
over n tokens is the product of their n decays, n - 1 roundings however the
tree groups them: relative error at most (n - 1) fp32 ulps and about
sqrt(n) in practice, whatever the gates did before. exp(G_q - G_k) would
carry the rounding of G instead, which grows with |G| (G = -960 has an ulp
of 6e-5; the test `test_decays_after_a_long_strong_decay_keep_fp32_precision`
measures 2.4e-5 relative error in that form and 2e-7 in this one).
Work: one exp per token and channel instead of one per token, channel and
level (an exp costs about four multiplies on a CPU), no cumulative sum of
the gates, and a product and a flush per level where there were a
difference, a clamp, a flush and an exp.

NOTE [flushing tiny decays]
Strong gates drive decays far below fp32's smallest normal number (1.2e-38).
Denormal operands make CPU matmuls about 100x slower, so every decay factor
at or below exp(-FLUSH_BELOW) (exp(-30), about 1e-13) is set to exactly 0:
each token decay, and each product of decays as it is formed, so a product
of two unflushed factors (each above 1e-13) is a normal number. The terms
dropped weigh less than 1e-13 against the token's own term (weight 1): far
under fp32 rounding. GPUs and Trainium flush denormals in hardware; this
does it in the graph, so it holds for every backend. A gate at or below
-FLUSH_BELOW (a hard reset, -inf, or fp16 overflow) gives a token decay of
exactly 0, so every decay across it is 0, and its gradient is 0.

NOTE [non-finite values stay causal]
tril(A) V is one matmul whose masked entries are exact zeros, and IEEE says
0 * inf = NaN: an inf in v at token j would turn every row of the chunk
non-finite, outputs before j included, though no earlier token depends on
it (the recurrence keeps them finite). `causal_matmul` multiplies by v with
its non-finite entries zeroed and marks as NaN exactly the (row, channel)
pairs at or after the first non-finite entry of that channel (one
reduction per channel: no running sum along the rows, which Inductor would
leave to an eager scan). The explicit backward's
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
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from laplace_passes.infra.checks import check_chunk_size

# Leaf rows of the intra-chunk halving for a direct call (eager, on the host CPU, where
# 4-row leaves run fastest: benchmarks/bench_gla.py); targets set their own (the cpu target 8, for Inductor).
DEFAULT_SUB_CHUNK = 4
FLUSH_BELOW = 30.0  # see NOTE [flushing tiny decays]
FLUSH_FACTOR = math.exp(-FLUSH_BELOW)


def _decay(gates: Tensor) -> Tensor:
    """Each token's decay exp(gk): gk clamped at 0 (a positive gate decays nothing), exactly 0 at or below -FLUSH_BELOW.

    The only exp of the chunked form (NOTE [decays as products]); exp(-inf)
    is exactly 0 and has gradient 0, so a flushed token passes no gradient.
    """
    return torch.exp(F.threshold(gates.clamp(max=0.0), -FLUSH_BELOW, -math.inf))


def causal_matmul(scores: Tensor, x: Tensor, reverse: bool = False) -> Tensor:
    """`scores @ x` for a lower-triangular `scores` [.., C, C] (`scores^T @ x` with `reverse`), x [.., C, V].

    A non-finite x[j, c] reaches rows i >= j (i <= j with `reverse`) of
    channel c only, as NaN; see NOTE [non-finite values stay causal].
    """
    # x * 0 is 0 exactly where x is finite (NaN at inf and NaN): a compare Inductor vectorises,
    # where isfinite and nan_to_num become a scalar loop in its C++ (6 ms of a 100 ms step).
    finite = x * 0.0 == 0.0
    product = (scores.transpose(-1, -2) if reverse else scores) @ torch.where(finite, x, 0.0)
    # Row numbers in x's float dtype (exact up to 2^24): no integer constant for a Neuron export.
    rows = torch.arange(x.shape[-2], dtype=x.dtype, device=x.device).unsqueeze(-1)  # [C, 1]
    # Per channel, the first (last, with `reverse`) non-finite row: a reduction, where a running
    # sum of x * 0 along the rows is a scan Inductor leaves to an eager cumsum on a CPU.
    if reverse:
        last_bad = torch.where(finite, -1, rows).amax(-2, keepdim=True)
        poisoned = rows <= last_bad
    else:
        first_bad = torch.where(finite, x.shape[-2], rows).amin(-2, keepdim=True)
        poisoned = rows >= first_bad
    return torch.where(poisoned, math.nan, product)


def chunk_plan(seq_len: int, chunk_size: int) -> dict:
    """How a sequence of `seq_len` tokens is tiled: what the report shows per site."""
    check_chunk_size("chunk_size", chunk_size)
    if isinstance(seq_len, bool) or (isinstance(seq_len, int) and seq_len < 0):  # a SymInt passes
        raise ValueError(f"seq_len must be a non-negative int, got {seq_len!r}")
    # Integer ceil, and sym_max (plain max for ints): a SymInt T (fake tensors) stays symbolic, unguarded.
    n_chunks = torch.sym_max(1, (seq_len + chunk_size - 1) // chunk_size)
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
    """q (already scaled), k, v and each token's decay exp(gk), in the chunk layout."""

    layout: ChunkLayout
    q: Tensor  # scale * Q
    k: Tensor
    v: Tensor
    gates: Tensor  # gk, unclamped (the backward masks the flushed ones)
    steps: Tensor  # exp(gk): the decay of one token, flushed (NOTE [flushing tiny decays])

    @classmethod
    def build(cls, q, k, v, gk, scale: float, chunk_size: int, sub_chunk_size: int) -> ChunkedInputs:
        layout = ChunkLayout.plan(q.shape[1], chunk_size, sub_chunk_size)
        qc, kc, vc, gc = (layout.to_chunks(x) for x in (q, k, v, gk))
        return cls(layout, qc * scale, kc, vc, gc, _decay(gc))


@dataclass
class _Halving:
    """One level of IntraChunk: `n` blocks of 2h rows, each split into halves of h rows."""

    half: int
    q_decay: Tensor  # [.., n, h, K]: exp(G - a) on the second halves (the queries)
    k_decay: Tensor  # [.., n, h, K]: exp(a - G) on the first halves (the keys)
    q_anchored: Tensor  # q * q_decay
    k_anchored: Tensor  # k * k_decay


class IntraChunk:
    """tril(A) by recursive halving (NOTE [stable intra-chunk scores]), every decay a product of token decays.

    Built once from q (scaled), k and the token decays exp(gk) in the chunk
    layout, [.., C, K], with C = Cs * 2^m (`ChunkLayout.padded_chunk`);
    `scores()` gives tril(A), `gradients(dA)` the gradients of q and k
    through it, and `chunk_decays()` the decays the inter-chunk part needs,
    so the explicit backward reuses everything computed here. Each level is
    one matmul between the halves of every block; blocks of `leaf` rows (or
    fewer, or odd) are computed elementwise, one diagonal at a time.
    NOTE [decays as products] says how the decays are built.
    """

    def __init__(self, q: Tensor, k: Tensor, steps: Tensor, leaf: int) -> None:
        *self.lead, C, K = q.shape
        self.chunk = C
        size = C
        while size > leaf and size % 2 == 0:
            size //= 2
        self.leaf = size
        self.q_leaf, self.k_leaf, steps_leaf = (x.reshape(*self.lead, C // size, size, K) for x in (q, k, steps))
        self.diagonal_decays = _diagonal_decays(steps_leaf)
        self.diagonals = [F.pad(torch.eye(size - d, dtype=q.dtype, device=q.device), (0, d, d, 0)) for d in range(size)]
        self.levels: list[_Halving] = []  # coarsest first
        self._build_levels(q, k, *_leaf_prefix_suffix(steps_leaf, self.diagonal_decays))

    def _build_levels(self, q: Tensor, k: Tensor, leaf_prefix: Tensor, leaf_suffix: Tensor) -> None:
        """Every level's anchored halves, from the leaves up, and the chunk's prefix and suffix decays.

        leaf_prefix, leaf_suffix [.., leaves, L, K]: each row's decay since its
        leaf began and to its leaf's end. How they and the products of whole
        leaves make every level's decays: NOTE [decays as products].
        """
        lead, C, L, K = self.lead, self.chunk, self.leaf, q.shape[-1]
        # Per leaf, the decay across the leaves before (after) it in its half, [.., leaves, 1, K]:
        # nothing (1) while each half is one leaf. Per half, its whole decay, [.., halves, 1, K].
        before = after = torch.ones_like(leaf_prefix[..., -1:, :])
        totals = leaf_prefix[..., -1:, :]
        size = L
        while size < C:
            n, g = C // (2 * size), size // L  # blocks at this level, leaves per half
            b, a = (x.reshape(*lead, n, 2, g, 1, K) for x in (before, after))
            p, s = (x.reshape(*lead, n, 2, g, L, K) for x in (leaf_prefix, leaf_suffix))
            q_decay = _flush(p[..., 1, :, :, :] * b[..., 1, :, :, :]).reshape(*lead, n, size, K)
            k_decay = _flush(s[..., 0, :, :, :] * a[..., 0, :, :, :]).reshape(*lead, n, size, K)
            q_halves, k_halves = (x.reshape(*lead, n, 2, size, K) for x in (q, k))
            self.levels.insert(0, _Halving(size, q_decay, k_decay,
                                           q_halves[..., 1, :, :] * q_decay, k_halves[..., 0, :, :] * k_decay))
            t = totals.reshape(*lead, n, 2, 1, 1, K)
            first_total, second_total = t[..., 0, :, :, :], t[..., 1, :, :, :]  # [.., n, 1, 1, K]
            before = torch.stack([b[..., 0, :, :, :], _flush(b[..., 1, :, :, :] * first_total)], dim=-4)
            after = torch.stack([_flush(a[..., 0, :, :, :] * second_total), a[..., 1, :, :, :]], dim=-4)
            before, after = (x.reshape(*lead, C // L, 1, K) for x in (before, after))
            totals = _flush(first_total * second_total).reshape(*lead, n, 1, K)
            size *= 2
        self.prefix = _flush(leaf_prefix * before).reshape(*lead, C, K)
        self.suffix = _flush(leaf_suffix * after).reshape(*lead, C, K)

    def chunk_decays(self) -> tuple[Tensor, Tensor, Tensor]:
        """exp(G) for queries, exp(G_last - G) for keys, exp(G_last) per chunk as [B, H, N, K, 1]."""
        return self.prefix, self.suffix, self.prefix[..., -1:, :].transpose(-1, -2)

    def scores(self) -> Tensor:
        """tril(A): [.., C, C], assembled from the leaves up."""
        blocks = self._leaf_scores()  # [.., C/leaf, leaf, leaf]
        for level in reversed(self.levels):
            h = level.half
            # Sizes, not -1, in the reshapes below: -1 is ambiguous when B or H is 0.
            halves = blocks.reshape(*self.lead, self.chunk // (2 * h), 2, h, h)
            lower_left = level.q_anchored @ level.k_anchored.transpose(-1, -2)  # [.., n, h, h]
            top = F.pad(halves[..., 0, :, :], (0, h))
            bottom = torch.cat([lower_left, halves[..., 1, :, :]], dim=-1)
            blocks = torch.cat([top, bottom], dim=-2)  # [.., n, 2h, 2h]
        return blocks.reshape(*self.lead, self.chunk, self.chunk)

    def gradients(self, d_scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of (scaled) q and k through tril(A) below its diagonal, [.., C, K] each, and the diagonal's
        gradient dA[c, c], [.., C, 1], given the gradient of tril(A).

        The whole gradients are dq + dA[c, c] * k and dk + dA[c, c] * q; the
        diagonal is kept apart for the gates' gradient, which it does not
        reach (NOTE [the diagonal apart] in laplace_passes/ops/chunked_backward.py).
        Only the entries tril(A) is built from are read: the upper triangle of
        `d_scores` is ignored.
        """
        lead, C = self.lead, self.chunk
        level_gradients = []
        blocks = d_scores
        for level in self.levels:
            h = level.half
            quarters = blocks.reshape(*lead, C // (2 * h), 2, h, 2, h)  # sizes, not -1: B or H may be 0
            d_lower_left = quarters[..., 1, :, 0, :]  # [.., n, h, h]
            dq = (d_lower_left @ level.k_anchored) * level.q_decay  # rows of the second halves
            dk = (d_lower_left.transpose(-1, -2) @ level.q_anchored) * level.k_decay  # rows of the first halves
            level_gradients.append((h, dq, dk))
            blocks = torch.stack([quarters[..., 0, :, 0, :], quarters[..., 1, :, 1, :]], dim=-3)
        dq, dk, diagonal = self._leaf_gradients(blocks.reshape(*lead, C // self.leaf, self.leaf, self.leaf))
        # From the leaves up, each level's gradients added to the rows they belong to as the
        # blocks double (no zero-padded [.., C, K] copy per level to sum: eager 1.2x).
        for h, dq_level, dk_level in reversed(level_gradients):
            dq, dk = (x.reshape(*lead, C // (2 * h), 2, h, x.shape[-1]) for x in (dq, dk))  # K may be 0
            dq = torch.stack([dq[..., 0, :, :], dq[..., 1, :, :] + dq_level], dim=-3)
            dk = torch.stack([dk[..., 0, :, :] + dk_level, dk[..., 1, :, :]], dim=-3)
        return dq.reshape(*lead, C, dq.shape[-1]), dk.reshape(*lead, C, dk.shape[-1]), diagonal.reshape(*lead, C, 1)

    def _leaf_scores(self) -> Tensor:
        """The leaves' lower triangles, [.., n, leaf, leaf], one diagonal at a time."""
        L, blocks = self.leaf, None
        for d, (decay, diagonal) in enumerate(zip(self.diagonal_decays, self.diagonals)):
            products = self.q_leaf[..., d:, :] * self.k_leaf[..., : L - d, :]
            scores = (products if decay is None else products * decay).sum(-1)  # [.., n, L - d]: A[c, c - d]
            placed = _pad_rows(scores.unsqueeze(-1), d, 0) * diagonal  # row c holds it at column c - d
            blocks = placed if blocks is None else blocks + placed
        return blocks

    def _leaf_gradients(self, d_leaf: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The gradients of q and k through the leaves' scores below the diagonal, [.., n, leaf, K] each (every
        diagonal's share summed), and the main diagonal's dA[c, c], [.., n, leaf, 1], apart."""
        L, dq, dk, main = self.leaf, None, None, None
        for d, (decay, diagonal) in enumerate(zip(self.diagonal_decays, self.diagonals)):
            d_scores = (d_leaf * diagonal).sum(-1)[..., d:].unsqueeze(-1)  # [.., n, L - d, 1]: dA[c, c - d]
            if d == 0:
                main = d_scores
                continue
            weights = d_scores * decay  # below the diagonal: every decay is a tensor (only d = 0's is None)
            dq_part = _pad_rows(weights * self.k_leaf[..., : L - d, :], d, 0)  # rows c
            dk_part = _pad_rows(weights * self.q_leaf[..., d:, :], 0, d)  # rows c - d
            dq = dq_part if dq is None else dq + dq_part
            dk = dk_part if dk is None else dk + dk_part
        if dq is None:  # leaves of one row: nothing below the diagonal
            dq, dk = torch.zeros_like(self.q_leaf), torch.zeros_like(self.k_leaf)
        return dq, dk, main


def _pad_rows(x: Tensor, before: int, after: int) -> Tensor:
    """x [.., R, D] with zero rows added before and after; x itself when there are none (a pad would copy)."""
    return F.pad(x, (0, 0, before, after)) if before or after else x


def _flush(decay: Tensor) -> Tensor:
    """A product of decays, exactly 0 at or below exp(-FLUSH_BELOW) (NOTE [flushing tiny decays])."""
    return F.threshold(decay, FLUSH_FACTOR, 0.0)


def _diagonal_decays(steps: Tensor) -> list[Tensor | None]:
    """Per diagonal d of every leaf, exp(G_c - G_(c-d)) for its rows c >= d: [.., n, L - d, K].

    None for d = 0 (exp(0) = 1). Diagonal d is diagonal d - 1 times one more
    token's decay: D_d[c] = D_(d-1)[c] * exp(gk_(c-d+1)).
    """
    L = steps.shape[-2]
    decays: list[Tensor | None] = [None]
    for d in range(1, L):
        step = steps[..., 1 : L - d + 1, :]  # the token c - d + 1 of each row c = d .. L-1
        decays.append(step if d == 1 else _flush(decays[-1][..., 1:, :] * step))
    return decays


def _leaf_prefix_suffix(steps: Tensor, diagonal_decays: list[Tensor | None]) -> tuple[Tensor, Tensor]:
    """Each leaf row's decay since the leaf began, exp(G_c - G_(-1)), and to its end, exp(G_(L-1) - G_c).

    Read off the diagonals: the prefix of row c is the leaf's first token
    decay times diagonal c's first row, the suffix of row c diagonal
    L - 1 - c's last row (1 for the last row).
    """
    first = steps[..., :1, :]
    prefix = [first] + [_flush(first * decay[..., :1, :]) for decay in diagonal_decays[1:]]
    suffix = [decay[..., -1:, :] for decay in reversed(diagonal_decays[1:])] + [torch.ones_like(first)]
    return torch.cat(prefix, dim=-2), torch.cat(suffix, dim=-2)


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


# What runs the recurrence over chunks: `chunk_recurrence` (a Python loop: unrolled when traced) or a
# function of the same signature, e.g. the `laplace::chunk_recurrence` op that a trace keeps as one node.
Recurrence = Callable[[Tensor, Tensor, "Tensor | None", bool], "tuple[Tensor, Tensor]"]


def entering_states(k_to_end: Tensor, v: Tensor, chunk_decay: Tensor, initial_state: Tensor | None,
                    recurrence: Recurrence = chunk_recurrence) -> tuple[Tensor, Tensor]:
    """The state entering every chunk, [B, H, N, K, V], and the final state.

    S_{n+1} = exp(G_last) * S_n + (K exp(G_last - G))^T V, every chunk's update computed at once.
    """
    return recurrence(k_to_end.transpose(-1, -2) @ v, chunk_decay, initial_state, False)


def chunked_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gk: Tensor,
    initial_state: Tensor | None,
    scale: float,
    chunk_size: int,
    sub_chunk_size: int,
    recurrence: Recurrence = chunk_recurrence,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """GLA chunk by chunk: o in q's dtype [B, T, H, V], then in fp32 the final state [B, H, K, V] and the residuals.

    The residuals are what the explicit backward would otherwise recompute
    (NOTE [explicit chunked backward]): the states entering each chunk
    [B, H, N, K, V] and tril(A) [B, H, N, C', C'] (scaled, padded rows and all).
    Arguments are not checked here (see `laplace_passes.ops.chunked.chunked_gla`); this is
    the body of the `laplace::chunked_gla` op, differentiable by autograd too. `recurrence` runs the
    states' recurrence over chunks (`chunk_recurrence`, or the op a trace keeps whole).
    """
    x = ChunkedInputs.build(q, k, v, gk, scale, chunk_size, sub_chunk_size)
    intra = IntraChunk(x.q, x.k, x.steps, x.layout.sub)
    scores = intra.scores()  # [B, H, N, C', C'], causal
    q_decay, k_decay, chunk_decay = intra.chunk_decays()
    states, final_state = entering_states(x.k * k_decay, x.v, chunk_decay, initial_state, recurrence)
    o = causal_matmul(scores, x.v) + (x.q * q_decay) @ states
    return x.layout.from_chunks(o, q.dtype), final_state, states, scores
