"""Timing helpers: everything is measured side by side in one run, and reported as ratios.

This machine is shared and noisy, so absolute times drift; measurements that
are compared are interleaved (A, B, A, B, ...) and summarised by their median.

Nothing is measured in silence: `say` puts a progress line on stderr at once
(the first call of a compiled path compiles, for up to minutes), and tables
print each row as soon as it is measured (`print_row`).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Mapping


def say(text: str) -> None:
    """A progress line on stderr, shown at once (stdout keeps the results, JSON included)."""
    print(text, file=sys.stderr, flush=True)


def print_row(text: str) -> None:
    """One row of a table on stdout, shown as soon as it is measured, not when the table is done."""
    print(text, flush=True)


def interleaved_samples(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each call of each function, calls interleaved round-robin: sample r of every function is round r.

    Each warm-up call and each round is said on stderr as it ends (a first call may compile for minutes).
    """
    for _ in range(warmup):
        for name, fn in fns.items():
            say(f"warming up {name} (a first call compiles) ...")
            say(f"  {name}: {once(fn):.1f} s")
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for round_index in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
        say(f"round {round_index + 1}/{repeats}: " + ", ".join(f"{name} {times[-1] * 1e3:.1f} ms"
                                                                for name, times in samples.items()))
    return samples


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved round-robin."""
    samples = interleaved_samples(fns, repeats, warmup)
    return {name: statistics.median(times) for name, times in samples.items()}


def once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def self_time_by_part(prof, parts: Mapping[str, Callable[[str], bool]], rest: str | None = None) -> dict[str, float]:
    """Self CPU seconds of a finished `torch.profiler.profile`, per part of the work.

    Each event goes to the first part (in order) whose test takes its name,
    or to `rest` when none does (dropped when `rest` is None).
    """
    seconds = dict.fromkeys([*parts, *([rest] if rest else [])], 0.0)
    for event in prof.key_averages():
        part = next((name for name, takes in parts.items() if takes(event.key)), rest)
        if part is not None:
            seconds[part] += event.self_cpu_time_total / 1e6
    return seconds


def rusage_seconds(who: int) -> float:
    """User and system CPU seconds of `resource.getrusage(who)` (RUSAGE_SELF, or RUSAGE_CHILDREN: the children
    waited for). Unix only: `resource` is imported here, where it is asked for."""
    import resource

    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def stats(values: list) -> dict:
    """The median and the range of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def spread(cell: dict, fmt: str) -> str:
    """`median [min-max]` of a `stats` cell."""
    return f"{format(cell['median'], fmt)} [{format(cell['min'], fmt)}-{format(cell['max'], fmt)}]"


def allocator_setting(keep_freed: bool) -> str:
    """How this run's memory allocator treats freed memory: `laplace_passes.keep_freed_memory` applied when
    asked for (NOTE [freed memory kept]), the C library's defaults otherwise."""
    if not keep_freed:
        return "the C library's defaults (--keep-freed-memory: freed memory kept, fewer page faults)"
    from laplace_passes import keep_freed_memory

    return keep_freed_memory()


KEEP_FREED_HELP = ("keep freed memory in the process first (laplace_passes.keep_freed_memory): large CPU tensors "
                   "reused without page faults")


def machine_lines(load_before, load_after, copy_GB_per_s: dict, matmul_GFLOP_per_s: dict) -> list[str]:
    """The lines a benchmark prints about the machine it ran on: its load, copy bandwidth and matmul rate
    (`stats` cells), against which its figures are read."""
    load = lambda average: " ".join(f"{x:.2f}" for x in average)  # noqa: E731
    return [
        f"  load average before {load(load_before)}, after {load(load_after)}",
        f"  copy bandwidth {spread(copy_GB_per_s, '.1f')} GB/s; "
        f"dense fp32 matmul {spread(matmul_GFLOP_per_s, '.1f')} GFLOP/s",
    ]
