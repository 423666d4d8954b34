"""Checks of what a model_zoo model is called with, in the model's own terms.

A wrong-rank input would otherwise fail deep inside, naming a tensor the
caller never made ("q must have 4 dimensions"); these name the argument,
the shape expected and the fix.
"""

from __future__ import annotations

import torch

TOKEN_ID_DTYPES = (torch.int64, torch.int32)  # what nn.Embedding takes


def check_token_ids(input_ids: object, name: str = "input_ids") -> None:
    """`input_ids` must be a [batch, seq_len] tensor of torch.long (or int32) token ids."""
    expected = f"{name} must be [batch, seq_len] integer token ids"
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{expected} (a torch.Tensor), got {type(input_ids).__name__}: "
                        f"pass torch.tensor(ids, dtype=torch.long)")
    if input_ids.dim() != 2:
        shape = list(input_ids.shape)
        raise ValueError(f"{expected}, got shape {shape}{_rank_hint(name, shape)}")
    if input_ids.dtype not in TOKEN_ID_DTYPES:
        raise TypeError(f"{expected} (torch.long or torch.int32), got dtype {input_ids.dtype}: "
                        f"cast them with {name}.long()")


def check_token_mask(token_mask: object, input_ids: torch.Tensor) -> None:
    """`token_mask`, when given, must be a bool tensor of `input_ids`' shape (True: a real token)."""
    if token_mask is None:
        return
    if not isinstance(token_mask, torch.Tensor) or token_mask.dtype != torch.bool \
            or token_mask.shape != input_ids.shape:
        got = (f"dtype {token_mask.dtype}, shape {list(token_mask.shape)}" if isinstance(token_mask, torch.Tensor)
               else type(token_mask).__name__)
        raise ValueError(f"token_mask must be a bool tensor of input_ids' shape {list(input_ids.shape)} (True for a "
                         f"real token), got {got}: pass input_ids != pad_id")


def _rank_hint(name: str, shape: list[int]) -> str:
    if len(shape) == 1:
        return f": for one sequence pass {name}[None] (shape [1, {shape[0]}])"
    if len(shape) == 3 and shape[-1] == 1:
        return f": drop the trailing dimension ({name}.squeeze(-1))"
    return ""


def check_hidden_states(x: object, hidden_size: int, name: str = "x") -> None:
    """A layer's input must be [batch, seq_len, hidden_size]."""
    shape = list(x.shape) if isinstance(x, torch.Tensor) else None
    if shape is None or len(shape) != 3 or shape[-1] != hidden_size:
        got = f"shape {shape}" if shape is not None else type(x).__name__
        raise ValueError(f"{name} must be [batch, seq_len, hidden_size={hidden_size}] hidden states, got {got}")


def check_fla_token_ids(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook for fla's models: their input_ids (when given; inputs_embeds is the alternative)."""
    input_ids = args[0] if args else kwargs.get("input_ids")
    if input_ids is not None:
        check_token_ids(input_ids)
