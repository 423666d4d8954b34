"""Recurrent generation: prefill once, then decode one token per step from the state.

A GLA model's memory of the context is one fixed-size state per layer
(``[B, H, K, V]`` fp32), so decoding costs the same at token 10 and token
100,000, and many sequences decode side by side as one batch.

Prefill (``prefill=``):
- "compiled": the model's `model_zoo.prefill.CompiledPrefill`
  (``model.compiled_prefill``): the forward compiled through
  ``backend="laplace"`` (target "cpu", Inductor), chunked GLA, over
  256-token segments of the prompt (one static graph per batch size) and
  the rest (one graph with the length dynamic): not compiled per prompt
  length.
  Kept on the model, like the decode step.
- "eager": the model's forward, the reference op per layer (the token
  recurrence).
- "auto" (default; also None): "compiled" under the same conditions as
  decode's "auto" below; else "eager".
- any callable with the model's signature, e.g. the model compiled with
  ``backend="laplace"``; decode then continues from the states it returns.
  A prefill compiled with ``seq_buckets`` refuses a prompt it would pad
  (its final states would include the padding) and is exact at a prompt
  length that is a bucket.

Decode (``decode=``):
- "compiled": each step is one call of a `model_zoo.decode.DecodeStep`,
  the whole model compiled through ``backend="laplace"`` (target "cpu",
  Inductor), each layer's state in a buffer of its own updated in place, the
  greedy choice (argmax) taken in the same graph; the step's buffers are
  checked, and Dynamo's guards evaluated, at the first step of each call,
  not at every step. The step is
  kept on the model (``model.decode_step``), so later calls reuse its
  graphs: one for a single sequence, one for every larger batch.
- "ahead-of-time": the same step compiled by AOTInductor into a library
  that each step calls without Dynamo or Python between its kernels
  (`model_zoo.decode_ahead.AheadOfTimeStep`, kept on the model as
  ``model.ahead_of_time_step``): faster steps for long decodes of many
  sequences, for a first compile of 15 to 40 s per graph and batch class
  (kept on disk, so later processes load it; a deployment compiles it
  once, ahead of serving). The first step of each call is the JIT step's,
  where Dynamo's guards are evaluated. On the CPU; a loop the library
  cannot serve runs the JIT-compiled graph, its report saying why.
- "eager": the model's forward per step, the reference op per layer.
- "auto" (default): for an fp32 model on the CPU with a decode step
  (`model_zoo.GLALM`), outside another compile, the library of
  "ahead-of-time" where one was already compiled for the step's graph
  and batch class (in this process or on disk: never compiled here), and
  otherwise the JIT-compiled step, as "compiled" (the step's report says
  which it ran); else "eager" (in bf16 or fp16, fused kernels round
  differently from the eager ops, and greedy tokens could part on near
  ties).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass
class Generation:
    tokens: Tensor  # [B, prompt + new]
    logits: Tensor | None  # [B, new, vocab]: the logits each new token was chosen from
    state_bytes_per_sequence: int


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    prefill: Callable | str | None = "auto",
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    return_logits: bool = False,
    decode: str = "auto",
) -> Generation:
    """Greedy (temperature 0) or sampled continuation of every sequence in `input_ids`."""
    _check_arguments(input_ids, max_new_tokens, prefill, temperature, generator, return_logits)
    step, loop_options = _decode_step(model, decode, input_ids.device, _dtype(model))
    logits, states = _prefill(model, prefill, input_ids)
    state_bytes = sum(s[0].numel() * s.element_size() for s in states)
    if step is not None:
        decode_loop = step.loop(step.state_buffer(states), **loop_options)  # NOTE [guards once per loop]
    step_logits, greedy = logits[:, -1], None
    tokens, chosen_from = [input_ids], []
    for _ in range(max_new_tokens):
        # A compiled step took the greedy choice in its graph; the prefill's logits and sampling choose here.
        next_token = greedy if greedy is not None and temperature == 0 else _choose(step_logits, temperature,
                                                                                   generator)
        tokens.append(next_token[:, None])
        if return_logits:
            chosen_from.append(step_logits)
        if len(tokens) - 1 == max_new_tokens:
            break
        if step is not None:
            step_logits, greedy = decode_loop(next_token)  # its state buffers advanced in place
        else:
            logits, states = model(next_token[:, None], initial_states=states, output_final_states=True)
            step_logits = logits[:, -1]
    return Generation(
        tokens=torch.cat(tokens, dim=1),
        logits=torch.stack(chosen_from, dim=1) if return_logits else None,
        state_bytes_per_sequence=state_bytes,
    )


DECODE_MODES = ("auto", "compiled", "ahead-of-time", "eager")
PREFILL_MODES = ("auto", "compiled", "eager")
# Decode modes -> the model's property holding that step, and the options of its loops.
_STEPS = {"compiled": ("decode_step", {}), "ahead-of-time": ("ahead_of_time_step", {}),
          "auto": ("ahead_of_time_step", {"compile_missing": False})}


def _check_arguments(input_ids, max_new_tokens, prefill, temperature, generator, return_logits) -> None:
    """Each argument's accepted range, checked before any compile or forward."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [B, T] tensor with B >= 1 and T >= 1, got {shape}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if not isinstance(return_logits, bool):
        raise ValueError(f"return_logits must be a bool, got {return_logits!r}")
    if not (prefill is None or callable(prefill) or (isinstance(prefill, str) and prefill in PREFILL_MODES)):
        raise ValueError(f"prefill must be one of {PREFILL_MODES} or a callable with the model's signature, got "
                         f"{prefill!r}")


def _dtype(model: torch.nn.Module) -> torch.dtype | None:
    parameter = next(iter(model.parameters()), None)
    return None if parameter is None else parameter.dtype


def _decode_step(model: torch.nn.Module, decode: str, device: torch.device, dtype: torch.dtype | None):
    """The model's compiled step and the options of its loops, or (None, {}) for the eager loop (see the module
    docstring)."""
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
    if decode == "eager" or (decode == "auto" and not _auto_compiles(device, dtype)):
        return None, {}
    step_property, loop_options = _STEPS[decode]
    if not hasattr(type(model), step_property):
        if decode != "auto":
            raise ValueError(f"decode={decode!r} needs a model with a {step_property} (model_zoo.GLALM); "
                             f"{type(model).__name__} has none: use decode='eager'")
        if not hasattr(type(model), "decode_step"):
            return None, {}
        step_property, loop_options = _STEPS["compiled"]  # a model with a JIT step only
    return getattr(model, step_property), loop_options


def _prefill(model: torch.nn.Module, prefill, input_ids: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Logits and final states of the prompt, through the prefill `prefill` names (see the module docstring)."""
    if callable(prefill):
        return prefill(input_ids, output_final_states=True)
    mode = "auto" if prefill is None else prefill
    has_prefill = hasattr(type(model), "compiled_prefill")
    if mode == "compiled" and not has_prefill:
        raise ValueError(f"prefill='compiled' needs a model with a compiled_prefill (model_zoo.GLALM); "
                         f"{type(model).__name__} has none: use prefill='eager'")
    if mode == "eager" or not has_prefill or (mode == "auto" and not _auto_compiles(input_ids.device, _dtype(model))):
        return model(input_ids, output_final_states=True)
    return model.compiled_prefill(input_ids)


def _auto_compiles(device: torch.device, dtype: torch.dtype | None) -> bool:
    """Where "auto" compiles: fp32 on the CPU, outside another compile (see the module docstring)."""
    return device.type == "cpu" and dtype == torch.float32 and not torch.compiler.is_compiling()


def _choose(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
