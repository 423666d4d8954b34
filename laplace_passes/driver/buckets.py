"""Sequence-length buckets: pad token inputs up to one of a few lengths, so a static compile runs once per bucket.

    compiled = laplace_passes.compile(model, target="trn2", seq_buckets=[128, 256, 512])
    compiled(ids[:, :200])          # runs the model at T = 256, returns outputs for the 200 real positions

The usual answer to many lengths on a static-shape compiler (neuronx-cc
compiles each shape on its own, minutes each): a training loop or a server
over any lengths up to the largest bucket compiles at most one graph per
bucket (and batch size).

NOTE [causal models only]
Padding is appended after the last real token, and the outputs at the real
positions are kept. That is exact only when the output at a position does
not depend on later positions: causal language models (GLA, fla's
GLAForCausalLM, any decoder-only LM). A bidirectional model would see the
padding. Outputs that summarise the whole sequence are not sliced: a loss
computed inside the model is equal only because padded labels are
`IGNORE_INDEX` (-100, what transformers' and fla's losses skip); final
recurrent states and caches would include the padding, so an output holding
a cache is an error (call with use_cache=False).

What is padded: dimension 1 of every tensor argument with at least two
dimensions ([B, T] token ids, [B, T, ...] embeddings or masks); all must
have the same length T. Padding values: 0, except the `labels` keyword:
`IGNORE_INDEX`. What is sliced back: dimension 1 of every tensor output of
at least two dimensions whose length is the bucket, in tuples, lists, dicts
and transformers' ModelOutput.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # padded labels: skipped by transformers' and fla's cross entropy
SEQ_DIM = 1
_LABEL_KEYWORDS = ("labels",)


def check_buckets(buckets: Any) -> tuple[int, ...]:
    """`buckets` as a tuple of strictly increasing positive ints; a clear error otherwise."""
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence) or not buckets:
        raise ValueError(f"seq_buckets must be a non-empty list of increasing positive ints, got {buckets!r}")
    for value in buckets:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"seq_buckets must hold positive ints, got {value!r} in {list(buckets)}")
    if any(b <= a for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"seq_buckets must be strictly increasing, got {list(buckets)}")
    return tuple(buckets)


class SeqBuckets:
    """Pads the sequence dimension of the inputs to the next bucket, calls `fn`, slices the outputs back."""

    def __init__(self, fn: Callable, buckets: Sequence[int]) -> None:
        self.fn = fn
        self.buckets = check_buckets(buckets)

    def bucket_for(self, length: int) -> int:
        for bucket in self.buckets:
            if length <= bucket:
                return bucket
        raise ValueError(f"sequence length {length} is longer than the largest of seq_buckets {list(self.buckets)}: "
                         "add a larger bucket")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        length = _sequence_length(args, kwargs)
        bucket = self.bucket_for(length)
        args = tuple(_pad(a, bucket) for a in args)
        kwargs = {k: _pad(v, bucket, IGNORE_INDEX if k in _LABEL_KEYWORDS else 0) for k, v in kwargs.items()}
        return _slice_outputs(self.fn(*args, **kwargs), bucket, length)


class SeqBucketsModule(torch.nn.Module):
    """A compiled module behind `SeqBuckets`: parameters, train()/eval() and state_dict are the model's."""

    def __init__(self, compiled: torch.nn.Module, buckets: Sequence[int]) -> None:
        super().__init__()
        self.compiled = compiled
        self.run = SeqBuckets(compiled, buckets)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.run.buckets

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


def with_seq_buckets(compiled: Callable, buckets: Sequence[int]) -> Callable:
    """`compiled` (a compiled module or function) behind `SeqBuckets`."""
    if isinstance(compiled, torch.nn.Module):
        return SeqBucketsModule(compiled, buckets)
    run = SeqBuckets(compiled, buckets)

    @functools.wraps(compiled)
    def padded(*args, **kwargs):
        return run(*args, **kwargs)

    padded.buckets = run.buckets
    return padded


def _sequence_length(args: tuple, kwargs: dict) -> int:
    lengths = {t.shape[SEQ_DIM] for t in [*args, *kwargs.values()] if _has_sequence_dim(t)}
    if not lengths:
        raise ValueError("seq_buckets pads dimension 1 of tensor inputs of at least 2 dimensions ([B, T] token "
                         "ids); this call has none")
    if len(lengths) > 1:
        raise ValueError(f"seq_buckets pads dimension 1 of every tensor input of at least 2 dimensions; they must "
                         f"share one length, got {sorted(lengths)}")
    return lengths.pop()


def _has_sequence_dim(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > SEQ_DIM


def _pad(value: Any, bucket: int, fill: int = 0) -> Any:
    if not _has_sequence_dim(value) or value.shape[SEQ_DIM] == bucket:
        return value
    missing = bucket - value.shape[SEQ_DIM]
    # F.pad's list runs from the last dimension backwards: (last_lo, last_hi, ..., seq_lo, seq_hi).
    widths = [0, 0] * (value.dim() - SEQ_DIM - 1) + [0, missing]
    return F.pad(value, widths, value=fill)


def _slice_outputs(value: Any, bucket: int, length: int) -> Any:
    """The outputs at the real positions (NOTE [causal models only])."""
    if isinstance(value, torch.Tensor):
        return value[:, :length] if value.dim() > SEQ_DIM and value.shape[SEQ_DIM] == bucket else value
    if value is None or isinstance(value, (int, float, bool, str)):
        return value
    if isinstance(value, dict):  # also transformers' ModelOutput, an OrderedDict built from its fields
        if value.get("past_key_values") is not None:
            raise ValueError("seq_buckets: the output holds a cache (past_key_values), whose state includes the "
                             "padding; call the model with use_cache=False")
        sliced = {k: _slice_outputs(v, bucket, length) for k, v in value.items()}
        return type(value)(**sliced) if type(value) is not dict else sliced
    if isinstance(value, (tuple, list)):
        items = [_slice_outputs(v, bucket, length) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    raise TypeError(f"seq_buckets cannot slice an output of type {type(value).__name__} back to the real length")
