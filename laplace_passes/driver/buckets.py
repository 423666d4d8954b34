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
padding. An output that is not per position (dimension 1 is not the
bucket's length) summarises the padding too, so when the call was padded it
is an error, with one exception: a scalar (a loss) when the labels were
padded with `IGNORE_INDEX` (-100, what transformers', fla's and
F.cross_entropy's losses skip). Final recurrent states
(`output_final_states=True`) and caches (`past_key_values`) would include
the padding: errors too. A length that is exactly a bucket is not padded,
and the call's outputs, states and caches included, are the model's own.

What is padded: dimension 1 of every tensor argument with at least two
dimensions ([B, T] token ids, [B, T, ...] embeddings or masks); all must
have the same length T. Each argument is known by its parameter's name in
the model's forward, whether passed by position or keyword. Padding values:
0, except labels (a parameter named labels, label, targets or target):
`IGNORE_INDEX`. A state carried in (initial_state(s), past_key_values,
cache_params) is neither padded nor a length. What is sliced back:
dimension 1 of every tensor output of at least two dimensions whose length
is the bucket, in tuples, lists, dicts and transformers' ModelOutput.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # padded labels: skipped by transformers' and fla's cross entropy (and F.cross_entropy's default)
SEQ_DIM = 1
# Parameters read by name, whether the call passes them by position or by keyword.
LABEL_PARAMETERS = ("labels", "label", "targets", "target")
# A state carried in from earlier tokens is not a sequence: never padded, and its dimension 1 is not a length.
STATE_PARAMETERS = ("initial_state", "initial_states", "past_key_values", "cache_params")
# Flags asking for the final recurrent state, which would include the padding (NOTE [causal models only]).
FINAL_STATE_FLAGS = ("output_final_states", "output_final_state")


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
    """Pads the sequence dimension of the inputs to the next bucket, calls `fn`, slices the outputs back.

    Each argument is treated by the name of its parameter in the model's
    signature, so `labels` passed by position is recognised as by keyword.
    """

    def __init__(self, fn: Callable, buckets: Sequence[int]) -> None:
        self.fn = fn
        self.buckets = check_buckets(buckets)
        self.signature = _signature(fn)

    def bucket_for(self, length: int) -> int:
        for bucket in self.buckets:
            if length <= bucket:
                return bucket
        raise ValueError(f"sequence length {length} is longer than the largest of seq_buckets {list(self.buckets)}: "
                         "add a larger bucket")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        named = _named_arguments(self.signature, args, kwargs)
        length = _sequence_length(named)
        bucket = self.bucket_for(length)
        if bucket == length:  # exact: nothing padded, so every output (states, caches, losses) is the model's own
            return self.fn(*args, **kwargs)
        _refuse_final_states(named, length, bucket)
        args = tuple(_pad_argument(name, value, bucket) for name, value in _positional(self.signature, args))
        kwargs = {name: _pad_argument(name, value, bucket) for name, value in kwargs.items()}
        labels_padded = any(_has_sequence_dim(value) for name, value in named if name in LABEL_PARAMETERS)
        unsliced: list[tuple[str, torch.Tensor]] = []
        out = _slice_outputs(self.fn(*args, **kwargs), bucket, length, unsliced)
        _refuse_summaries(unsliced, length, bucket, labels_padded)
        return out


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


def _signature(fn: Callable) -> inspect.Signature | None:
    """The parameters of the model or function behind `fn`, or None where Python cannot tell (some builtins).

    A compiled module (torch.compile's OptimizedModule) and any module take
    `(*args, **kwargs)` in `__call__`: their names are those of the original
    module's `forward`. A compiled function keeps its own through functools.wraps.
    """
    fn = getattr(fn, "_orig_mod", fn)
    if isinstance(fn, torch.nn.Module):
        fn = fn.forward
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _positional(signature: inspect.Signature | None, args: tuple) -> list[tuple[str | None, Any]]:
    """Each positional argument with the name of its parameter (`*args` lends its own name to all it takes)."""
    if signature is None:
        return [(None, a) for a in args]
    names: list[str | None] = []
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            names += [parameter.name] * (len(args) - len(names))
            break
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(parameter.name)
    names += [None] * (len(args) - len(names))  # too many: the call itself will say so
    return list(zip(names, args))


def _named_arguments(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> list[tuple[str | None, Any]]:
    if signature is not None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"seq_buckets: the call does not match the model's parameters {signature}: {error}") \
                from None
    return _positional(signature, args) + list(kwargs.items())


def _sequence_length(named: list[tuple[str | None, Any]]) -> int:
    lengths = {value.shape[SEQ_DIM] for name, value in named
               if name not in STATE_PARAMETERS and _has_sequence_dim(value)}
    if not lengths:
        raise ValueError("seq_buckets pads dimension 1 of tensor inputs of at least 2 dimensions ([B, T] token "
                         "ids); this call has none")
    if len(lengths) > 1:
        raise ValueError(f"seq_buckets pads dimension 1 of every tensor input of at least 2 dimensions; they must "
                         f"share one length, got {sorted(lengths)}")
    return lengths.pop()


def _pad_argument(name: str | None, value: Any, bucket: int) -> Any:
    if name in STATE_PARAMETERS:
        return value
    return _pad(value, bucket, IGNORE_INDEX if name in LABEL_PARAMETERS else 0)


def _refuse_final_states(named: list[tuple[str | None, Any]], length: int, bucket: int) -> None:
    for name, value in named:
        if name in FINAL_STATE_FLAGS and isinstance(value, (bool, int)) and value:
            raise ValueError(
                f"seq_buckets: {name}={value!r} would return recurrent states that include {bucket - length} padding "
                f"positions (length {length}, bucket {bucket}); prefill with the model compiled without seq_buckets "
                f"(generate(prefill=laplace_passes.compile(model, target=...))), or call at a length that is a bucket")


def _refuse_summaries(unsliced: list[tuple[str, torch.Tensor]], length: int, bucket: int,
                      labels_padded: bool) -> None:
    """Outputs not sliced back were computed over the padding too (NOTE [causal models only])."""
    for path, tensor in unsliced:
        if tensor.dim() == 0 and labels_padded:
            continue  # a loss: its padded labels are IGNORE_INDEX, which it skips
        raise ValueError(
            f"seq_buckets: {path} (shape {tuple(tensor.shape)}) is not per position, so it includes the "
            f"{bucket - length} padding positions (length {length}, bucket {bucket}); return per-position outputs "
            f"[B, T, ...] and reduce them outside the compiled model (a loss: pass its targets as labels=, padded "
            f"with {IGNORE_INDEX}), or call at a length that is a bucket")


def _has_sequence_dim(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > SEQ_DIM


def _pad(value: Any, bucket: int, fill: int = 0) -> Any:
    if not _has_sequence_dim(value) or value.shape[SEQ_DIM] == bucket:
        return value
    missing = bucket - value.shape[SEQ_DIM]
    # F.pad's list runs from the last dimension backwards: (last_lo, last_hi, ..., seq_lo, seq_hi).
    widths = [0, 0] * (value.dim() - SEQ_DIM - 1) + [0, missing]
    return F.pad(value, widths, value=fill)


def _slice_outputs(value: Any, bucket: int, length: int, unsliced: list, path: str = "output") -> Any:
    """The outputs at the real positions (NOTE [causal models only]); tensors left whole are added to `unsliced`."""
    if isinstance(value, torch.Tensor):
        if value.dim() > SEQ_DIM and value.shape[SEQ_DIM] == bucket:
            return value[:, :length]
        unsliced.append((path, value))
        return value
    if value is None or isinstance(value, (int, float, bool, str)):
        return value
    if isinstance(value, dict):  # also transformers' ModelOutput, an OrderedDict built from its fields
        if value.get("past_key_values") is not None:
            raise ValueError("seq_buckets: the output holds a cache (past_key_values), whose state includes the "
                             "padding; call the model with use_cache=False, or at a length that is a bucket")
        sliced = {k: _slice_outputs(v, bucket, length, unsliced, f"{path}[{k!r}]") for k, v in value.items()}
        return type(value)(**sliced) if type(value) is not dict else sliced
    if isinstance(value, (tuple, list)):
        items = [_slice_outputs(v, bucket, length, unsliced, f"{path}[{i}]") for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    raise TypeError(f"seq_buckets cannot slice an output of type {type(value).__name__} back to the real length")
