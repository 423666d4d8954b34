"""Timing helpers: everything is measured side by side in one run, and reported as ratios.

This machine is shared and noisy, so absolute times drift; measurements that
are compared are interleaved (A, B, A, B, ...) and summarised by their median.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved_samples(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each call of each function, calls interleaved round-robin: sample r of every function is round r."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved round-robin."""
    samples = interleaved_samples(fns, repeats, warmup)
    return {name: statistics.median(times) for name, times in samples.items()}


def once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
