"""Batched decode through one compiled step: every layer in one graph, each layer's state updated in place.

    step = DecodeStep(model)                      # compiled on first call: backend="laplace", target "cpu"
    states = step.state_buffer(prefill_states)    # one [B, H, K, V] fp32 buffer per layer (K innermost), allocated once
    logits = step(next_tokens, states)            # [B, vocab]; each buffer now holds its layer's next state
    logits, greedy = step.logits_and_greedy(next_tokens, states)   # and the argmax of those logits, [B]

    loop = step.loop(states)                      # one decode loop over these buffers (what generate runs)
    logits, greedy = loop(next_tokens)            # as logits_and_greedy; checks and guards once per loop

The step is the model's own forward on one token per sequence, traced by
Dynamo into one graph. Its GLA sites are T = 1 without gradient, so the
re-tiling pass gives them the recurrent form (NOTE [short sites] in
`laplace_passes.fx.retile`): one state update per layer, no chunk padding.
Each layer's new state is written back into that layer's buffer (a
trailing ``copy_`` per layer), so a decode loop allocates no state after
its first step and calls Python once per step, not once per layer.

The graph also takes the greedy choice, ``logits.argmax(-1)``, as one more
kernel over the logits it has just written: greedy decode
(`model_zoo.generate`) feeds it back as the next step's tokens without an
eager op between steps. It is the argmax of the same logits, so the same
token (ties go to the lower index in both).

NOTE [one buffer per layer]: the buffers are separate tensors, not slices
of one ``[layers, B, H, K, V]`` tensor. With one tensor, Inductor writes
the stacked next states as one kernel over the whole tensor that also reads
the other layers' slices of it, so it cannot write in place: it computed
the states into a fresh temporary and copied that into the buffer (at 1280
sequences of `tiny`, 21 MB allocated, written, read and written again per
step: 2.5 of 4.9 ms). With a buffer per layer, each layer's kernel reads
its state, writes the next state into the same buffer and computes the
readout from it (`tests/test_decode_step.py` checks that no state-sized
temporary is allocated; `benchmarks/bench_decode.py` measures the step).

NOTE [state buffers keep K innermost]: a buffer is [B, H, K, V] with K
innermost in memory (a transposed view of a contiguous [B, H, V, K]
tensor). The kernel does two things with each head's [K, V] state: the
readout, a sum over K for each v, and the next state, written back. With
K innermost, both walk the state in the same order, and Inductor puts them
in one loop over (sequence, head): each 2 KB state is read from memory
once and written once. With V innermost, Inductor made them two loops
over every (sequence, head): the readout read the whole state, then the
update read it again after it had streamed through the caches, a third
pass over memory for a step whose state traffic is a large part of its
time (at 1280 sequences of `tiny`, 10.5 MB read and written per step).
`benchmarks/bench_decode.py` measures the step (figures in
docs/benchmarks.md). The state's values are the same either way; the
readout sums over K in another order (equal within fp32 rounding).

NOTE [guards once per loop]: a step is a call of a Dynamo-compiled
function, and each call evaluates Dynamo's guards on everything the graph
was specialised for (every parameter's dtype, shape and strides, the
modules, the buffers, grad mode) before it runs the graph: at one sequence
about a sixth of the step. Within one decode loop none of that can change:
the buffers are the same tensors, each step's tokens are the previous
step's argmax (or a sample) of the same shape and dtype, and the loop runs
under no_grad with the model untouched. So `DecodeStep.loop` checks the
buffers once, runs its first call with every guard (compiling if no graph
fits), and its later calls under ``torch.compiler.set_stance(
skip_guard_eval_unsafe=True)``, which evaluates only the guards that tell
the step's graphs apart (one sequence, or the batch class: NOTE [batch
classes]). A new loop, e.g. the next
`generate` call, starts with every guard again: a model changed between
calls (another dtype, a replaced weight) is seen there and recompiles.
The stance is Dynamo's, process-wide: while such a step runs, a compiled
function that another thread entered would evaluate only its own
differentiating guards too, and could run a graph made for other inputs.
So a step skips guards only while its thread is the process's only Python
thread that could run compiled code (checked at every step): tqdm's monitor
of progress bars and laplace_passes' own background threads, which build
kernels and read pipes (`laplace_passes.infra.threads`; the kernel-batch
builder stays alive after a compile), do not count; with any other thread
alive, every step evaluates every guard. ``model.decode_step.guards_once_per_loop = False``
(or a step built with it) never skips them; for generate's default,
``model.ahead_of_time_step.guards_once_per_loop = False`` (a library it runs
evaluates no guard, and no stance is set). The later calls pass views of
the tokens and buffers, as the first call does: the guards that still run
are those on the inputs' tensors, and they may read a view's base (Dynamo
keeps what it learnt about sizes per source location, so a step compiled
after another step's graph at another batch size can get guards on the
bases' sizes); a tensor that is not a view has no base, and that guard
would fail, which under the stance is an error, not a recompile.

Batch sizes: three classes, a graph each, compiled at the first call that
needs it: B = 1 (torch specialises sizes 0 and 1), 2 <= B < LARGE_BATCH
and B >= LARGE_BATCH, the batch dimension marked dynamic within each class
(NOTE [batch classes]). At most three compiles per step object, whatever
the batch sizes and the number of steps.

NOTE [batch classes]: Inductor decides at compile time which of a graph's
kernels run on several threads, from the batch it takes the graph to run
at (by default the batch of the call that compiled it): a graph with a
dynamic batch compiled at two sequences has kernels too small to split,
and keeps them on one thread at every later batch size. Its FX graph cache
then hands that graph to every later process, so a machine whose first
decode ran two sequences decoded 1280 sequences on single-threaded kernels
from then on (1.10x slower a step for `tiny` on 2 cores; docs/benchmarks.md).
So large batches get a graph of their own, and each class's graph is
compiled as for a batch of its own (``hint_override``), not the first
call's: LARGE_BATCH_HINT (1024) splits every kernel of `tiny`'s step over
up to 32 threads, where a graph compiled at 64 sequences left most of them
on one thread from 16 threads up; SMALL_BATCH_HINT (8) keeps the small
kernels of a few sequences on one thread (2 to 48 sequences on 2 cores ran
as fast as, or faster than, with hints 2 and 32). The class is part of
the graph's guards (its batch dimension's range), and the class and the
hint are part of the FX graph cache's key, so neither Dynamo nor the cache
hands one class the other's graph.

NOTE [a forward with a graph break]: a model whose forward breaks Dynamo's
graph (a hook that prints, `torch._dynamo.graph_break()`) is resumed by Dynamo in
frames that take the first graph's outputs as new inputs with static sizes,
beside the buffers marked dynamic within their class: copying a state into
its buffer then fails in Dynamo ("expand: attempting to expand a dimension
of length 3 -> s3"), inside the user's `generate`. So a step's guarded call
is compiled whole (``fullgraph``, for that compile only), so Dynamo raises
at the break while it traces, before anything has run (as it does for
data-dependent Python a whole graph cannot take, a branch on ``.item()``,
which a compile with breaks would have split at); the step then drops
the batch classes for the rest of its life (its report says why), and runs
that call and every later one through a compile that takes graph breaks,
unmarked and fully guarded: Dynamo compiles per batch size until it makes
the batch dynamic itself, and frames it skipped at the break are skipped
again at each call (under the loop's skipped guards they would ask for a
compile, an error). Past Dynamo's recompile limit, a compile of the whole
graph raises too, where Dynamo had run the frame "run only" (the graphs
compiled so far, the rest uncompiled): the step runs it so from then on,
each call fully guarded (the report notes the limit once).
"""

from __future__ import annotations

import functools
import threading

from typing import Any, Sequence

import torch
import torch._dynamo
from torch import Tensor

import laplace_passes
from laplace_passes.driver.compile_fx import fresh_code
from laplace_passes.infra.threads import runs_no_compiled_code

# A layer's state is [B, H, K, V].
BATCH_DIM = 0
STATE_DIMS = 4
# The batch classes (NOTE [batch classes]): 2 to LARGE_BATCH - 1 sequences, compiled as for SMALL_BATCH_HINT,
# and LARGE_BATCH or more, compiled as for LARGE_BATCH_HINT.
LARGE_BATCH = 64
SMALL_BATCH_HINT = 8
LARGE_BATCH_HINT = 1024
# A stand-in for "no upper bound": Dynamo's ranges refuse max=None in torch 2.13.
_LARGEST_BATCH = 2**31 - 1


class DecodeStep:
    """One compiled decode step of a model with GLALM's signature (see the module docstring).

    `model(input_ids, initial_states=[...], output_final_states=True)` must
    return ``(logits, states)``; `model_zoo.GLALM` does. `target`, `inner`
    and `options` (e.g. ``gate_checks="always"``) are the laplace backend's
    options (Inductor by default: the fused kernels are the point; "eager"
    runs the same graph op by op).

    `guards_once_per_loop` (default True): a loop's later steps skip the guards
    that do not choose between its graphs (NOTE [guards once per loop]); False
    evaluates every guard at every step, for a program whose other threads call
    compiled functions while this model decodes.
    """

    def __init__(self, model: torch.nn.Module, *, target: Any = "cpu", inner: Any = "inductor",
                 guards_once_per_loop: bool = True, **options: Any) -> None:
        self.model = model
        self.guards_once_per_loop = guards_once_per_loop
        self.report = laplace_passes.Report()
        self._compile = functools.partial(laplace_passes.compile, target=target, inner=inner, dynamic=None,
                                          report=self.report, **options)
        # A code object of its own: Dynamo's cache and its limit of 8 compiles per code object
        # would otherwise be shared by the steps of every model (the 9th would run uncompiled). One whole graph:
        # a graph break raises while Dynamo traces, before anything runs (NOTE [a forward with a graph break]).
        self._compiled = self._compile(fresh_code(self._step), fullgraph=True)
        self.graph_break: str | None = None  # why Dynamo could not compile the step whole, once seen
        self._past_recompile_limit = False

    def _step(self, tokens: Tensor, states: list[Tensor]) -> tuple[Tensor, Tensor]:
        """What the graph computes: logits of the next token and their argmax; each buffer replaced by its
        next state."""
        logits, new_states = self.model(tokens[:, None], initial_states=list(states), output_final_states=True)
        for buffer, new_state in zip(states, new_states, strict=True):
            buffer.copy_(new_state)
        logits = logits[:, -1]
        return logits, logits.argmax(-1)

    @staticmethod
    def state_buffer(states: Sequence[Tensor]) -> list[Tensor]:
        """The per-layer states (a prefill's) copied into fresh fp32 buffers, one per layer: [B, H, K, V]
        with K innermost in memory (NOTE [state buffers keep K innermost])."""
        buffers = []
        for state in states:
            *lead, K, V = state.shape
            buffer = torch.empty(*lead, V, K, dtype=torch.float32, device=state.device).transpose(-1, -2)
            buffers.append(buffer.copy_(state))
        return buffers

    def __call__(self, tokens: Tensor, states: Sequence[Tensor]) -> Tensor:
        """Logits ``[B, vocab]`` for `tokens` ``[B]``; each buffer of `states` (`state_buffer`) is advanced in place."""
        return self.logits_and_greedy(tokens, states)[0]

    @torch.no_grad()
    def logits_and_greedy(self, tokens: Tensor, states: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """Logits ``[B, vocab]`` and the greedy next tokens ``[B]`` (their argmax, taken in the graph);
        each buffer of `states` is advanced in place."""
        _check_step_inputs(tokens, states)
        # Tensors of the step's own, views of the caller's: the batch marks stay off the caller's tensors (marks
        # add up on a tensor, and Dynamo would pick one of them).
        tokens = _with_stride_one(tokens).view(tokens.shape)
        states = [buffer[...] for buffer in states]
        if self.graph_break is not None:  # NOTE [a forward with a graph break]
            return self._compiled(tokens, states)
        mark_batch_class(tokens.shape[0], (tokens, *states))
        try:
            return self._compiled(tokens, states)
        # Raised while Dynamo traces the whole step, before anything has run: a graph break, or data-dependent
        # Python that a whole graph cannot take.
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as error:
            self._without_batch_classes(error)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            if torch._dynamo.config.fail_on_recompile_limit_hit:
                raise
            return self._past_the_recompile_limit(tokens, states)
        return self._compiled(tokens.view(tokens.shape), [buffer[...] for buffer in states])  # views with no mark

    def _without_batch_classes(self, error: Exception) -> None:
        """Dynamo cannot compile the step whole: this step's calls, this one included, run a compile that takes
        graph breaks and marks no batch class (NOTE [a forward with a graph break])."""
        self.graph_break = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self._compiled = self._compile(fresh_code(self._step))
        self._add_note(f"Dynamo could not compile the decode step as one graph ({self.graph_break}): it runs "
                       "Dynamo's graphs without batch classes, each call fully guarded, compiled per batch size until "
                       "Dynamo makes the batch dynamic")

    def _past_the_recompile_limit(self, tokens: Tensor, states: list[Tensor]) -> tuple[Tensor, Tensor]:
        """As Dynamo runs a frame past its recompile limit (the report notes the limit): the graphs compiled so far
        where they fit, the rest uncompiled, nothing compiled again, and each call fully guarded."""
        self._compiled = torch._dynamo.run(self._compiled)
        self._past_recompile_limit = True
        return self._compiled(tokens, states)

    def _add_note(self, note: str) -> None:
        if note not in self.report.notes:
            self.report.notes.append(note)

    def _unguarded(self, tokens: Tensor, states: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """A later step of a loop whose first step was fully guarded (NOTE [guards once per loop])."""
        # Another thread may enter compiled code (NOTE [guards once per loop]); a forward with a graph break runs
        # frames Dynamo compiles, or skips, at each call (NOTE [a forward with a graph break]).
        if self.graph_break is not None or self._past_recompile_limit or not _only_thread():
            return self.logits_and_greedy(tokens, states)
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):  # views, as the guarded call passed them
            return self._compiled(tokens.view(tokens.shape), [buffer[...] for buffer in states])

    def loop(self, states: Sequence[Tensor]) -> DecodeLoop:
        """One decode loop over the buffers `states` (`state_buffer`); see NOTE [guards once per loop]."""
        return DecodeLoop(self, states)

    def graphs_compiled(self) -> int:
        """Dynamo graphs compiled so far (each batch-size class and each recompile adds one)."""
        return self.report.count("dynamo")


class DecodeLoop:
    """Steps of one decode loop over one set of buffers: each call is `DecodeStep.logits_and_greedy`.

    The first call checks the tokens and buffers and evaluates every Dynamo
    guard; later calls check that the tokens have the first call's shape and
    dtype and evaluate only the guards that choose between the step's graphs
    (NOTE [guards once per loop]); with the step's ``guards_once_per_loop``
    False, every call is a fully checked and guarded step.
    """

    def __init__(self, step: DecodeStep, states: Sequence[Tensor]) -> None:
        self.step = step
        self.states = list(states) if isinstance(states, (list, tuple)) else states  # checked at the first call
        self.tokens_like: tuple | None = None  # (shape, dtype) of the first call's tokens

    @torch.no_grad()
    def __call__(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        if self.tokens_like is None or not self._later_calls_skip_guards():
            out = self._guarded(tokens)  # every check and every guard
            self.tokens_like = (tokens.shape, tokens.dtype)
            return out
        if (tokens.shape, tokens.dtype) != self.tokens_like:
            shape, dtype = self.tokens_like
            raise ValueError(f"a decode loop's tokens keep the first step's shape and dtype, {tuple(shape)} "
                             f"{dtype}; got {tuple(tokens.shape)} {tokens.dtype}: start a new loop (step.loop)")
        return self._later(_with_stride_one(tokens))

    def _guarded(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The loop's first call, and each later one where guards are not skipped."""
        return self.step.logits_and_greedy(tokens, self.states)

    def _later_calls_skip_guards(self) -> bool:
        return self.step.guards_once_per_loop

    def _later(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """A call after the loop's first (NOTE [guards once per loop])."""
        return self.step._unguarded(tokens, self.states)


def _with_stride_one(tokens: Tensor) -> Tensor:
    """`tokens` [B] with stride 1, as the step's graph takes them: a column of a [B, T] batch, even of a [1, T]
    one, whose `contiguous()` keeps its stride, would recompile for its stride."""
    if tokens.stride() != (1,):
        return tokens.clone(memory_format=torch.contiguous_format)
    return tokens


def mark_batch_class(batch: int, tensors: Sequence[Tensor]) -> None:
    """Dimension 0 of each of `tensors` marked dynamic within `batch`'s class and compiled as for the class's
    batch (NOTE [batch classes]); a single sequence is left to torch, which specialises it."""
    if batch < 2:
        return
    low, high, hint = batch_class(batch)
    for tensor in tensors:
        torch._dynamo.mark_dynamic(tensor, BATCH_DIM, min=low, max=high, hint_override=hint)


def batch_class(batch: int) -> tuple[int, int, int]:
    """The class of `batch` >= 2 (NOTE [batch classes]): its smallest and largest batch, and the batch its graph
    is compiled as for."""
    if batch < 2:
        raise ValueError(f"batch classes start at 2 sequences (torch specialises 0 and 1), got {batch}")
    if batch < LARGE_BATCH:
        return 2, LARGE_BATCH - 1, SMALL_BATCH_HINT
    return LARGE_BATCH, _LARGEST_BATCH, LARGE_BATCH_HINT


def _only_thread() -> bool:
    """No Python thread but this one that could call compiled code (NOTE [guards once per loop])."""
    from tqdm._monitor import TMonitor

    current = threading.current_thread()
    return all(t is current or isinstance(t, TMonitor) or runs_no_compiled_code(t) for t in threading.enumerate())


def _check_step_inputs(tokens: Tensor, states: Sequence[Tensor]) -> None:
    if not isinstance(states, (list, tuple)) or not all(isinstance(s, Tensor) for s in states):
        given = f"a tensor of shape {tuple(states.shape)}" if isinstance(states, Tensor) else type(states).__name__
        raise ValueError(f"states must be a list of per-layer [B, H, K, V] buffers (from state_buffer), got {given}")
    shapes = [tuple(s.shape) for s in states]
    if tokens.dim() != 1 or not states or any(len(shape) != STATE_DIMS or shape[BATCH_DIM] != tokens.shape[0]
                                              for shape in shapes):
        raise ValueError(f"expected tokens [B] and one [B, H, K, V] state buffer per layer with the same B, got "
                         f"tokens {tuple(tokens.shape)} and states {shapes}")
    if any(s.dtype != torch.float32 for s in states):
        raise ValueError(f"state buffers must be float32 (state_buffer makes them), got {[s.dtype for s in states]}")
    first_with = {}
    for layer, buffer in enumerate(states):  # one buffer given twice: a layer's state would overwrite another's
        earlier = first_with.setdefault(buffer.data_ptr(), layer)
        if earlier != layer:
            raise ValueError(f"states[{earlier}] and states[{layer}] are the same memory: each layer needs a "
                             "buffer of its own (state_buffer makes them)")
