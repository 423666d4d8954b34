"""fla's short causal convolution (`ShortConvolution`, `causal_conv1d`) in standard PyTorch ops.

For each channel d, with W the kernel width and x_t = 0 (or the cache) before
the first token:

    y_t = act( sum_{w<W} weight[d, w] * x_{t-(W-1)+w} + bias[d] ) + residual_t

The cache of a sequence is its last W inputs, ``[N, D, W]``, newest last;
`initial_state` uses the same layout. Variable-length batches (`cu_seqlens`)
are one packed sequence ``[1, T, D]``: each tap reads only inside its own
sequence (from the sequence's cache where it reaches before its start), so
the computation has static shapes for any packing. W is small (fla uses 4),
so the W shifted products are as cheap as a grouped `conv1d` and stay
lowerable everywhere; autograd of them is exact.

`causal_conv1d_update` is the single-token decode step: it shifts x into the
cache **in place**, as fla's kernel does, and returns (y, cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from laplace_passes.fla.packing import PackedSequences


def causal_conv1d(
    x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False, activation=None,
    backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs,
):
    if cp_context is not None:
        raise NotImplementedError("context-parallel causal_conv1d (cp_context) has no laplace replacement")
    W = weight.shape[1] if weight is not None else _width_without_weight(initial_state)
    packed = PackedSequences.from_cu_seqlens(cu_seqlens, x.shape[1]) if cu_seqlens is not None else None
    taps = _taps(x.float(), W, initial_state, packed)  # [B, T, D, W], oldest tap first
    y = (taps * weight.float()).sum(-1) if weight is not None else taps.sum(-1)
    y = _finish(y, bias, activation, residual).to(x.dtype)
    final_state = None
    if output_final_state:
        final_state = _final_state(x, W, initial_state, packed)
    return y, final_state


def _width_without_weight(initial_state: Tensor | None) -> int:
    if initial_state is None:
        raise ValueError("causal_conv1d without a weight needs initial_state to know the kernel width")
    return initial_state.shape[-1]


def _taps(x: Tensor, W: int, initial_state: Tensor | None, packed: PackedSequences | None) -> Tensor:
    """[B, T, D, W]: tap w of token t is x_{t-(W-1)+w} within its sequence, else its cache entry, else 0."""
    T = x.shape[1]
    position = packed.position if packed is not None else torch.arange(T, device=x.device)
    taps = []
    for w in range(W):
        back = W - 1 - w  # how many tokens back this tap reads
        shifted = F.pad(x, (0, 0, back, 0))[:, :T] if back else x
        if back:
            before_start = (position < back)[None, :, None]  # [1, T, 1]
            fill = _cache_entries(initial_state, position, back, packed, x)
            shifted = torch.where(before_start, fill, shifted)
        taps.append(shifted)
    return torch.stack(taps, dim=-1)


def _cache_entries(initial_state, position, back, packed, x) -> Tensor:
    """The cache value a tap `back` tokens back reads at each token (0 without a cache)."""
    if initial_state is None:
        return x.new_zeros(())
    T, D = x.shape[1], x.shape[2]
    # x_{-j} (j tokens before the sequence's first) is cache[..., W - j]; here j = back - position.
    W = initial_state.shape[-1]
    column = (W - back + position).clamp(0, W - 1)  # [T]; only read where position < back
    cache = initial_state.float()
    if packed is None:  # [B, D, W] -> [B, T, D]
        return cache[:, :, column].transpose(1, 2)
    per_token = cache[packed.sequence_id]  # [T, D, W]
    return per_token.gather(-1, column[:, None, None].expand(T, D, 1)).squeeze(-1)[None]


def _finish(y: Tensor, bias, activation, residual) -> Tensor:
    if bias is not None:
        y = y + bias.float()
    if activation in ("swish", "silu"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}: fla's causal_conv1d takes swish, silu or None")
    if residual is not None:
        y = y + residual.float()
    return y


def _final_state(x: Tensor, W: int, initial_state: Tensor | None, packed: PackedSequences | None) -> Tensor:
    """Each sequence's last W inputs [N, D, W], reaching into its cache when it is shorter than W."""
    B, T, D = x.shape
    if packed is None:
        cache = initial_state.to(x.dtype) if initial_state is not None else x.new_zeros(B, D, W)
        return torch.cat([cache, x.transpose(1, 2)], dim=-1)[..., -W:]
    ends = packed.ends  # [N]: one past each sequence's last token
    lengths = packed.lengths
    columns = []
    for j in range(W):  # column j holds x_{end - W + j}
        offset = W - j  # tokens before the end
        index = (ends - offset).clamp(0, T - 1)
        inside = (lengths >= offset)[:, None]
        from_x = x[0, index]  # [N, D]
        if initial_state is not None:
            from_cache = _per_sequence_column(initial_state, (W - offset + lengths).clamp(0, W - 1))
        else:
            from_cache = torch.zeros_like(from_x)
        columns.append(torch.where(inside, from_x, from_cache.to(x.dtype)))
    return torch.stack(columns, dim=-1)


def _per_sequence_column(cache: Tensor, column: Tensor) -> Tensor:
    """cache[n, :, column[n]] for every sequence n: [N, D]."""
    N, D, _ = cache.shape
    return cache.gather(-1, column[:, None, None].expand(N, D, 1)).squeeze(-1)


def causal_conv1d_update(x, cache, residual=None, weight=None, bias=None, activation=None):
    """One token per sequence: shift x into `cache` (in place) and convolve; returns (y, cache)."""
    shape = x.shape
    D = cache.shape[1]
    xf = x.reshape(-1, D).float()  # [N, D] from [N, D], [1, N, D] or [N, 1, D]
    window = torch.cat([cache[..., 1:].float(), xf[..., None]], dim=-1)  # [N, D, W], newest last
    y = (window * weight.float()).sum(-1) if weight is not None else window.sum(-1)
    y = _finish(y, bias, activation, residual.reshape(-1, D) if residual is not None else None)
    cache.copy_(window)
    return y.to(x.dtype).view(shape), cache


_OPS = "fla.modules.causal_conv1d.ops"
SUBSTITUTES = {
    f"{_OPS}.causal_conv1d": causal_conv1d,
    f"{_OPS}.causal_conv1d_update": causal_conv1d_update,
}
