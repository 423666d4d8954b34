"""Prefill through the chunked GLA forward, compiled once per shape bucket, not per prompt length.

    prefill = CompiledPrefill(model)              # compiled on first use: backend="laplace", target "cpu"
    logits, states = prefill(input_ids)           # as model(input_ids, output_final_states=True)

The prompt is cut into segments of `segment_tokens` (256: four chunks of
64), each continuing from the states the previous one returned, which is
the same recurrence (segments end on chunk boundaries). Whole segments run
one graph compiled for that static length: re-tiled and unrolled over its
chunks, as fast per token as the model compiled for the whole prompt
(`benchmarks/bench_generate.py`). The rest of the prompt, shorter than a
segment, is padded at its end to a bucket (`bucket`: 128 or 256 tokens, two
chunks doubled until it fits, at most a segment) and runs that bucket's
static graph, the padding masked: `GLALM.forward`'s ``token_mask`` makes a
masked token the identity update of every state (k = 0, gate 0: decay 1),
so the states returned are the prompt's own, and the padding's logits are
dropped. A rest of at most one chunk runs the model's own forward (the
reference op): at most `chunk_size` steps of the token recurrence, where
the two forms cost about the same (why `recurrent_max_tokens` of target
"cpu" is 64). (A ``seq_buckets`` compile pads the prompt too, but without
a mask, and refuses to return states.)

Graphs: one static graph per bucket length (the segment is the largest
bucket) and batch size (compiled with every size static), for the first
`SEGMENT_BATCH_SIZES` (4) batch sizes. A prompt of a further batch size runs one graph compiled with the length
dynamic, whole, whose GLA sites keep the chunked form as a runtime loop
over chunks (NOTE [dynamic T] in `laplace_passes.fx.retile`; about 1.6x
the static graph's time per token: the chunk-loop op runs its body op by
op, outside Inductor's kernels): compiled once for every batch of two or
more sequences and once for a single sequence (torch specialises size 1).
So, with 256-token segments, at most ten compiles per object, whatever the
prompt lengths.

A compile that fails (e.g. the graph of dynamic length of a GLA written in
plain PyTorch as a scan, which the passes do not recognise at a dynamic T
and Inductor does not compile there) does not fail the prefill: the model's own forward runs instead,
now and at every later call, and a warning (kept in the report's notes)
says why. An error the model's own forward raises too (bad token ids) is
the caller's, and propagates.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch._dynamo
from torch import Tensor

import laplace_passes
from laplace_passes.driver.compile_fx import fresh_code
from laplace_passes.infra.targets import get_target

BATCH_DIM, TIME_DIM = 0, 1
# Four chunks of 64: as fast per token as one graph over the whole prompt (benchmarks/bench_generate.py).
SEGMENT_TOKENS = 256
# Batch sizes that get a segment graph of their own; prompts of further sizes run the rest's graph whole.
SEGMENT_BATCH_SIZES = 4


class CompiledPrefill:
    """The forward of a model with GLALM's signature, compiled for every prompt length (module docstring).

    `segment_tokens` (a multiple of the target's chunk size) is the length of
    the static segment graph; `target`, `inner` and `options` are the laplace
    backend's options (Inductor by default).
    """

    def __init__(self, model: torch.nn.Module, *, segment_tokens: int = SEGMENT_TOKENS, target: Any = "cpu",
                 inner: Any = "inductor", **options: Any) -> None:
        self.model = model
        self.chunk_size = get_target(target).chunk_size
        if isinstance(segment_tokens, bool) or not isinstance(segment_tokens, int) or segment_tokens < 1 \
                or segment_tokens % self.chunk_size:
            raise ValueError(f"segment_tokens must be a positive multiple of the chunk size {self.chunk_size}, "
                             f"got {segment_tokens!r}")
        self.segment_tokens = segment_tokens
        self.report = laplace_passes.Report()
        self.declined: str | None = None  # why the compiled forward is not used, once it failed
        self.segment_batch_sizes: set[int] = set()  # the batch sizes the static graphs were compiled for
        self._options = dict(target=target, inner=inner, report=self.report, **options)
        # One static graph per bucket length, made at its first use (`_bucket_graph`).
        self._bucket_graphs: dict[int, Any] = {}
        # Code objects of their own: Dynamo's cache and its recompile limit are kept per code object.
        self._rest_graph = laplace_passes.compile(fresh_code(self._forward), dynamic=None, **self._options)

    def _forward(self, input_ids: Tensor, states: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        return self.model(input_ids, initial_states=states, output_final_states=True)

    def _masked_forward(self, input_ids: Tensor, token_mask: Tensor,
                        states: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        return self.model(input_ids, initial_states=states, output_final_states=True, token_mask=token_mask)

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
        try:
            return self._segments(input_ids)
        except Exception as error:  # noqa: BLE001 - the eager forward below tells the caller's errors apart
            result = self.model(input_ids, output_final_states=True)  # raises again if the inputs were at fault
            self._decline(error)
            return result

    def _segments(self, input_ids: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Whole segments and the rest through static graphs (the rest padded to its bucket), or the dynamic one."""
        states = self._zero_states(input_ids)
        pieces = []
        T, B = input_ids.shape[TIME_DIM], input_ids.shape[BATCH_DIM]
        static = self._static_graphs_take(B)
        segment = self.segment_tokens if static else T
        for start in range(0, T, segment):
            piece = input_ids[:, start:start + segment]
            if piece.shape[TIME_DIM] <= self.chunk_size:
                logits, states = self.model(piece, initial_states=states, output_final_states=True)
            elif static:
                logits, states = self._padded(piece, states)
            else:
                logits, states = self._rest_graph(*self._marked(piece, states))
            pieces.append(logits)
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=TIME_DIM)), states

    def bucket(self, tokens: int) -> int:
        """The static length a piece of `tokens` runs at: two chunks, doubled until it fits, at most a segment."""
        size = 2 * self.chunk_size
        while size < tokens:
            size *= 2
        return min(size, self.segment_tokens)

    def _padded(self, piece: Tensor, states: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """`piece` padded at its end to its bucket, through that bucket's graph, the padding masked.

        A masked token leaves every state as it was (`GLALM.forward`'s token_mask), so the states
        returned are those at the piece's last real token; the padding's logits are dropped.
        """
        B, tokens = piece.shape
        length = self.bucket(tokens)
        padded = piece.new_zeros(B, length)  # token id 0 as padding: any valid id will do
        padded[:, :tokens] = piece
        token_mask = torch.zeros(B, length, dtype=torch.bool, device=piece.device)
        token_mask[:, :tokens] = True
        logits, states = self._bucket_graph(length)(padded, token_mask, states)
        return logits[:, :tokens], states

    def _bucket_graph(self, length: int):
        graph = self._bucket_graphs.get(length)
        if graph is None:
            # Every size static: one graph per bucket length and batch size (`_static_graphs_take` bounds them).
            graph = laplace_passes.compile(fresh_code(self._masked_forward), dynamic=False, **self._options)
            self._bucket_graphs[length] = graph
        return graph

    def _zero_states(self, input_ids: Tensor) -> list[Tensor]:
        """Zero states (the forward's own start): one graph signature for the first segment and the later ones."""
        c = self.model.config
        shape = (input_ids.shape[BATCH_DIM], c.num_heads, c.head_k_dim, c.head_v_dim)
        return [torch.zeros(shape, dtype=torch.float32, device=input_ids.device) for _ in range(c.num_layers)]

    def _static_graphs_take(self, batch: int) -> bool:
        """Whether the static graphs run this batch size: each new one costs a compile per bucket, up to a bound."""
        if batch not in self.segment_batch_sizes and len(self.segment_batch_sizes) >= SEGMENT_BATCH_SIZES:
            return False
        self.segment_batch_sizes.add(batch)
        return True

    @staticmethod
    def _marked(piece: Tensor, states: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """A copy marked dynamic, so that one graph serves every length (the caller's tensor keeps no marks)."""
        piece = piece.clone(memory_format=torch.contiguous_format)  # a [1, T] slice would keep the prompt's stride
        torch._dynamo.mark_dynamic(piece, TIME_DIM)
        if piece.shape[BATCH_DIM] > 1:  # one graph for every B >= 2 (B = 1 is specialised by torch)
            torch._dynamo.mark_dynamic(piece, BATCH_DIM)
            for state in states:
                torch._dynamo.mark_dynamic(state, BATCH_DIM)
        return piece, states

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
        return self.report.count("dynamo")
