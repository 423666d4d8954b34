"""Variable-length batches as fla packs them: one sequence ``[1, T, ...]`` and `cu_seqlens`.

`cu_seqlens` ``[N+1]`` holds where each of N sequences starts (its last entry
is T). Its values are data, its length is static, so everything derived here
has a static shape: per-token sequence ids and positions come from comparing
every token index with every boundary (``[T, N]``), not from a loop over
sequences or a data-dependent gather of lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PackedSequences:
    starts: Tensor  # [N] first token of each sequence
    ends: Tensor  # [N] one past its last token
    sequence_id: Tensor  # [T] which sequence each token belongs to
    position: Tensor  # [T] index of the token inside its sequence

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor, total_tokens: int) -> PackedSequences:
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
        cu = cu_seqlens.long()
        starts, ends = cu[:-1], cu[1:]
        tokens = torch.arange(total_tokens, device=cu.device)
        # Token t belongs to the sequence n with starts[n] <= t < ends[n]: the number of ends at or
        # before t (empty sequences are skipped because their start equals their end).
        sequence_id = (tokens[:, None] >= ends[None, :]).sum(-1).clamp(max=starts.shape[0] - 1)
        position = tokens - starts[sequence_id]
        return cls(starts=starts, ends=ends, sequence_id=sequence_id, position=position)

    @property
    def num_sequences(self) -> int:
        return self.starts.shape[0]

    @property
    def lengths(self) -> Tensor:
        return self.ends - self.starts

    @property
    def is_start(self) -> Tensor:
        """[T] bool: the first token of a sequence."""
        return self.position == 0

    def one_hot(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """[T, N]: 1 where token t belongs to sequence n."""
        ids = torch.arange(self.num_sequences, device=self.sequence_id.device)
        return (self.sequence_id[:, None] == ids[None, :]).to(dtype)
