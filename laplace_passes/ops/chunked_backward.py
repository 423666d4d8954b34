"""The explicit backward of chunked GLA: a reverse recurrence over chunks, states recomputed.

NOTE [explicit chunked backward]
Per chunk, in the chunk layout (Q already scaled, Qd = Q * exp(G), Kd =
K * exp(G_last - G), S the state entering the chunk, S' the state leaving it,
dS' its gradient, M = tril(A)):

    O  = Qd S + M V                 S' = exp(G_last)^T * S + Kd^T V

so, with dO given and dS' = dh_n coming from the chunk after:

    dS   = exp(G_last)^T * dS' + Qd^T dO         (reverse over chunks; dS of chunk 0 is dh0)
    dV   = M^T dO + Kd dS'
    dQ   = (dO S^T) * exp(G)            + [intra: dM = dO V^T through M]
    dK   = (V dS'^T) * exp(G_last - G)  + [intra]
    dG   = Q * dQ - K * dK              (every exp(G_i - G_j) term: +1 on i, -1 on j)
    dG_last += rowsum over the chunk of K * dK_inter + exp(G_last) * rowsum_v(S * dS')
    dgk  = reverse cumsum of dG inside the chunk (G_last is the last row of G)

The decays, intra-chunk and inter-chunk, come from one IntraChunk built as
in the forward (NOTE [decays as products]): products of token decays, each
at most 1 and flushed like the forward's, so flushed decays have zero
gradient. Each intra-chunk term is exp(G_i - a) exp(a - G_j) = exp(G_i - G_j),
or 0 when flushed: the anchor's own derivative cancels term by term, so the
dG rule above holds.

What is saved: the op's inputs q, k, v, gk (and initial_state), and, when
the op was asked to keep them (`save_residuals`), the states entering each
chunk and tril(A), O(T/C x K x V + T x C). Otherwise both are recomputed
here (one batched matmul and N elementwise updates; the halving's level
matmuls and leaves), from the same ops on the same values: the gradients are
the same bit for bit either way. The decays are always rebuilt: each level's
are O(T x K), too many to keep. Autograd through the forward keeps
the anchored queries, keys, prefix and suffix decays of every halving level
and the leaves' decays alive instead, O(T x K x (levels + Cs)) and more: at
B=1, T=2048, H=4, K=128, V=256 and 4-row leaves, eager autograd saves 177 MB
against 4 MB here (a copy of gk) besides q, k, v, gk themselves, 17 MB with
the residuals (8 MB of states, 4 MB of tril(A)).

NOTE [the diagonal apart]
The diagonal of tril(A), A_cc = q_c . k_c, decays by exp(0): no gate
reaches it, and its shares of Q * dQ and K * dK are the same number,
dA_cc q_c k_c, which cancels in dG. Left in, it cancels in rounding: with
strong gates the diagonal is a row's largest term by far, and dG, the small
difference of two large numbers, carried 30 to 100 times the recurrence's
error on the gates' gradient (a sum of every token's dgk, as a per-head
decay parameter's gradient is, off by 5e-6 to 6e-5 relative to float64,
against the recurrence's 1e-8 to 4e-7). So `IntraChunk.gradients` gives
the diagonal's dA_cc apart, dG is formed without it, and dQ and dK get it
added after.

Checked against autograd of the token recurrence (tests/test_chunked_gla.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from laplace_passes.ops.chunked_forward import (
    FLUSH_BELOW,
    ChunkedInputs,
    IntraChunk,
    Recurrence,
    causal_matmul,
    chunk_recurrence,
    entering_states,
)


def leaving_state_gradients(
    q_decayed: Tensor, grad_o: Tensor, chunk_decay: Tensor, grad_final_state: Tensor | None,
    recurrence: Recurrence = chunk_recurrence,
) -> tuple[Tensor, Tensor]:
    """dh_n, the gradient of the state leaving chunk n ([B, H, N, K, V]), and dh0.

    The forward's recurrence in reverse: dS_n = exp(G_last) * dS_{n+1} + Qd^T dO.
    """
    return recurrence(q_decayed.transpose(-1, -2) @ grad_o, chunk_decay, grad_final_state, True)


def reverse_cumsum_rows(x: Tensor, block: int = 8) -> Tensor:
    """x summed from each row to the last along dim -2: x.flip(-2).cumsum(-2).flip(-2), in adds Inductor fuses.

    A cumsum is a scan, which Inductor's C++ backend leaves to an eager
    kernel (10 ms of a 100 ms GLA step at T=2048). Here rows are summed in
    blocks of `block` by explicit adds, the blocks' totals likewise
    (recursively), and each row gets the totals of the blocks after its own:
    straight-line pointwise code. A non-finite x[j] reaches rows i <= j only,
    as in the running sum.
    """
    rows = x.shape[-2]
    if rows > block and rows % block:  # a chunk not a multiple of the block (chunk sizes are any positive int)
        return x.flip(-2).cumsum(-2).flip(-2)
    if rows <= block:
        sums = [x[..., rows - 1 :, :]]
        for r in reversed(range(rows - 1)):
            sums.append(sums[-1] + x[..., r : r + 1, :])
        return torch.cat(sums[::-1], dim=-2)
    lead, width = x.shape[:-2], x.shape[-1]
    blocks = x.reshape(*lead, rows // block, block, width)
    within = reverse_cumsum_rows(blocks, block)  # [.., n, block, K]: sums to each block's end
    after = reverse_cumsum_rows(within[..., 0, :], block)  # [.., n, K]: from each block's start to the last row
    after_next = F.pad(after[..., 1:, :], (0, 0, 0, 1))  # the blocks after each one; 0 after the last
    return (within + after_next.unsqueeze(-2)).reshape(x.shape)


def chunked_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gk: Tensor,
    initial_state: Tensor | None,
    grad_o: Tensor,
    grad_final_state: Tensor | None,
    states: Tensor | None,
    scores: Tensor | None,
    scale: float,
    chunk_size: int,
    sub_chunk_size: int,
    recurrence: Recurrence = chunk_recurrence,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv, dgk in the inputs' dtypes; dh0 in fp32) of `chunked_forward`.

    `grad_final_state=None` means the final state was not used. `states` and
    `scores` are the forward's residuals when it kept them, None to recompute them. `recurrence`
    runs the recurrences over chunks, as in `chunked_forward`.
    """
    x = ChunkedInputs.build(q, k, v, gk, scale, chunk_size, sub_chunk_size)
    do = x.layout.to_chunks(grad_o)
    intra = IntraChunk(x.q, x.k, x.steps, x.layout.sub)
    q_decay, k_decay, chunk_decay = intra.chunk_decays()
    q_decayed, k_to_end = x.q * q_decay, x.k * k_decay
    if states is None:
        states, _ = entering_states(k_to_end, x.v, chunk_decay, initial_state, recurrence)
    if scores is None:
        scores = intra.scores()
    leaving, dh0 = leaving_state_gradients(q_decayed, do, chunk_decay, grad_final_state, recurrence)

    dq_below, dk_below, diagonal = intra.gradients(do @ x.v.transpose(-1, -2))
    dv = causal_matmul(scores, do, reverse=True) + k_to_end @ leaving
    dq_apart = dq_below + (do @ states.transpose(-1, -2)) * q_decay  # the scaled q's, but for the diagonal
    dk_inter = (x.v @ leaving.transpose(-1, -2)) * k_decay
    dk_apart = dk_below + dk_inter
    dq = dq_apart + diagonal * x.k
    dk = dk_apart + diagonal * x.q

    dG = x.q * dq_apart - x.k * dk_apart  # NOTE [the diagonal apart]
    dG_last = (x.k * dk_inter).sum(-2, keepdim=True) + (chunk_decay * (states * leaving).sum(-1, keepdim=True)).transpose(-1, -2)
    # dG_last belongs to the last row, so every row's sum to the end holds it: added after the sums
    # (a row's sum is the same terms in another order), no copy of dG with its last row changed.
    dgk = reverse_cumsum_rows(dG) + dG_last
    # A gate at or below -FLUSH_BELOW makes its token's decay exactly 0 (flushed), which has no
    # gradient; the running sum above would leave rounding noise there instead of 0.
    dgk = dgk * (x.gates > -FLUSH_BELOW)

    layout = x.layout
    return (
        layout.from_chunks(dq * scale, q.dtype),
        layout.from_chunks(dk, k.dtype),
        layout.from_chunks(dv, v.dtype),
        layout.from_chunks(dgk, gk.dtype),
        dh0,
    )
