"""Recurrent decode throughput against this machine's memory roofline, and state bytes against a KV cache.

    python -m benchmarks.bench_decode [--steps 16] [--generate-steps 64] [--repeats 3] [--json]
    python -m benchmarks.bench_decode --profile [--steps 8]     # where a step's time goes
    python -m benchmarks.bench_decode --gate-checks             # and the step that checks its gates, side by side
    python -m benchmarks.bench_decode --sequences 1 4 --steps 1 --repeats 1   # seconds: a smoke run
    python -m benchmarks.bench_decode --small-batch-first       # a step of 2 sequences first: the same figures
    python -m benchmarks.bench_decode --ahead-of-time           # and generate's steps compiled by AOTInductor

Decode of the `tiny` model at 1, 64 and 1280 concurrent sequences (one batch;
each step feeds one token per sequence and carries the fp32 state), three ways,
the first two timed over `--steps` greedy steps as `model.generate` runs them:

- eager:    ``decode="eager"``, the model's forward per step (the reference op per layer);
- compiled: ``decode="compiled"`` (the JIT step, generate's default on CPU where no
  library compiled ahead of time exists: the table says which the default runs), one call per step of a
  `model_zoo.decode.DecodeStep`'s loop (``step.loop(buffers)``, as generate runs it:
  the greedy choice in the graph, Dynamo's guards evaluated at the loop's first call only,
  which is made before the clock starts),
  every layer in one graph through ``backend="laplace"``, the states
  in a buffer per layer updated in place. tiny's gates are logsigmoid(x) / 16, <= 0 by
  construction, so the step has no run-time gate check (NOTE [gates proven <= 0]);
- generate: ``model.generate`` itself, steps only: the time of
  ``generate(prompt, N + 2)`` less that of ``generate(prompt, 2)``, over N
  (``--generate-steps``, default 64): the prefill, the first step and the
  set-up cancel, so this is a step as a user's generate call runs it, with
  everything generate does around the step object;
- ahead_of_time and generate_ahead_of_time (with ``--ahead-of-time``): the step
  compiled by AOTInductor (`model_zoo.decode_ahead`; no Dynamo or Python between its
  kernels), its loop's steps measured as compiled's and ``model.generate(...,
  decode="ahead-of-time")``'s as generate's; its compile (15 to 40 s per batch class,
  kept on disk) is not timed, and each is printed over its JIT-compiled counterpart
  per repeat;
- checked (with ``--gate-checks``): the same compiled step with ``gate_checks="always"``,
  which checks every layer's gates at run time; the speed-up of leaving the check out
  is printed per repeat.

Beside each, in the same repeat:

- memory roofline: tokens/s if a step cost only its memory traffic, the weights read
  once plus every sequence's state read and written, at the bandwidth of a large
  tensor copy measured in this run (read + write bytes over time);
- matmul roofline: tokens/s if a step cost only its FLOPs (2 per weight per token,
  plus the state update and readout), at the rate of a dense fp32 matmul measured
  in this run.

The lower of the two binds, and each form's share of it is printed: the figure
to read at 1280 sequences is generate's. Beside them, what the binding roofline
leaves out, in the same repeats:

- matmuls alone: the step's own matrix products (one per `nn.Linear`, the output
  head included, at its shape: ``[B, in] @ [in, out]``, on the model's weights, each
  written into a buffer its shape reuses as the step does), one after another, nothing
  else: the most a step whose matmuls run at their shapes' rate can reach. At
  1280 sequences of `tiny` they are narrow (inner dimension 64 or 256, 16 to 256
  columns) and run below the dense rate;
- and sequential: those matmuls followed by the state's traffic at copy bandwidth,
  not overlapped (the step's kernels run one after another): a step that wastes
  nothing else reaches this;
- matmuls and state updates: those matmuls with each layer's state update run
  before its output projection, as the step orders them, and nothing else: the
  update is the recurrent form the compiled step uses (`gla_recurrence` with the
  cpu target's summed readout, the state written back in place into a buffer of
  the step's layout), compiled alone by Inductor on random inputs of the step's
  shapes, one compiled call per layer (a step is one call for all its layers).
  Measured rather than derived from a bandwidth, so a state that stays in the
  cache counts at the cache's speed. The norms, gates, activations, residual adds,
  embedding and argmax are left out, so a whole step runs slower than this.

Measurements are interleaved (each repeat runs the copy, the matmul and every
batch size once per form) and the spread over repeats is printed; the load
average is printed before and after. Then the recurrent state per sequence of
`tiny` and `laplace-3b` beside the KV cache (bf16) of a softmax model of the
same depth and width at 2k, 8k and 32k tokens of context.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch._dynamo

import model_zoo
from benchmarks.bench_gla import make_inputs
from benchmarks.common import machine_lines, self_time_by_part, spread, stats
from laplace_passes.infra.targets import CPU
from laplace_passes.ops.gla import gla_recurrence
from model_zoo.decode import DecodeStep, mark_batch_class

CONCURRENCY = (1, 64, 1280)
CONTEXTS = (2048, 8192, 32768)
FORMS = ("eager", "compiled", "generate")
PROFILED_FORMS = ("eager", "compiled")  # a step of each, profiled alone (generate's would include its prefill)
GENERATE = "generate"  # model.generate's steps: generate(N + 2) less generate(2), over N
GENERATE_AHEAD = "generate_ahead_of_time"  # the same with decode="ahead-of-time" (--ahead-of-time)
AHEAD = "ahead_of_time"  # the loop of the step compiled ahead of time (--ahead-of-time)
MATMULS = "matmuls_alone"  # the step's matrix products alone, at their shapes
MATMULS_AND_STATES = "matmuls_and_states"  # those and each layer's state update, nothing else
CHECKED = "checked"  # the compiled step with gate_checks="always" (--gate-checks)
COPY_ELEMENTS = 32 * 1024 * 1024  # 128 MB per side: well past the last-level cache
MATMUL_SIZE = 1024


def copy_bytes_per_s() -> float:
    src = torch.ones(COPY_ELEMENTS)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return 2 * src.numel() * src.element_size() / (time.perf_counter() - start)


def matmul_flops_per_s() -> float:
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    a @ a
    start = time.perf_counter()
    a @ a
    return 2 * MATMUL_SIZE**3 / (time.perf_counter() - start)


def step_matmuls(model, batch: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input, weight, output) of each matrix product a decode step runs: every `nn.Linear` (the head too) at
    `batch` rows, on the model's weights. One input per width and one output per shape, each reused by every
    product of its shape, as the compiled step reuses its buffers: the products touch no more memory than
    the step's do."""
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    return [(inputs.setdefault(m.in_features, torch.randn(batch, m.in_features)), m.weight.detach(),
             outputs.setdefault(m.out_features, torch.empty(batch, m.out_features))) for m in _linears(model)]


def _linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def matmuls_seconds(matmuls: list, steps: int, updates: StateUpdates | None = None) -> float:
    """Wall time of `steps` rounds of the step's matmuls, weights transposed as the compiled step reads them;
    with `updates`, each layer's state update before its output projection, as the step orders them."""
    before = updates.before if updates is not None else {}
    start = time.perf_counter()
    for _ in range(steps):
        for i, (x, weight, out) in enumerate(matmuls):
            if i in before:
                updates(before[i])
            torch.mm(x, weight.t(), out=out)
    return time.perf_counter() - start


def _update_state(buffer: torch.Tensor, q, k, v, gk, scale: float) -> torch.Tensor:
    """One token's state update and readout, as the compiled step's recurrent form computes them; the
    next state is written into `buffer`."""
    o, state = gla_recurrence(q, k, v, gk, buffer, scale, readout=CPU.recurrent_readout)
    buffer.copy_(state)
    return o


class StateUpdates:
    """Each layer's state update at `batch` sequences, on random inputs of the step's shapes, through
    Inductor (each update one call of a compiled function, as a step is one call of one).

    `before` maps the index (in `_linears` order) of each layer's output projection to that layer: the
    step runs the projection after the update.
    """

    def __init__(self, model, batch: int) -> None:
        c = model.config
        one_token = make_inputs(batch, 1, c.num_heads, c.head_k_dim, c.head_v_dim, seed=batch)
        self.inputs = [x.detach() for x in one_token]  # q, k, v, gk
        zeros = [torch.zeros(batch, c.num_heads, c.head_k_dim, c.head_v_dim) for _ in range(c.num_layers)]
        self.buffers = DecodeStep.state_buffer(zeros)  # in the step's layout
        self.scale = c.head_k_dim ** -0.5
        out_projections = [layer.attn.o_proj for layer in model.layers]
        self.before = {i: out_projections.index(m) for i, m in enumerate(_linears(model)) if m in out_projections}
        mark_batch_class(batch, (*self.inputs, *self.buffers))  # one graph per batch class, as the step has

    def __call__(self, layer: int) -> torch.Tensor:
        return _compiled_update(self.buffers[layer], *self.inputs, self.scale)


_compiled_update = torch.compile(_update_state, backend="inductor", dynamic=None)


class Decoder:
    """One batch size: a prompt prefilled once, then `steps` greedy steps timed in each form."""

    def __init__(self, model, batch: int, prompt_len: int = 16, checked_step=None, ahead_of_time=False) -> None:
        self.model = model
        self.steps = {"eager": None, "compiled": model.decode_step}
        if checked_step is not None:
            self.steps[CHECKED] = checked_step
        if ahead_of_time:
            self.steps[AHEAD] = model.ahead_of_time_step
        self.prompt = torch.randint(1, model.config.vocab_size, (batch, prompt_len),
                                    generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            logits, self.states = model(self.prompt, output_final_states=True)
        self.first_token = logits[:, -1].argmax(-1)
        self.matmuls = step_matmuls(model, batch)
        self.state_updates = StateUpdates(model, batch)
        for form in (*self.steps, GENERATE, *((GENERATE_AHEAD,) if ahead_of_time else ()), MATMULS,
                     MATMULS_AND_STATES):  # compile and warm up
            self.seconds(form, 2)

    def seconds(self, form: str, steps: int) -> float:
        """Wall time of `steps` greedy decode steps in `form` (MATMULS: the step's matmuls alone;
        MATMULS_AND_STATES: and the layers' state updates)."""
        if form in (GENERATE, GENERATE_AHEAD):
            return self.generate_seconds(steps, "ahead-of-time" if form == GENERATE_AHEAD else "compiled")
        if form == MATMULS:
            return matmuls_seconds(self.matmuls, steps)
        if form == MATMULS_AND_STATES:
            return matmuls_seconds(self.matmuls, steps, self.state_updates)
        return self.loop_seconds(form, steps)

    @torch.no_grad()
    def loop_seconds(self, form: str, steps: int) -> float:
        """Wall time of `steps` greedy decode steps, as generate() runs them; a loop's first call (where Dynamo's
        guards are evaluated, once per loop) is made before the clock starts."""
        token, states = self.first_token, self.states
        step = self.steps[form]
        if step is not None:  # generate() makes the buffers and the loop once per call, before the steps
            decode_loop = step.loop(step.state_buffer(states))
            _, token = decode_loop(token)
        start = time.perf_counter()
        for _ in range(steps):
            if step is not None:
                _, token = decode_loop(token)  # the greedy choice, taken in the step's graph
            else:
                logits, states = self.model(token[:, None], initial_states=states, output_final_states=True)
                token = logits[:, -1].argmax(-1)
        return time.perf_counter() - start

    def generate_seconds(self, steps: int, decode: str = "compiled") -> float:
        """`model.generate`'s time for `steps` decode steps (``decode=``): generate(steps + 2) less generate(2).

        Both prefill the same prompt and take one step after it; the difference
        is `steps` further steps with everything generate does around each.
        """
        def timed(new_tokens: int) -> float:
            start = time.perf_counter()
            self.model.generate(self.prompt, new_tokens, decode=decode)
            return time.perf_counter() - start

        return timed(steps + 2) - timed(2)


# torch.profiler event names -> where the time of a step goes (self CPU time; the rest is "other").
PROFILE_BUCKETS = {
    "matmuls": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"),
    "compiled kernels (Inductor)": ("## Call CompiledFxGraph",),
    "gate checks": ("laplace::check_gates", "aten::le", "aten::all", "aten::_local_scalar_dense"),
    "copies, stacks, cats": ("aten::copy_", "aten::cat", "aten::stack", "aten::clone", "aten::_to_copy"),
    "elementwise (eager)": ("aten::mul", "aten::add", "aten::exp", "aten::pow", "aten::sum", "aten::mean",
                            "aten::silu", "aten::rsqrt", "aten::div", "aten::log_sigmoid_forward"),
    "Dynamo / AOT call overhead": ("TorchDynamo Cache Lookup", "Pregraph bytecode", "Torch-Compiled Region",
                                   "AOTDispatcher"),
}


def profile_step(decoder: Decoder, form: str, steps: int) -> dict:
    """Milliseconds per step by `PROFILE_BUCKETS`, from torch.profiler's self CPU times."""
    from torch.profiler import profile

    with profile() as prof:
        decoder.seconds(form, steps)
    by_prefix = {name: (lambda key, p=prefixes: key.startswith(p)) for name, prefixes in PROFILE_BUCKETS.items()}
    return {name: s * 1e3 / steps for name, s in self_time_by_part(prof, by_prefix, rest="other").items()}


def profiles(model, steps: int, sequences=CONCURRENCY) -> dict:
    out = {}
    for batch in sequences:
        decoder = Decoder(model, batch)
        out[batch] = {form: profile_step(decoder, form, steps) for form in PROFILED_FORMS}
    return out


def _profile_text(table: dict) -> str:
    lines = ["where a step's time goes (ms per step, torch.profiler self CPU time):"]
    for batch, forms in table.items():
        for form, buckets in forms.items():
            total = sum(buckets.values())
            parts = ", ".join(f"{name} {ms:.2f} ({ms / total:.0%})" for name, ms in buckets.items() if ms > 0)
            lines.append(f"  {batch:5d} sequences, {form:<8} {total:8.2f} ms: {parts}")
    return "\n".join(lines)


def step_costs(model) -> tuple[int, int, int]:
    """(weight bytes read per step, state bytes per sequence, FLOPs per token)."""
    c = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_elements = c.num_layers * c.num_heads * c.head_k_dim * c.head_v_dim
    # 2 FLOPs per weight (every weight multiplies once per token; the tied embedding counts as the
    # output head), and per state element: decay, k v^T (multiply, add), readout q S (multiply, add).
    flops = 2 * model.num_parameters() + 5 * state_elements
    return weight_bytes, state_elements * 4, flops


def measure(model, steps: int, repeats: int, concurrency=CONCURRENCY, gate_checks: bool = False,
            generate_steps: int = 64, ahead_of_time: bool = False) -> dict:
    checked_step = DecodeStep(model, gate_checks="always") if gate_checks else None
    decoders = {b: Decoder(model, b, checked_step=checked_step, ahead_of_time=ahead_of_time) for b in concurrency}
    forms = (*FORMS, *((AHEAD, GENERATE_AHEAD) if ahead_of_time else ()), MATMULS, MATMULS_AND_STATES,
             *((CHECKED,) if gate_checks else ()))
    weight_bytes, state_bytes, flops = step_costs(model)
    samples = {b: {k: [] for k in (*forms, "memory_roofline", "matmul_roofline", "state_traffic")}
               for b in concurrency}
    bandwidths, rates = [], []
    for _ in range(repeats):
        bandwidths.append(copy_bytes_per_s())
        rates.append(matmul_flops_per_s())
        for batch, decoder in decoders.items():
            for form in forms:
                n = generate_steps if form in (GENERATE, GENERATE_AHEAD) else steps
                samples[batch][form].append(batch * n / decoder.seconds(form, n))
            step_bytes = weight_bytes + 2 * batch * state_bytes
            samples[batch]["memory_roofline"].append(batch * bandwidths[-1] / step_bytes)
            samples[batch]["matmul_roofline"].append(rates[-1] / flops)
            samples[batch]["state_traffic"].append(bandwidths[-1] / (2 * state_bytes))  # tokens/s, state alone
    return {
        "copy_GB_per_s": [b / 1e9 for b in bandwidths],
        "matmul_GFLOP_per_s": [r / 1e9 for r in rates],
        "bytes_per_step": {"weights": weight_bytes, "state_read_and_written_per_sequence": 2 * state_bytes},
        "flops_per_token": flops,
        "decode": {b: _summary(s) for b, s in samples.items()},
    }


def _summary(samples: dict) -> dict:
    out = {k: stats(v) for k, v in samples.items()}
    binding = [min(m, f) for m, f in zip(samples["memory_roofline"], samples["matmul_roofline"])]
    for form in _timed_forms(samples):  # shares per repeat: the roofline measured beside the decode
        for roof in ("memory_roofline", "matmul_roofline"):
            out[f"{form}_share_of_{roof}"] = stats([a / r for a, r in zip(samples[form], samples[roof])])
        out[f"{form}_share_of_binding_roofline"] = stats([a / r for a, r in zip(samples[form], binding)])
    # The matmuls, then the state's traffic: their times add (tokens/s are rates of one token each).
    sequential = [1 / (1 / m + 1 / t) for m, t in zip(samples[MATMULS], samples["state_traffic"])]
    for form in (MATMULS, MATMULS_AND_STATES):
        out[f"{form}_share_of_binding_roofline"] = stats([m / r for m, r in zip(samples[form], binding)])
    out["sequential_share_of_binding_roofline"] = stats([q / r for q, r in zip(sequential, binding)])
    out["compiled_over_eager"] = stats([c / e for c, e in zip(samples["compiled"], samples["eager"])])
    if GENERATE_AHEAD in samples:  # per repeat: the steps compiled ahead of time, against the JIT-compiled ones
        out["ahead_of_time_over_compiled"] = stats([a / c for a, c in zip(samples[AHEAD], samples["compiled"])])
        out["ahead_of_time_over_generate"] = stats([a / g for a, g in zip(samples[GENERATE_AHEAD], samples[GENERATE])])
    if CHECKED in samples:  # per repeat: leaving the gate check out, against keeping it
        out["compiled_over_checked"] = stats([c / g for c, g in zip(samples["compiled"], samples[CHECKED])])
    return out


def _timed_forms(samples: dict) -> tuple[str, ...]:
    return (*FORMS, *((AHEAD, GENERATE_AHEAD) if GENERATE_AHEAD in samples else ()))


def state_table() -> list[dict]:
    rows = []
    for name in ("tiny", "laplace-3b"):
        model = model_zoo.build(name, device="meta")
        state = model.recurrent_state_bytes_per_sequence()
        row = {"model": name, "state_bytes": state}
        for context in CONTEXTS:
            kv = model.kv_cache_bytes_softmax(context)
            row[f"kv_bytes_{context}"] = kv
            row[f"kv_over_state_{context}"] = kv / state
        rows.append(row)
    return rows


@torch.no_grad()
def default_decode_runs(model, prompt: torch.Tensor) -> str:
    """What generate's default decode ("auto") runs for `prompt`'s batch now: a library compiled ahead of time (in
    this process or on disk) or the JIT-compiled step (model_zoo/generate.py)."""
    step = model.ahead_of_time_step
    logits, states = model(prompt, output_final_states=True)
    loop = step.loop(step.state_buffer(states), compile_missing=False)
    loop(logits[:, -1].argmax(-1))
    return "the library compiled ahead of time" if loop.chosen is not None else "the JIT-compiled step"


def step_two_sequences(model) -> None:
    """One compiled decode step of 2 sequences: the graph of the step's small batch class, compiled first."""
    with torch.no_grad():
        _, states = model(torch.ones(2, 1, dtype=torch.long), output_final_states=True)
    model.decode_step(torch.ones(2, dtype=torch.long), model.decode_step.state_buffer(states))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    parser.add_argument("--generate-steps", type=int, default=64,
                        help="steps of the generate form: generate(N + 2) less generate(2), over N")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every measurement")
    parser.add_argument("--sequences", type=int, nargs="+", default=list(CONCURRENCY),
                        help="concurrent sequences, one measurement each (default: %(default)s)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="print where a step's time goes (torch.profiler) instead of the throughput table")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--gate-checks", action="store_true",
                        help="also time the compiled step with gate_checks='always', in the same repeats")
    parser.add_argument("--ahead-of-time", action="store_true",
                        help="also time generate's steps with decode='ahead-of-time' (AOTInductor), in the same "
                             "repeats; compiles one library per batch class (15 to 40 s each, kept on disk)")
    parser.add_argument("--small-batch-first", action="store_true",
                        help="first take one step of 2 sequences, as a machine whose first decode was small: "
                             "the figures at 64 sequences and more should match a run without it (NOTE [batch "
                             "classes] in model_zoo/decode.py); costs one more compile")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = model_zoo.build("tiny").eval()
    if args.small_batch_first:
        step_two_sequences(model)
    if args.profile:
        table = profiles(model, args.steps, args.sequences)
        print(json.dumps(table, indent=2) if args.json else _profile_text(table))
        return table
    load_before = os.getloadavg()
    results = measure(model, args.steps, args.repeats, args.sequences, args.gate_checks, args.generate_steps,
                      args.ahead_of_time)
    for batch in args.sequences if args.ahead_of_time else ():  # the step compiled ahead of time exists then
        results["decode"][batch]["default_runs"] = default_decode_runs(model, torch.ones(batch, 2, dtype=torch.long))
    results.update(generate_steps=args.generate_steps, load_average_before=load_before, load_average_after=os.getloadavg(),
                   threads=torch.get_num_threads(), steps=args.steps, repeats=args.repeats, state=state_table())
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(_text(results))
    return results


def _text(results: dict) -> str:
    lines = [
        f"decode, tiny model (greedy, fp32 state, CPU, {results['threads']} threads, {results['steps']} steps "
        f"(generate: {results['generate_steps']}), median [min-max] of {results['repeats']} interleaved repeats)",
        *machine_lines(results["load_average_before"], results["load_average_after"],
                       stats(results["copy_GB_per_s"]), stats(results["matmul_GFLOP_per_s"])),
        f"  per step: weights {results['bytes_per_step']['weights'] / 1e3:,.0f} kB, state read+written "
        f"{results['bytes_per_step']['state_read_and_written_per_sequence']:,} B per sequence; "
        f"{results['flops_per_token']:,} FLOPs per token",
    ]
    for batch, row in results["decode"].items():
        memory, matmul = row["memory_roofline"]["median"], row["matmul_roofline"]["median"]
        binding = "memory" if memory < matmul else "matmul"  # the lower roofline is the one a step can reach
        lines.append(f"  {batch:5d} sequences: memory roofline {memory:12,.0f} tokens/s, "
                     f"matmul roofline {matmul:12,.0f} tokens/s ({binding} binds)")
        for form in _timed_forms(row):
            lines.append(f"        {form:<8} {spread(row[form], '11,.0f')} tokens/s = "
                         f"{spread(row[f'{form}_share_of_binding_roofline'], '.2%')} of the binding roofline "
                         f"(memory {spread(row[f'{form}_share_of_memory_roofline'], '.2%')}, "
                         f"matmul {spread(row[f'{form}_share_of_matmul_roofline'], '.2%')})")
        lines.append(f"        the step's matmuls alone {spread(row[MATMULS], '11,.0f')} tokens/s = "
                     f"{spread(row[f'{MATMULS}_share_of_binding_roofline'], '.2%')} of the binding roofline; "
                     f"then the state's traffic, not overlapped: "
                     f"{spread(row['sequential_share_of_binding_roofline'], '.2%')}")
        lines.append(f"        the step's matmuls and state updates alone {spread(row[MATMULS_AND_STATES], '11,.0f')} "
                     f"tokens/s = {spread(row[f'{MATMULS_AND_STATES}_share_of_binding_roofline'], '.2%')} of the "
                     f"binding roofline (nothing else a step does)")
        lines.append(f"        compiled / eager {spread(row['compiled_over_eager'], '.2f')}x")
        if "default_runs" in row:
            lines.append(f"        generate's default (decode='auto') runs {row['default_runs']} at this batch")
        if "ahead_of_time_over_generate" in row:
            lines.append(f"        ahead of time / compiled: the loop's steps "
                         f"{spread(row['ahead_of_time_over_compiled'], '.2f')}x, generate's steps "
                         f"{spread(row['ahead_of_time_over_generate'], '.2f')}x")
        if "compiled_over_checked" in row:
            lines.append(f"        {CHECKED:<8} {spread(row[CHECKED], '11,.0f')} tokens/s (gate_checks='always'); "
                         f"compiled / checked {spread(row['compiled_over_checked'], '.2f')}x")
    lines.append("state per sequence vs softmax KV cache (bf16) of the same depth and width:")
    for row in results["state"]:
        kv = ", ".join(f"{c // 1024}k: {row[f'kv_bytes_{c}'] / 1e6:,.1f} MB (x{row[f'kv_over_state_{c}']:,.0f})"
                       for c in CONTEXTS)
        lines.append(f"  {row['model']:<10} state {row['state_bytes'] / 1e6:.3f} MB; KV cache {kv}")
    return "\n".join(lines)



if __name__ == "__main__":
    main()
