"""A second compile of the same shapes in one process: GLA body traces reused across fake modes, or traced again.

    python -m benchmarks.bench_recompile                    # tiny, T = 2048, trn2 and cpu, inner eager
    python -m benchmarks.bench_recompile --targets trn2 --repeats 5 --json

`tiny`'s training step (`cross_entropy(model(ids), ids)`, then `.backward()`)
compiled with `laplace_passes.compile` after `torch._dynamo.reset()`, so
every compile has a new fake mode, as a model compiled again in one process
does (a second `compile`, `inspect` or `preflight` before it, eval then
train mode). Timed: the first forward and backward of each compile, with the
chunk-loop bodies' traces of the earlier compile reused (the default, NOTE
[traces reused across fake modes] in `laplace_passes/unroll/chunk_loops.py`)
and with them traced again, in interleaved rounds after one compile that
makes the traces. Printed per target: both medians and their ratio. Inner
eager by default: Inductor's compile, the same either way, would add
seconds of noise to both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F

import laplace_passes
import model_zoo
from benchmarks.common import interleaved_samples, print_row
from laplace_passes.unroll import chunk_loops


@contextlib.contextmanager
def traces_made_again():
    """Every body traced afresh, as before traces were reused across fake modes."""
    kept = chunk_loops._ACROSS_MODES.get
    chunk_loops._ACROSS_MODES.get = lambda key, inputs: None
    try:
        yield
    finally:
        chunk_loops._ACROSS_MODES.get = kept


def compile_and_step(model, ids, target: str, inner: str, reuse: bool):
    def call():
        torch._dynamo.reset()  # a new fake mode
        with contextlib.nullcontext() if reuse else traces_made_again():
            compiled = laplace_passes.compile(model, target=target, inner=inner)
            logits = compiled(ids)
            F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()

    return call


def measure(target: str, seq_len: int, inner: str, repeats: int) -> dict:
    torch.manual_seed(0)
    model = model_zoo.build("tiny")
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
    calls = {f"{target} reused": compile_and_step(model, ids, target, inner, reuse=True),
             f"{target} traced again": compile_and_step(model, ids, target, inner, reuse=False)}
    samples = interleaved_samples(calls, repeats)
    reused, again = (statistics.median(s) for s in samples.values())
    return {"target": target, "reused_s": reused, "traced_again_s": again, "ratio": reused / again}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--targets", nargs="+", default=["trn2", "cpu"])
    parser.add_argument("--inner", default="eager")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = []
    for target in args.targets:
        r = measure(target, args.seq_len, args.inner, args.repeats)
        results.append(r)
        if not args.json:
            print_row(f"{target:5s} T={args.seq_len} inner {args.inner}: second compile + step {r['reused_s']:.2f} s "
                      f"with traces reused, {r['traced_again_s']:.2f} s traced again ({r['ratio']:.2f}x)")
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_row(f"({time.perf_counter() - start:.0f} s, medians of {args.repeats} interleaved rounds)")
    return results


if __name__ == "__main__":
    main()
