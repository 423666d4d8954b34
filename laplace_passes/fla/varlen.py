"""GLA over a packed batch (`cu_seqlens`): one static-shape computation, no loop over sequences.

NOTE [packed GLA]
fla trains on packed documents: N sequences laid end to end as one
``[1, T, H, K]`` batch, with `cu_seqlens` ``[N+1]`` marking where each starts.
Each sequence must start from its own initial state (or zeros) and end in its
own final state, as if run alone. With the gates g (log decays):

1. A gate of -inf at the first token of each sequence makes the recurrence
   forget everything before it: S_t = exp(-inf) S_{t-1} + k_t v_t^T. The
   chunked algorithm handles it exactly (a gate at or below -30 gives its
   token a decay of exactly 0, and every decay across it is 0), so the
   whole packed batch is one `laplace::gla` site, re-tiled like any other.
2. What the reset drops is each sequence's initial state h0[n]. Its part of
   the output is linear: o_t += scale * (q_t * exp(G_t)) h0[n], with G_t the
   sum of the gates from the sequence's first token to t.
3. The final state of sequence n is
       sum_{s in n} exp(R_s) k_s v_s^T + exp(G_end) h0[n],
   R_s = the sum of the gates after s up to the sequence's last token.

G and R are *segmented* sums (they restart at every sequence). A global
cumsum differenced at the boundaries would lose precision to cancellation
(late sequences subtract sums of every gate before them), so both are built
in two levels: a masked lower-triangular product inside chunks of
`SEGMENT_CHUNK` tokens, plus a masked product over chunk totals. Every sum
then adds only gates of one sequence. Sequence membership comes from
`PackedSequences` (comparisons against `cu_seqlens`, static shapes). The
extra work is O(T * N * H * K * V) for the initial and final states, done only
when they are asked for. The gradient is autograd through these ops and the
chunked op's explicit backward; a reset gate's own gradient is 0 from the
chunked path (it only ever multiplies a state that was replaced), and comes
back through G when h0 is given.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from laplace_passes.fla.packing import PackedSequences
from laplace_passes.ops.gla import gla_op

SEGMENT_CHUNK = 64  # tokens per chunk of the two-level segmented sums


def packed_gla(q, k, v, g, scale: float, initial_state, cu_seqlens, output_final_state: bool, origin: str):
    """fla's variable-length GLA: (o, final states [N, H, K, V] fp32 or None); q, k, v, g: [1, T, ...]."""
    if q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into one row, got batch {q.shape[0]}")
    T = q.shape[1]
    packed = PackedSequences.from_cu_seqlens(cu_seqlens, T)
    if initial_state is not None and initial_state.shape[0] != packed.num_sequences:
        raise ValueError(f"initial_state holds {initial_state.shape[0]} states for {packed.num_sequences} sequences")
    reset = packed.is_start[None, :, None, None]
    o, _ = gla_op(q, k, v, torch.where(reset, -math.inf, g), None, scale, origin)
    if initial_state is None and not output_final_state:
        return o, None
    gates = g[0].float()  # [T, H, K]
    one_hot = packed.one_hot()  # [T, N]
    final = None
    if initial_state is not None:
        decay_in = torch.exp(segmented_cumsum(gates, packed.sequence_id))  # exp(G_t)
        o = (o.float() + scale * _from_initial(q[0].float() * decay_in, one_hot, initial_state))
        o = o.to(q.dtype)
    if output_final_state:
        final = _final_states(k[0].float(), v[0].float(), gates, packed, one_hot, initial_state)
    return o, final


def _from_initial(q_decayed: Tensor, one_hot: Tensor, initial_state: Tensor) -> Tensor:
    """[1, T, H, V]: each token's query against its own sequence's initial state."""
    per_sequence = one_hot[:, :, None, None] * q_decayed[:, None]  # [T, N, H, K]
    return torch.einsum("tnhk,nhkv->thv", per_sequence, initial_state.float())[None]


def _final_states(k, v, gates, packed: PackedSequences, one_hot, initial_state) -> Tensor:
    """[N, H, K, V]: each sequence's state after its last token (NOTE [packed GLA], point 3)."""
    sid = packed.sequence_id
    # R_s: sum of the gates after s to the end of its sequence = segmented suffix sum minus g_s.
    suffix = segmented_cumsum(gates.flip(0), sid.flip(0)).flip(0)
    k_decayed = k * torch.exp(suffix - gates)
    per_sequence = one_hot[:, :, None, None] * k_decayed[:, None]  # [T, N, H, K]
    final = torch.einsum("tnhk,thv->nhkv", per_sequence, v)
    if initial_state is not None:
        total = segmented_cumsum(gates, sid)  # G_t; the last token of each sequence holds its total
        last = (packed.ends - 1).clamp(min=0)
        whole = torch.where((packed.lengths > 0)[:, None, None], total[last], total.new_zeros(()))
        final = final + torch.exp(whole)[..., None] * initial_state.float()
    return final


def segmented_cumsum(x: Tensor, sequence_id: Tensor, chunk: int = SEGMENT_CHUNK) -> Tensor:
    """Inclusive cumsum of x [T, ...] along dim 0, restarting wherever `sequence_id` [T] changes.

    Two levels (NOTE [packed GLA]): inside chunks a masked lower-triangular
    product, across chunks a masked product over each chunk's last value;
    every addition stays inside one sequence.
    """
    T = x.shape[0]
    chunk = min(chunk, T)
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T
    values = F.pad(x.reshape(T, -1), (0, 0, 0, pad)).view(n_chunks, chunk, -1)
    ids = F.pad(sequence_id, (0, pad), value=-1).view(n_chunks, chunk)
    rows = torch.arange(chunk, device=x.device)
    inside = (ids[:, :, None] == ids[:, None, :]) & (rows[None, :] <= rows[:, None])[None]
    local = inside.to(values.dtype) @ values  # [n_chunks, chunk, F]
    last_id = ids[:, -1]
    chunk_index = torch.arange(n_chunks, device=x.device)
    same = (last_id[:, None] == last_id[None, :]) & (chunk_index[None, :] <= chunk_index[:, None])
    at_end = same.to(values.dtype) @ local[:, -1]  # [n_chunks, F]: running sum at each chunk's end
    carried = F.pad(at_end, (0, 0, 1, 0))[:-1]  # the previous chunk's, for chunk c
    continues = ids == F.pad(last_id, (1, 0), value=-2)[:-1, None]  # token's sequence ran through c-1's end
    result = local + continues[..., None].to(values.dtype) * carried[:, None]
    return result.reshape(n_chunks * chunk, -1)[:T].view(x.shape)
