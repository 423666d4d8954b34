"""Every path of the project's goal table in one command, each row printed as soon as it is measured.

    python -m benchmarks.bench_paths                    # every row at its full shape (a quarter of an hour on 2 cores)
    python -m benchmarks.bench_paths --rows prefill decode
    python -m benchmarks.bench_paths --quick            # small shapes, inner eager: seconds per row (a smoke run)
    python -m benchmarks.bench_paths --json
    python -m benchmarks.bench_paths --threads 1        # on a machine shared with other work (see below)

Above the table, the machine the figures are read against: its CPU, cores,
vector and matrix extensions, load average, the bandwidth of a large copy
and the rate of a dense fp32 matmul, and the CPU seconds of its reference
work (fixed Python and g++ work on one thread, `benchmarks.reference_work`),
against which the compile rows compare across machines. Each row: the
path, the figure measured, the goal, and whether it is met. Rows (`--rows`):

- prefill: ``model.generate(prompt, 1)``'s default prefill of `tiny`,
  8 x 1024 tokens, over the same model compiled with backend="laplace"
  (target cpu, Inductor) for the prompt's shape; median of the per-repeat
  ratios (`benchmarks.bench_generate.measure`); goal <= 1.25x.
- decode: `tiny` at 1,280 sequences through ``model.generate``, the steps
  only: (generate of 66 tokens - generate of 2) / 64 per step, as tokens/s
  over the binding roofline (the lower of memory: weights and states at the
  copy bandwidth, and matmul: FLOPs at the dense rate, both measured in the
  same repeat; `benchmarks.bench_decode`'s); goal >= 60%. Beside it, the
  step's matmuls alone (`benchmarks.bench_decode`'s, one per `nn.Linear` at
  the step's shapes) over the same roofline, timed in each repeat: what a
  step whose other kernels and call cost nothing would reach. Two rows,
  measured in the same repeats (they alternate): ``decode="compiled"``, the
  JIT step (the default where no library was compiled ahead of time), and
  generate's default after a ``decode="ahead-of-time"`` call has compiled
  the step's library (15 to 40 s, not timed) or loaded it from disk: the
  default then runs that library, and the row says what it ran, with its
  ratio to the JIT step per repeat. --quick: the JIT step only.
- gla: GLA forward + backward, B=1, T=2048, H=4, K=128, V=256, chunk 128,
  backend="laplace" with inner inductor, its FLOPs (the chunked algorithm's)
  per second over the dense matmul rate measured in the same rounds
  (`benchmarks.bench_gla.measure`); goal >= 50%. Beside it, the same FLOPs
  over the time of the call's matmuls alone (`benchmarks.matmuls_alone`):
  the share the path would reach if everything else cost nothing. Unless the whole run keeps
  freed memory (`--keep-freed-memory`), the row is measured once more after
  every other row, with `laplace_passes.keep_freed_memory()` applied then
  (process-wide and for good, hence last): the same path without the page
  faults of glibc's defaults (NOTE [freed memory kept]).
- compile: the first call (forward + backward) of `tiny`'s training step at
  T = 2048, inner inductor, empty Inductor cache, in a fresh process per
  target and run (`benchmarks.bench_compile.in_fresh_process`), three runs
  per target, the targets alternating; median [min-max]; goals cpu <= 25 s,
  trn2 <= 40 s. The same code's first call moved from 24 s to 36 s within
  an hour on one quiet 2-core machine: one run per target said little.

`--quick` shrinks every shape and compiles with inner "eager" (no Inductor),
so each row takes seconds; its figures say nothing about the goals, which
are for the full shapes. Progress goes to stderr, the table to stdout.

On a machine whose cores other work also uses, torch's default threads
(one per core) wait on each other in every parallel kernel: generate's
prefill of 8 x 1000 tokens took 0.25 to 0.33 s with one thread and 6 to
13 s with two, on 2 cores at load average 6 to 9. Every
row's figure is a ratio to a rate measured with the same threads, so
`--threads 1` keeps them comparable there; the compile row's processes
use torch's default.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace
from typing import Callable, Iterator

import torch

import model_zoo
from benchmarks import bench_compile, bench_gla, bench_generate, reference_work
from benchmarks.bench_decode import (copy_bytes_per_s, default_decode_runs, matmul_flops_per_s, matmuls_seconds,
                                     step_costs, step_matmuls)
from benchmarks.common import KEEP_FREED_HELP, allocator_setting, machine_lines, print_row, say, stats

ROWS = ("prefill", "decode", "gla", "compile")
# Shapes per row: the goal table's, and --quick's.
FULL = {
    "prefill": {"batch": 8, "length": 1024, "repeats": 5},
    "decode": {"sequences": 1280, "steps": 64, "prompt": 16, "repeats": 7, "ahead_of_time": True},
    "gla": {"shape": {"B": 1, "T": 2048, "H": 4, "K": 128, "V": 256}, "chunk_size": 128, "repeats": 5},
    "compile": {"seq_len": 2048, "repeats": 3},
    "reference_repeats": 3,
    "inner": "inductor",
}
QUICK = {
    "prefill": {"batch": 2, "length": 100, "repeats": 1},
    "decode": {"sequences": 4, "steps": 8, "prompt": 8, "repeats": 1, "ahead_of_time": False},
    "gla": {"shape": {"B": 1, "T": 128, "H": 1, "K": 16, "V": 32}, "chunk_size": 64, "repeats": 1},
    "compile": {"seq_len": 64, "repeats": 1},
    "reference_repeats": 1,
    "inner": "eager",
}
COMPILE_GOALS = {"cpu": 25.0, "trn2": 40.0}  # seconds
COMPARE = {"<=": operator.le, ">=": operator.ge}


@dataclass
class Row:
    path: str
    figure: str  # the measured value, as printed, with its spread
    value: float | None  # None: not measured (the figure says why)
    goal: str  # "<= 1.25x"
    met: bool


def row(path: str, value: float, figure: str, comparison: str, goal: float, unit: str) -> Row:
    goal_text = f"{comparison} {goal:.0%}" if unit == "%" else f"{comparison} {goal:g}{unit}"
    return Row(path, figure, value, goal_text, COMPARE[comparison](value, goal))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="rows to measure, in order")
    parser.add_argument("--quick", action="store_true", help="small shapes, inner eager: seconds per row")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's; 1 on a machine shared with other work)")
    parser.add_argument("--keep-freed-memory", action="store_true", help=KEEP_FREED_HELP)
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end instead of the table")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    allocator = allocator_setting(args.keep_freed_memory)
    sizes = QUICK if args.quick else FULL
    machine = measure_machine(reference_repeats=sizes["reference_repeats"]) | {"allocator": allocator}
    if not args.json:
        for line in machine_text(machine, args.quick):
            print_row(line)
    rows = []
    measures = [(name, MEASURE[name]) for name in args.rows]
    if "gla" in args.rows and not args.keep_freed_memory:  # last: the setting stays for the rest of the process
        measures.append(("gla, freed memory kept", measure_gla_freed_memory_kept))
    for name, measure in measures:
        say(f"measuring {name} ...")
        for measured in measure(sizes):
            rows.append(measured)
            if not args.json:
                print_row(row_text(measured))
    load_end = os.getloadavg()  # the rows take minutes: the load they ran under
    results = {"machine": machine, "quick": args.quick, "rows": [asdict(r) for r in rows], "load_average_end": load_end}
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_row("load average at the end " + " ".join(f"{x:.2f}" for x in load_end))
    return results


def measure_machine(repeats: int = 3, reference_repeats: int = 3) -> dict:
    """The CPU (model, cores, extensions) and, measured now, its load, copy bandwidth, matmul rate and the
    seconds of its reference work (`benchmarks.reference_work`)."""
    load_before = os.getloadavg()
    bandwidths, rates = [], []
    for _ in range(repeats):
        bandwidths.append(copy_bytes_per_s() / 1e9)
        rates.append(matmul_flops_per_s() / 1e9)
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "extensions": cpu_extensions(), "load_average_before": load_before,
            "load_average_after": os.getloadavg(), "copy_GB_per_s": stats(bandwidths),
            "matmul_GFLOP_per_s": stats(rates), "reference_work": reference_work.measure(reference_repeats),
            "torch": torch.__version__}


def cpu_model() -> str:
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_extensions() -> list[str]:
    """The AVX-512 and AMX flags the CPU reports (Linux's /proc/cpuinfo; none where it is absent)."""
    for line in _cpuinfo_lines():
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
            return sorted(f for f in flags if f.startswith(("avx512", "amx")))
    return []


def _cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def machine_text(machine: dict, quick: bool) -> list[str]:
    extensions = " ".join(machine["extensions"]) or "no AVX-512, no AMX"
    lines = [
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} with "
        f"{machine['threads']} threads",
        f"  {extensions}",
        *machine_lines(machine["load_average_before"], machine["load_average_after"], machine["copy_GB_per_s"],
                       machine["matmul_GFLOP_per_s"]),
        reference_work.text(machine["reference_work"]),
        f"  allocator: {machine['allocator']}",
    ]
    if quick:
        lines.append("--quick: small shapes, inner eager; the goals are for the full shapes")
    lines.append(f"{'path':<64}  {'measured: median [min-max]':<36}  {'goal':<10}  met")
    return lines


def row_text(measured: Row) -> str:
    return f"{measured.path:<64}  {measured.figure:<36}  {measured.goal:<10}  {'yes' if measured.met else 'no'}"


def _figure(cell: dict, fmt: str, unit: str = "") -> str:
    """`median [min-max]` of a `stats` cell, the unit after each number."""
    median, low, high = (format(cell[k], fmt) + unit for k in ("median", "min", "max"))
    return f"{median} [{low}-{high}]"


def _with_inner(model, inner: str):
    """`model` whose generate() compiles its default prefill and decode step with `inner` (kept on the model)."""
    if inner != "inductor":
        from model_zoo.decode import DecodeStep
        from model_zoo.prefill import CompiledPrefill

        model.__dict__["_compiled_prefill"] = CompiledPrefill(model, inner=inner)
        model.__dict__["_decode_step"] = DecodeStep(model, inner=inner)
    return model


def tiny(inner: str):
    torch.manual_seed(0)
    return _with_inner(model_zoo.build("tiny").eval(), inner)


def measure_prefill(sizes: dict) -> list[Row]:
    s = sizes["prefill"]
    result = bench_generate.measure(tiny(sizes["inner"]), s["batch"], s["length"], s["repeats"], sizes["inner"],
                                    forms=("default", "compiled"))
    ratio = result["ratios"]["default_over_compiled"]
    path = f"prefill: generate default / compiled forward, tiny {s['batch']} x {s['length']}"
    return [row(path, ratio["median"], _figure(ratio, ".2f", "x"), "<=", 1.25, "x")]


def measure_decode(sizes: dict) -> list[Row]:
    s = sizes["decode"]
    model = tiny(sizes["inner"])
    # The full table: the JIT step, then generate's default once a library compiled ahead of time exists (the
    # warm-up's decode="ahead-of-time" call compiles it, or loads it from disk). --quick: the JIT step only.
    modes, warm_up = (("compiled", "auto"), ("compiled", "ahead-of-time", "auto")) if s["ahead_of_time"] else \
        (("compiled",), ("compiled",))
    result = decode_steps_through_generate(model, s["sequences"], s["steps"], s["prompt"], s["repeats"], modes,
                                           warm_up)
    ceiling = statistics.median(result["matmuls_alone_share"])
    rows = []
    for mode in modes:
        share = result[mode]["share_of_binding_roofline"]
        how = "generate(decode='compiled')'s steps, the JIT step" if mode == "compiled" else \
            f"generate's default steps, which ran {result['default_ran']}"
        path = f"decode: tiny {s['sequences']} sequences, {how} / {result['binding']} roofline"
        figure = (f"{_figure(stats(share), '.1%')} ({statistics.median(result[mode]['tokens_per_s']):,.0f} tok/s; "
                  f"its matmuls alone {ceiling:.0%})")
        if mode != "compiled":  # side by side with the JIT step, repeat by repeat
            ratios = [a / d for a, d in zip(result[mode]["tokens_per_s"], result["compiled"]["tokens_per_s"])]
            figure += f"; {_figure(stats(ratios), '.2f', 'x')} the JIT step's tokens/s"
        rows.append(row(path, statistics.median(share), figure, ">=", 0.60, "%"))
    return rows


def decode_steps_through_generate(model, sequences: int, steps: int, prompt_len: int, repeats: int,
                                  modes: tuple[str, ...] = ("compiled",), warm_up: tuple[str, ...] = ()) -> dict:
    """Tokens/s of generate's decode steps with each of `modes` (its ``decode=``): (generate of steps + 2 tokens -
    generate of 2) / steps per step (generate of n tokens runs n - 1 steps; the prefill and a loop's first, guarded
    step cancel), beside both rooflines measured in each repeat; the modes alternate within each repeat, after
    first calls with each of `warm_up` (default: `modes`). "default_ran", where "auto" is among `modes`: what the
    default runs then."""
    prompt = torch.randint(1, model.config.vocab_size, (sequences, prompt_len),
                           generator=torch.Generator().manual_seed(sequences))
    say("decode: first calls of generate (the decode steps compile) ...")
    for mode in warm_up or modes:
        model.generate(prompt, 2, decode=mode), model.generate(prompt, steps + 2, decode=mode)
    matmuls = step_matmuls(model, sequences)
    weight_bytes, state_bytes, flops = step_costs(model)
    out = {key: [] for key in ("memory_roofline", "matmul_roofline", "matmuls_alone_share")}
    out.update({mode: {"tokens_per_s": [], "share_of_binding_roofline": []} for mode in modes})
    for repeat in range(repeats):
        bandwidth, rate = copy_bytes_per_s(), matmul_flops_per_s()
        memory = sequences * bandwidth / (weight_bytes + 2 * sequences * state_bytes)
        matmul = rate / flops
        binding = min(memory, matmul)
        for mode in modes:
            seconds_short = _seconds(lambda: model.generate(prompt, 2, decode=mode))
            seconds_long = _seconds(lambda: model.generate(prompt, steps + 2, decode=mode))
            tokens_per_s = sequences * steps / (seconds_long - seconds_short)
            out[mode]["tokens_per_s"].append(tokens_per_s)
            out[mode]["share_of_binding_roofline"].append(tokens_per_s / binding)
        matmuls_alone = sequences * steps / matmuls_seconds(matmuls, steps)
        for key, value in (("memory_roofline", memory), ("matmul_roofline", matmul),
                           ("matmuls_alone_share", matmuls_alone / binding)):
            out[key].append(value)
        say(f"  repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{mode} {out[mode]['tokens_per_s'][-1]:,.0f} tokens/s" for mode in modes))
    out["binding"] = ("memory" if statistics.median(out["memory_roofline"]) < statistics.median(out["matmul_roofline"])
                      else "matmul")
    if "auto" in modes:  # the step compiled ahead of time is the default's: not made where it is not timed
        out["default_ran"] = default_decode_runs(model, prompt)
    return out


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_gla(sizes: dict) -> list[Row]:
    s = sizes["gla"]
    result = bench_gla.measure(s["shape"], s["chunk_size"], s["repeats"], baselines=False, inner=sizes["inner"])
    # Judged by the figure printed: the median of each round's share (GLA and matmul timed in that round),
    # not the share of the two medians, which in a noisy run can lie on the other side of the goal.
    shares = stats(result["compiled_fraction_per_round"])
    shape = " ".join(f"{k}={v}" for k, v in s["shape"].items())
    path = f"GLA fwd+bwd {shape}, chunk {s['chunk_size']} / dense matmul"
    ceiling = statistics.median(result["compiled_matmuls_fraction_per_round"])
    figure = f"{_figure(shares, '.1%')} ({result['compiled_gflops']:.0f} GFLOP/s; its matmuls alone {ceiling:.0%})"
    return [row(path, shares["median"], figure, ">=", 0.50, "%")]


def measure_gla_freed_memory_kept(sizes: dict) -> list[Row]:
    """The gla row once more with glibc keeping freed memory (`laplace_passes.keep_freed_memory`); the setting
    stays for the rest of the process, so this row comes after every other."""
    from laplace_passes import keep_freed_memory

    path = "GLA fwd+bwd as above, freed memory kept (keep_freed_memory)"
    try:
        say(f"  {keep_freed_memory()}")
    except OSError as error:  # not glibc: the table says so, not only the progress on stderr
        say(f"  not measured: {error}")
        return [Row(path, "not measured: " + str(error).split(":")[0], None, ">= 50%", False)]
    return [replace(measured, path=path) for measured in measure_gla(sizes)]


def measure_compile(sizes: dict) -> Iterator[Row]:
    """Each target's first call in `repeats` fresh processes (a new cache and temporary folder each), the
    targets alternating, so a quiet or a busy minute of the machine does not make one target's figure."""
    seq_len, repeats, inner = sizes["compile"]["seq_len"], sizes["compile"]["repeats"], sizes["inner"]
    options = SimpleNamespace(seq_len=seq_len, inner=inner, compile_threads=None)
    seconds: dict[str, list[float]] = {target: [] for target in COMPILE_GOALS}
    for repeat in range(repeats):
        for target in COMPILE_GOALS:
            seconds[target].append(bench_compile.in_fresh_process(target, options)["total_s"])
            say(f"  compile {target}, run {repeat + 1}/{repeats}: {seconds[target][-1]:.1f} s")
    for target, goal in COMPILE_GOALS.items():
        path = f"compile: first call of tiny's training step, T={seq_len}, {target}"
        cell = stats(seconds[target])
        yield row(path, cell["median"], _figure(cell, ".1f", " s"), "<=", goal, " s")


MEASURE = {"prefill": measure_prefill, "decode": measure_decode, "gla": measure_gla, "compile": measure_compile}


if __name__ == "__main__":
    main()
