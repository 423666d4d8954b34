"""Multi-query associative recall (MQAR), generated on the fly.

The standard probe of how well a linear-attention model recalls: a sequence
first lists key-value pairs, then asks for each key again in a random order;
at each asked key the model must predict that key's value (next-token
prediction: the target of an asked key's position is its value).

    k3 v7 k1 v2 k9 v4 ... | k1 _ k9 _ k3 _ ... (pad)      targets at the asked keys: v2 v4 v7 ...

Keys and values use disjoint halves of the vocabulary (token 0 is padding), so
chance accuracy is 1 / number of value tokens.

The position after an asked key holds padding (``_``), not the value: with the
answers in the input, a model could answer by elimination instead of recall
(the last query's value is the one listed value not yet answered, the one
before it one of two), which gives 52% accuracy at 4 pairs with no key-value
association at all; the demo's model learned exactly that shortcut when the
answers were shown.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # cross_entropy's ignore_index: positions that are not a recall


@dataclass(frozen=True)
class MQARTask:
    vocab_size: int = 128
    num_pairs: int = 8
    seq_len: int = 64

    def __post_init__(self):
        if self.vocab_size < 5:
            raise ValueError(f"vocab_size must be at least 5, got {self.vocab_size}")
        if self.num_pairs < 1 or self.num_pairs > self.vocab_size // 2 - 1:
            raise ValueError(f"num_pairs must be in [1, {self.vocab_size // 2 - 1}] for this vocab, got {self.num_pairs}")
        if self.seq_len < 4 * self.num_pairs:
            raise ValueError(f"seq_len must be >= 4 * num_pairs = {4 * self.num_pairs}, got {self.seq_len}")

    @property
    def num_keys(self) -> int:
        return (self.vocab_size - 1) // 2

    @property
    def chance(self) -> float:
        return 1.0 / (self.vocab_size - 1 - self.num_keys)

    @property
    def listed_chance(self) -> float:
        """The accuracy of answering each asked key with one of the sequence's listed values at random.

        What a model gets that remembers which values were listed but not which key each belongs to:
        recall above it is key-value association."""
        return 1.0 / self.num_pairs

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, T] and targets [B, T] (IGNORE except where a value must be recalled)."""
        B, P, T = batch_size, self.num_pairs, self.seq_len
        n_values = self.vocab_size - 1 - self.num_keys
        keys = torch.rand(B, self.num_keys, generator=generator).argsort(-1)[:, :P] + 1
        values = torch.randint(0, n_values, (B, P), generator=generator) + 1 + self.num_keys
        ids = torch.zeros(B, T, dtype=torch.long)
        ids[:, 0 : 2 * P : 2] = keys
        ids[:, 1 : 2 * P : 2] = values
        order = torch.rand(B, P, generator=generator).argsort(-1)
        asked_keys = keys.gather(1, order)
        asked_values = values.gather(1, order)
        ids[:, 2 * P : 4 * P : 2] = asked_keys  # the slots after them stay padding: no answer is shown
        targets = torch.full((B, T), IGNORE, dtype=torch.long)
        # Predict the value at the position of the asked key (next-token prediction).
        targets[:, 2 * P : 4 * P : 2] = asked_values
        return ids, targets


def recall_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    mask = targets != IGNORE
    return (logits.argmax(-1)[mask] == targets[mask]).float().mean().item()
