"""Batched decode through one compiled step: every layer in one graph, the state updated in place.

    step = DecodeStep(model)                      # compiled on first call: backend="laplace", target "cpu"
    states = step.state_buffer(prefill_states)    # [layers, B, H, K, V] fp32, allocated once
    logits = step(next_tokens, states)            # [B, vocab]; `states` now holds the next state

The step is the model's own forward on one token per sequence, traced by
Dynamo into one graph. Its GLA sites are T = 1 without gradient, so the
re-tiling pass gives them the recurrent form (NOTE [short sites] in
`laplace_passes.fx.retile`): one state update per layer, no chunk padding.
The new states are written back into the buffer the caller passed (a
trailing ``copy_`` that Inductor turns into kernels writing the buffer), so
a decode loop allocates no state after its first step and calls Python once
per step, not once per layer.

Batch sizes: the batch dimension is marked dynamic for B >= 2, so every
batch of two or more sequences shares one graph; B = 1 gets a graph of its
own (torch specialises sizes 0 and 1). At most two compiles per step object,
whatever the batch sizes and the number of steps.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch._dynamo
from torch import Tensor

import laplace_passes
from laplace_passes.compile_fx import fresh_code

# The state of one layer is [B, H, K, V]; the buffer stacks the layers in front.
BATCH_DIM_OF_BUFFER = 1


class DecodeStep:
    """One compiled decode step of a model with GLALM's signature (see the module docstring).

    `model(input_ids, initial_states=[...], output_final_states=True)` must
    return ``(logits, states)``; `model_zoo.GLALM` does. `target`, `inner`
    and `options` (e.g. ``gate_checks="always"``) are the laplace backend's
    options (Inductor by default: the fused kernels are the point; "eager"
    runs the same graph op by op).
    """

    def __init__(self, model: torch.nn.Module, *, target: Any = "cpu", inner: Any = "inductor",
                 **options: Any) -> None:
        self.model = model
        self.report = laplace_passes.Report()
        # A code object of its own: Dynamo's cache and its limit of 8 compiles per code object
        # would otherwise be shared by the steps of every model (the 9th would run uncompiled).
        self._compiled = laplace_passes.compile(
            fresh_code(self._step), target=target, inner=inner, dynamic=None, report=self.report, **options
        )

    def _step(self, tokens: Tensor, states: Tensor) -> Tensor:
        """What the graph computes: logits of the next token, and `states` replaced by the next states."""
        logits, new_states = self.model(tokens[:, None], initial_states=list(states.unbind(0)),
                                        output_final_states=True)
        states.copy_(torch.stack(new_states))
        return logits[:, -1]

    @staticmethod
    def state_buffer(states: Sequence[Tensor]) -> Tensor:
        """The per-layer states (a prefill's) copied into one fresh ``[layers, B, H, K, V]`` fp32 buffer."""
        return torch.stack([s.float() for s in states])

    @torch.no_grad()
    def __call__(self, tokens: Tensor, states: Tensor) -> Tensor:
        """Logits ``[B, vocab]`` for `tokens` ``[B]``; `states` (from `state_buffer`) is advanced in place."""
        if tokens.dim() != 1 or states.dim() != 5 or states.shape[BATCH_DIM_OF_BUFFER] != tokens.shape[0]:
            raise ValueError(f"expected tokens [B] and states [layers, B, H, K, V] with the same B, got "
                             f"{tuple(tokens.shape)} and {tuple(states.shape)}")
        tokens = tokens.contiguous()  # a column of a [B, T] batch would recompile for its strides
        if tokens.shape[0] > 1:  # one graph for every B >= 2 (B = 1 is specialised by torch)
            torch._dynamo.mark_dynamic(tokens, 0)
            torch._dynamo.mark_dynamic(states, BATCH_DIM_OF_BUFFER)
        return self._compiled(tokens, states)

    def graphs_compiled(self) -> int:
        """Dynamo graphs compiled so far (each batch-size class and each recompile adds one)."""
        return sum(1 for g in self.report.graphs if g.kind == "dynamo")
