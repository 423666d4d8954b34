"""GLA chunk-loop bodies compiled once for every layer, against each layer's body inlined: compile and run time.

    python -m benchmarks.bench_loop_bodies                  # tiny at T = 2048: 2 first calls each, 25 steps
    python -m benchmarks.bench_loop_bodies --first-calls 1 --repeats 11

NOTE [chunk-loop bodies compiled once] (laplace_passes/unroll/compiled_bodies.py):
with inner inductor on the cpu target, GLA sites sharing a signature call
one body Inductor compiles once (the option share_loop_bodies, default
True), instead of each site's body inlined in its graph (False). Three
figures, each comparing the two side by side:

  * the first call of `tiny`'s training step (`benchmarks.bench_compile`),
    each in a fresh process with an empty Inductor cache, alternating
    compiled and inlined (`--first-calls` times each);
  * a step afterwards, both compiled in this process and timed in
    interleaved rounds: the median of the per-round ratios;
  * two GLA sites of `benchmarks.bench_gla`'s shape in one graph (wide
    heads, where GLA is most of the time), forward and backward: what a
    compiled body costs a step against inlined ones.
"""

from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from benchmarks import bench_compile, bench_gla
from benchmarks.common import interleaved_samples, print_row, say

MODES = ("compiled once", "inlined")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--first-calls", type=int, default=2, help="fresh-process first calls per mode")
    parser.add_argument("--repeats", type=int, default=25, help="interleaved rounds of the steady-state timings")
    args = parser.parse_args(argv)
    print_row(f"tiny's training step at T = {args.seq_len}, target cpu, inner inductor: GLA bodies compiled once "
              f"for every layer against inlined per layer")
    results = {"first_call_s": first_calls(args.seq_len, args.first_calls)}
    for mode in MODES:
        seconds = results["first_call_s"][mode]
        print_row(f"  first call, {mode:<13} {statistics.median(seconds):6.1f} s  (each: "
                  f"{', '.join(f'{s:.1f}' for s in seconds)})")
    results["step_ratio"] = ratio(*step_pair(args.seq_len), args.repeats)
    print_row(f"  a step afterwards, compiled once / inlined: {results['step_ratio']:.3f}x (median per-round ratio)")
    results["two_sites_ratio"] = ratio(*two_sites_pair(), args.repeats)
    print_row(f"  two GLA sites in one graph (B=1, T=2048, H=4, K=128, V=256, chunk 128), forward + backward, "
              f"compiled once / inlined: {results['two_sites_ratio']:.3f}x")
    return results


def first_calls(seq_len: int, rounds: int) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            options = SimpleNamespace(seq_len=seq_len, inner="inductor", compile_threads=None,
                                      inline_loop_bodies=mode == "inlined")
            seconds[mode].append(bench_compile.in_fresh_process("cpu", options)["total_s"])
    return seconds


def _compiled_as(mode: str, compile_fn):
    """`compile_fn(share_loop_bodies)`'s result for `mode`, called once (its first call compiles)."""
    fn = compile_fn(mode == MODES[0])
    fn()
    return fn


def step_pair(seq_len: int):
    import laplace_passes
    import model_zoo

    torch.manual_seed(0)
    model = model_zoo.build("tiny")
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len))

    def step_of(share_loop_bodies: bool):
        compiled = laplace_passes.compile(lambda ids: F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()),
                                          target="cpu", inner="inductor", share_loop_bodies=share_loop_bodies)

        def step():
            for p in model.parameters():
                p.grad = None
            compiled(ids).backward()

        return step

    return tuple(_compiled_as(mode, step_of) for mode in MODES)


def two_sites_pair():
    """Two GLA sites of `bench_gla`'s shape in one graph (q and k swapped in the second): forward and backward."""
    import laplace_passes

    inputs = bench_gla.make_inputs(1, 2048, 4, 128, 256)

    def two_sites(q, k, v, gk):
        return (laplace_passes.gla(q, k, v, gk)[0] + laplace_passes.gla(k, q, v, gk)[0],)

    def run_of(share_loop_bodies: bool):
        compiled = laplace_passes.compile(two_sites, target="cpu", chunk_size=128, inner="inductor",
                                          share_loop_bodies=share_loop_bodies)
        return bench_gla.forward_backward(compiled, inputs)

    return tuple(_compiled_as(mode, run_of) for mode in MODES)


def ratio(compiled_once, inlined, repeats: int) -> float:
    say("timing both, interleaved ...")
    samples = interleaved_samples({"compiled once": compiled_once, "inlined": inlined}, repeats=repeats, warmup=1)
    return statistics.median(a / b for a, b in zip(samples["compiled once"], samples["inlined"]))


if __name__ == "__main__":
    main()
