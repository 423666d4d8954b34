"""generate's prefill against the same model compiled with backend="laplace", side by side.

    python -m benchmarks.bench_generate [--batch 8] [--length 1024] [--repeats 5] [--json]
    python -m benchmarks.bench_generate --batch 2 --length 100 --repeats 1     # a smoke run

Three ways of running the forward over a prompt of `--batch` x `--length`
tokens of `tiny`, interleaved in every repeat:

- default:  ``model.generate(prompt, 1)``: the default prefill,
  `model.compiled_prefill` (chunked GLA over 256-token segments through one
  static graph, the rest padded to a bucket of 128 or 256 tokens through
  that bucket's static graph, the padding masked; see `model_zoo.prefill`),
  plus choosing the one new token;
- eager:    ``model.generate(prompt, 1, prefill="eager")``: the model's forward,
  the reference op (the token recurrence) per layer;
- compiled: ``laplace_passes.compile(model, target="cpu", inner="inductor")``
  called on the prompt: the model's forward compiled for this one shape
  (chunked GLA unrolled over the chunks), the reference a prefill aims at.

Printed: each one's wall time (median [min-max] over repeats), and per
repeat the ratios default / compiled and eager / compiled; the graphs the
default prefill compiled after warm-ups at three lengths (`--length`,
7 and 100 tokens shorter): at most two for a batch, the 256 bucket's (the
segment's) and the 128 bucket's, whatever the lengths; the machine's copy bandwidth and dense fp32
matmul rate measured in the same run; the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import laplace_passes
import model_zoo
from benchmarks.bench_decode import copy_bytes_per_s, matmul_flops_per_s
from benchmarks.common import machine_lines, once, say, spread, stats

FORMS = ("default", "eager", "compiled")


def runners(model, batch: int, length: int, inner: str = "inductor", forms=FORMS) -> dict:
    """The calls of each form in `forms`, each compiled and called once; the default prefill also at two shorter
    lengths. `inner` is the compiled forward's inner compiler (the default prefill's is the model's own)."""
    prompt = torch.randint(1, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    every = {
        "default": lambda: model.generate(prompt, 1),
        "eager": lambda: model.generate(prompt, 1, prefill="eager"),
    }
    if "compiled" in forms:
        compiled = laplace_passes.compile(model, target="cpu", inner=inner)
        every["compiled"] = lambda: compiled(prompt)
    chosen = {form: every[form] for form in forms}
    with torch.no_grad():
        for form, run in chosen.items():  # compiles, and a first call of each
            say(f"prefill: first call of {form} (a compile for default and compiled) ...")
            say(f"  {once(run):.1f} s")
        if "default" in forms:
            for shorter in (7, 100):  # two more lengths: no compile when they fall in the same buckets
                model.generate(prompt[:, : max(1, length - shorter)], 1)
    return chosen


def measure(model, batch: int, length: int, repeats: int, inner: str = "inductor", forms=FORMS) -> dict:
    """Seconds of each form in `forms` (with "compiled"), interleaved with the machine's copy and matmul, and
    each form's ratio to the compiled forward per repeat."""
    chosen = runners(model, batch, length, inner, forms)
    seconds = {form: [] for form in chosen}
    bandwidths, rates = [], []
    with torch.no_grad():
        for _ in range(repeats):
            bandwidths.append(copy_bytes_per_s())
            rates.append(matmul_flops_per_s())
            for form, run in chosen.items():
                start = time.perf_counter()
                run()
                seconds[form].append(time.perf_counter() - start)
    ratios = {f"{form}_over_compiled": [a / c for a, c in zip(seconds[form], seconds["compiled"])]
              for form in chosen if form != "compiled"}
    return {
        "seconds": {form: stats(s) for form, s in seconds.items()},
        "ratios": {name: stats(r) for name, r in ratios.items()},
        "default_prefill_graphs_compiled": model.compiled_prefill.graphs_compiled(),
        "copy_GB_per_s": stats([b / 1e9 for b in bandwidths]),
        "matmul_GFLOP_per_s": stats([r / 1e9 for r in rates]),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="sequences in the prompt batch")
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens per sequence")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats of every measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = model_zoo.build("tiny").eval()
    load_before = os.getloadavg()
    results = measure(model, args.batch, args.length, args.repeats)
    results.update(load_average_before=load_before, load_average_after=os.getloadavg(),
                   threads=torch.get_num_threads(), batch=args.batch, length=args.length, repeats=args.repeats)
    print(json.dumps(results, indent=2) if args.json else _text(results))
    return results


def _text(results: dict) -> str:
    lines = [
        f"generate's prefill, tiny, {results['batch']} x {results['length']} tokens (CPU, {results['threads']} "
        f"threads, median [min-max] of {results['repeats']} interleaved repeats)",
        *machine_lines(results["load_average_before"], results["load_average_after"], results["copy_GB_per_s"],
                       results["matmul_GFLOP_per_s"]),
    ]
    for form in FORMS:
        lines.append(f"  {form:<8} {spread(results['seconds'][form], '.4f')} s")
    ratios = results["ratios"]
    lines += [
        f"  generate default prefill vs compiled model forward: {spread(ratios['default_over_compiled'], '.2f')}x",
        f"  generate eager prefill vs compiled model forward:   {spread(ratios['eager_over_compiled'], '.2f')}x",
        f"  graphs the default prefill compiled for three prompt lengths: {results['default_prefill_graphs_compiled']}",
    ]
    return "\n".join(lines)



if __name__ == "__main__":
    main()
