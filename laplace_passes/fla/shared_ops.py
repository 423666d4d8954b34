"""fla's small kernels shared by its GLA-family models, in standard PyTorch ops.

    rotary_embedding     RetNet's rotary position embedding (offsets per sequence, packed batches)
    token_shift          RWKV6's shift of each token to the next position (delta = x[t-1] - x[t])
    chunk_local_cumsum   gates summed inside chunks of a sequence (simple GLA's and GSA's chunk paths)
    fused_additive_gate  LightNet's keys and gates from a cumulative log-sum-exp over time

Each substitute has the signature of fla 0.6.0's function and its arithmetic
read from the kernel: computed in fp32, cast back as fla casts. Autograd of
these formulas is the backward (fla's explicit backward kernels compute the
same derivatives). A packed batch (`cu_seqlens`, batch 1) restarts every
scan at each sequence's first token, with each sequence's own cache or
initial value.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from laplace_passes.fla.packing import PackedSequences
from laplace_passes.fla.varlen import segmented_cumsum


def _positions(x: Tensor, seqlen_offsets, cu_seqlens) -> Tensor:
    """The rotary position of each token: [B, T] (dense) or [1, T] (packed)."""
    B, T = x.shape[:2]
    steps = torch.arange(T, device=x.device)
    if cu_seqlens is None:
        offsets = seqlen_offsets[:, None] if isinstance(seqlen_offsets, Tensor) else seqlen_offsets
        return (steps[None, :] + offsets).expand(B, T)
    packed = PackedSequences.from_cu_seqlens(cu_seqlens, T)
    offsets = seqlen_offsets[packed.sequence_id] if isinstance(seqlen_offsets, Tensor) else seqlen_offsets
    return (packed.position + offsets)[None, :]


def rotary_embedding(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     chunk_indices=None):
    """x [B, T, H, D] rotated by cos, sin [TR, R] at each token's position; rows past TR are zero, as fla's
    kernel writes them; dimensions past 2R pass through."""
    R, TR = cos.shape[-1], cos.shape[0]
    position = _positions(x, seqlen_offsets, cu_seqlens)
    inside = ((position >= 0) & (position < TR))[..., None, None]
    index = position.clamp(0, TR - 1)
    c, s = cos[index].float()[:, :, None, :], sin[index].float()[:, :, None, :]
    xf = x.float()
    if interleaved:
        x0, x1 = xf[..., 0:2 * R:2], xf[..., 1:2 * R:2]
        rotated = torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], -1).flatten(-2)
    else:
        x0, x1 = xf[..., :R], xf[..., R:2 * R]
        rotated = torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], -1)
    rotated = torch.where(inside, rotated, torch.zeros_like(rotated))
    return torch.cat([rotated.to(x.dtype), x[..., 2 * R:]], -1)


def token_shift(x, cu_seqlens=None, cache=None, output_cache=False, chunk_indices=None):
    """delta = x[t-1] - x[t] for x [B, T, D]: the previous token zero (or `cache`, [N, D]) at each sequence's
    start; with `output_cache` also each sequence's last token, [N, D]."""
    previous = F.pad(x, (0, 0, 1, -1))
    if cu_seqlens is None:
        if cache is not None:
            previous = torch.cat([cache.reshape(x.shape[0], 1, -1).to(x.dtype), previous[:, 1:]], 1)
        last = x[:, -1]
    else:
        packed = PackedSequences.from_cu_seqlens(cu_seqlens, x.shape[1])
        first = (packed.position == 0)[None, :, None]
        start_value = cache.to(x.dtype)[packed.sequence_id][None] if cache is not None else torch.zeros_like(x)
        previous = torch.where(first, start_value, previous)
        last = x[0, (packed.ends - 1).clamp(min=0)]
    delta = previous - x
    return (delta, last) if output_cache else delta


def _segments(T: int, chunk_size: int, cu_seqlens, device) -> Tensor:
    """An id per token, equal within one chunk of one sequence (chunks start at each sequence's start)."""
    if cu_seqlens is None:
        return torch.arange(T, device=device) // chunk_size
    packed = PackedSequences.from_cu_seqlens(cu_seqlens, T)
    return packed.sequence_id * (T + 1) + packed.position // chunk_size


def chunk_local_cumsum(g, chunk_size, reverse=False, scale=None, cu_seqlens=None, output_dtype=torch.float,
                       chunk_indices=None, use_graph=False, **kwargs):
    """g [B, T, H(, K)] summed along T inside chunks of `chunk_size` tokens (suffix sums with `reverse`),
    then times `scale`, in `output_dtype`."""
    B, T = g.shape[:2]
    segment = _segments(T, chunk_size, cu_seqlens, g.device)
    values = g.float().movedim(1, 0).reshape(T, -1)  # [T, B * H (* K)]
    if not T:
        summed = values
    elif reverse:  # suffix sums: the same scan over the tokens in reverse order
        summed = segmented_cumsum(values.flip(0), segment.flip(0)).flip(0)
    else:
        summed = segmented_cumsum(values, segment)
    if scale is not None:
        summed = summed * scale
    out = summed.reshape(T, B, *g.shape[2:]).movedim(0, 1)
    return out.to(output_dtype or g.dtype)


def fused_additive_gate(x, initial_state=None, cu_seqlens=None, output_dtype=None, gate_dtype=None):
    """LightNet's additive gate for x [B, T, H, K]: z = log-sum-exp of x over time so far (and the initial
    z0 [N, 1, H, K]), keys exp(x - z), gates z_{t-1} - z_t (0 where nothing came before), final z [N, 1, H, K]."""
    if cu_seqlens is None:
        z = torch.logcumsumexp(x.float(), 1)
        z0 = initial_state.float() if initial_state is not None else None
        if z0 is not None:
            z = torch.logaddexp(z, z0)
        first = z0 if z0 is not None else torch.full_like(z[:, :1], -math.inf)
        previous = torch.cat([first, z[:, :-1]], 1)
        final = z[:, -1:] if x.shape[1] else first
    else:
        z, previous, final = _packed_log_cumsum(x, initial_state, cu_seqlens)
    keys = torch.exp(x.float() - z)
    gates = torch.where(torch.isneginf(previous), torch.zeros_like(z), previous - z)
    return keys.to(output_dtype or x.dtype), gates.to(gate_dtype or x.dtype), final


def _packed_log_cumsum(x: Tensor, initial_state, cu_seqlens):
    """The log-cumsum-exp per sequence of a packed batch [1, T, H, K]: laid out [N, T, H, K] (-inf beyond each
    sequence's end), scanned, gathered back."""
    T = x.shape[1]
    packed = PackedSequences.from_cu_seqlens(cu_seqlens, T)
    N = cu_seqlens.shape[0] - 1
    dense = x.new_full((N, T, *x.shape[2:]), -math.inf, dtype=torch.float32)
    dense = dense.index_put((packed.sequence_id, packed.position), x[0].float())
    z_dense = torch.logcumsumexp(dense, 1)
    z0 = initial_state.float() if initial_state is not None else torch.full_like(z_dense[:, :1], -math.inf)
    z_dense = torch.logaddexp(z_dense, z0)
    previous_dense = torch.cat([z0, z_dense[:, :-1]], 1)
    z = z_dense[packed.sequence_id, packed.position][None]
    previous = previous_dense[packed.sequence_id, packed.position][None]
    lengths = packed.ends - packed.starts
    final = torch.where((lengths > 0)[:, None, None, None],
                        z_dense[torch.arange(N, device=x.device), (lengths - 1).clamp(min=0)][:, None], z0)
    return z, previous, final


SUBSTITUTES = {
    "fla.modules.rotary.ops.rotary_embedding": rotary_embedding,
    "fla.modules.token_shift.token_shift": token_shift,
    "fla.ops.utils.cumsum.chunk_local_cumsum": chunk_local_cumsum,
    "fla.ops.gsa.gate.fused_additive_gate": fused_additive_gate,
}
