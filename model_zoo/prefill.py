"""Prefill through the chunked GLA forward, compiled once for every prompt length.

    prefill = CompiledPrefill(model)              # compiled on first call: backend="laplace", target "cpu"
    logits, states = prefill(input_ids)           # the model's forward with output_final_states=True

The model's forward is compiled with the prompt length marked dynamic, so
the re-tiling pass gives its GLA sites the chunked form kept as a runtime
loop over chunks (NOTE [dynamic T] in `laplace_passes.fx.retile`): the
chunk count, and the padding of the last chunk inside the op, are taken
from the prompt at each call. Nothing is padded outside the op, so the
final states are exactly the prompt's (a ``seq_buckets`` compile would
pad the prompt and refuse to return them), and one graph serves every
prompt length.

Graphs: prompts longer than one chunk (``chunk_size`` tokens of the
target) share one graph for every batch of two or more sequences and one
for a single sequence (torch specialises size 1): at most two compiles
per object. A prompt of at most one chunk runs the model's own forward
(the reference op): it is at most `chunk_size` steps of the token
recurrence, where the two forms cost about the same (the reason
`recurrent_max_tokens` of target "cpu" is 64), and a graph of its own
would cost a compile of seconds for a short prompt.

A compile that fails (e.g. a GLA written in plain PyTorch as a scan, which
the passes do not recognise at a dynamic T and Inductor does not compile
there) does not fail the prefill: the model's own forward runs instead,
now and at every later call, and a warning (kept in the report's notes)
says why. An error the model's own forward raises too (bad token ids) is
the caller's, and propagates.
"""

from __future__ import annotations

from typing import Any

import warnings

import torch
import torch._dynamo
from torch import Tensor

import laplace_passes
from laplace_passes.driver.compile_fx import fresh_code
from laplace_passes.infra.targets import get_target

BATCH_DIM, TIME_DIM = 0, 1


class CompiledPrefill:
    """The forward of a model with GLALM's signature, compiled for every prompt length (module docstring).

    `target`, `inner` and `options` are the laplace backend's options
    (Inductor by default).
    """

    def __init__(self, model: torch.nn.Module, *, target: Any = "cpu", inner: Any = "inductor",
                 **options: Any) -> None:
        self.model = model
        self.chunk_size = get_target(target).chunk_size
        self.report = laplace_passes.Report()
        self.declined: str | None = None  # why the compiled forward is not used, once it failed
        # A code object of its own: Dynamo's cache and its recompile limit are kept per code object.
        self._compiled = laplace_passes.compile(
            fresh_code(self._forward), target=target, inner=inner, dynamic=None, report=self.report, **options
        )

    def _forward(self, input_ids: Tensor) -> tuple[Tensor, list[Tensor]]:
        return self.model(input_ids, output_final_states=True)

    def __call__(self, input_ids: Tensor, *, output_final_states: bool = True):
        """Logits ``[B, T, vocab]`` and each layer's final state, as ``model(input_ids, output_final_states=True)``.

        The model's signature, so that the object is also a ``generate(prefill=...)``.
        """
        logits, states = self._prefill(input_ids)
        return (logits, states) if output_final_states else logits

    @torch.no_grad()
    def _prefill(self, input_ids: Tensor) -> tuple[Tensor, list[Tensor]]:
        if self.declined is not None or input_ids.dim() != 2 or input_ids.shape[TIME_DIM] <= self.chunk_size:
            return self.model(input_ids, output_final_states=True)
        # A copy carries the dynamic marks, not the caller's tensor (a later static compile of it would refuse them).
        marked = input_ids.contiguous().clone()
        torch._dynamo.mark_dynamic(marked, TIME_DIM)
        if marked.shape[BATCH_DIM] > 1:  # one graph for every B >= 2 (B = 1 is specialised by torch)
            torch._dynamo.mark_dynamic(marked, BATCH_DIM)
        try:
            return self._compiled(marked)
        except Exception as error:  # noqa: BLE001 - the eager forward below tells the caller's errors apart
            result = self.model(input_ids, output_final_states=True)  # raises again if the inputs were at fault
            self._decline(error)
            return result

    def _decline(self, error: BaseException) -> None:
        # Dynamo wraps the backend's error (in `inner_exception`, without a cause): name the one raised.
        while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
            error = inner
        first_line = (str(error).strip().splitlines() or [""])[0]
        self.declined = (f"the compiled prefill failed ({type(error).__name__}: {first_line}); prefill runs the "
                         "model's own forward from now on: pass prefill='eager' to skip the compile")
        self.report.notes.append(self.declined)
        warnings.warn(self.declined, stacklevel=2)

    def graphs_compiled(self) -> int:
        """Dynamo graphs compiled so far (each batch-size class and each recompile adds one)."""
        return sum(1 for g in self.report.graphs if g.kind == "dynamo")
