"""Chunked GLA against the token recurrence, and against this machine's matmul rate.

    python -m benchmarks.bench_gla            # B=1, T=2048, H=4, K=128, V=256, fp32
    python -m benchmarks.bench_gla --json
    python -m benchmarks.bench_gla --recompute-residuals   # and the backward that recomputes, side by side

Forward plus backward. Two chunked versions are measured: `chunked_gla`
run eagerly, and `laplace_passes.gla` compiled with backend="laplace" and
inner="inductor" (the re-tiled graph, fused by Inductor; `--no-compiled`
skips its ~1 minute compile). Both keep the forward's residuals for the
backward, as the cpu target does (`save_residuals`); `--recompute-residuals`
adds both again with a backward that recomputes them, as the Neuron targets'
does, timed in the same rounds, and prints how much faster keeping them is.
Reports:
  * speed-up of each over the token-by-token recurrence (the `laplace::gla`
    reference op) and over fla's naive_recurrent_gla when installed;
  * achieved GFLOP/s by the formula of docs/DESIGN.md section 3.5 (forward
    2TC(K+V) + 4TKV, backward with recomputation 4TC(K+V) + 10TKV, per batch
    and head) as a fraction of a dense fp32 matmul measured in the same run:
    the median over the repeats, and its spread (the fraction of each
    round, min to max; the calls of a round run back to back, so a change in
    the machine's load hits every path alike); the load average is printed
    beside them;
  * the compiled call's matmuls alone (found by profiling one call, run
    again at the same shapes in the same rounds, `benchmarks.matmuls_alone`):
    the same FLOPs over their time, the share the call would reach if
    everything else it does cost nothing, and their share of its time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

from benchmarks.common import KEEP_FREED_HELP, allocator_setting, interleaved_samples, once, say
from benchmarks.matmuls_alone import MatmulsAlone
import laplace_passes
from laplace_passes import chunked_gla, gla
from laplace_passes.infra.targets import CPU

# The dense fp32 matmul every rate is compared with, timed in the same rounds.
MATMUL_SIZE = 2048
MATMUL_FLOPS = 2 * MATMUL_SIZE**3


def gla_flops(B: int, T: int, H: int, K: int, V: int, C: int) -> float:
    forward = 2 * T * C * (K + V) + 4 * T * K * V
    backward = 4 * T * C * (K + V) + 10 * T * K * V
    return float(B * H * (forward + backward))


def make_inputs(B, T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen).requires_grad_()
    gk = F.logsigmoid(torch.randn(B, T, H, K, generator=gen)).requires_grad_()
    return q, k, v, gk


def forward_backward(fn, inputs, **kwargs):
    def run():
        o = fn(*inputs, **kwargs)[0]
        torch.autograd.grad(o.sum(), inputs)

    return run


def compiled_gla(chunk_size: int, save_residuals: bool = True, inner: str = "inductor"):
    def call_gla(q, k, v, gk):
        return gla(q, k, v, gk)

    target = CPU.with_overrides(save_residuals=save_residuals)
    return laplace_passes.compile(call_gla, target=target, chunk_size=chunk_size, inner=inner)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--V", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compiled", action="store_true", help="skip the inductor-compiled version")
    parser.add_argument("--recompute-residuals", action="store_true",
                        help="also time each version with a backward that recomputes the chunk states and tril(A)")
    parser.add_argument("--keep-freed-memory", action="store_true", help=KEEP_FREED_HELP)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    allocator = allocator_setting(args.keep_freed_memory)
    results = measure({k: getattr(args, k) for k in ("B", "T", "H", "K", "V")}, args.chunk_size, args.repeats,
                      compiled=not args.no_compiled, recompute_residuals=args.recompute_residuals)
    results["allocator"] = allocator
    print(json.dumps(results, indent=2) if args.json else _text(results))
    return results


def measure(shape: dict, chunk_size: int, repeats: int, *, compiled: bool = True, recompute_residuals: bool = False,
            baselines: bool = True, inner: str = "inductor") -> dict:
    """Forward + backward of each path at `shape` (B, T, H, K, V), interleaved with a dense matmul; `baselines`:
    also the token recurrence and fla's naive_recurrent_gla, once each (seconds at T = 2048)."""
    inputs = make_inputs(*(shape[k] for k in ("B", "T", "H", "K", "V")))
    a, b = torch.randn(MATMUL_SIZE, MATMUL_SIZE), torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    candidates = {
        "chunked": forward_backward(chunked_gla, inputs, chunk_size=chunk_size),
        "matmul": lambda: a @ b,
    }
    if recompute_residuals:
        candidates["chunked_recomputing"] = forward_backward(
            chunked_gla, inputs, chunk_size=chunk_size, save_residuals=False)
    if compiled:
        candidates["compiled"] = forward_backward(compiled_gla(chunk_size, inner=inner), inputs)
        candidates["compiled"]()  # compiles, so that the profiled call below is a call like the timed ones
        matmuls_alone = MatmulsAlone.of(candidates["compiled"])
        candidates["compiled_matmuls"] = matmuls_alone
        if recompute_residuals:
            candidates["compiled_recomputing"] = forward_backward(compiled_gla(chunk_size, False, inner), inputs)
    load_before = os.getloadavg()[0]
    samples = interleaved_samples(candidates, repeats=repeats)
    timed = {name: statistics.median(times) for name, times in samples.items()}
    results = {
        "shape": dict(shape),
        "chunk_size": chunk_size,
        "threads": torch.get_num_threads(),
        "chunked_s": timed["chunked"],
        "compiled_s": timed.get("compiled"),
        "chunked_recomputing_s": timed.get("chunked_recomputing"),
        "compiled_recomputing_s": timed.get("compiled_recomputing"),
        "recurrence_s": (_timed_once("the token recurrence (laplace::gla)", forward_backward(gla, inputs))
                         if baselines else None),
        "matmul_gflops": MATMUL_FLOPS / timed["matmul"] / 1e9,
        "load_average": [load_before, os.getloadavg()[0]],
        "fla_naive_s": _fla_naive_seconds(inputs) if baselines else None,
    }
    flops = gla_flops(*(shape[k] for k in ("B", "T", "H", "K", "V")), chunk_size)
    for name in ("chunked", "compiled", "chunked_recomputing", "compiled_recomputing"):
        seconds = results[f"{name}_s"]
        if seconds is None:
            continue
        results[f"{name}_gflops"] = flops / seconds / 1e9
        results[f"{name}_fraction_of_matmul"] = results[f"{name}_gflops"] / results["matmul_gflops"]
        # Round by round: this path's rate over the matmul's, both timed in that round.
        results[f"{name}_fraction_per_round"] = [
            (flops / t) / (MATMUL_FLOPS / m) for t, m in zip(samples[name], samples["matmul"])
        ]
        if results["recurrence_s"] is not None:
            results[f"{name}_speedup_vs_recurrence"] = results["recurrence_s"] / seconds
        if results["fla_naive_s"] is not None:
            results[f"{name}_speedup_vs_fla_naive"] = results["fla_naive_s"] / seconds
    if compiled:
        results.update(_ceiling(samples, flops, matmuls_alone))
    for name in ("chunked", "compiled"):
        if results[f"{name}_recomputing_s"] is not None:
            # Per round, then the median: both were timed back to back in each round.
            ratios = [r / k for r, k in zip(samples[f"{name}_recomputing"], samples[name])]
            results[f"{name}_keeping_residuals_speedup_per_round"] = ratios
            results[f"{name}_keeping_residuals_speedup"] = statistics.median(ratios)
    return results


def _ceiling(samples: dict, flops: float, matmuls: MatmulsAlone) -> dict:
    """The compiled call's matmuls alone, timed in the same rounds: the share of the dense rate the call would
    reach if everything but its matmuls cost nothing (`benchmarks.matmuls_alone`), round by round."""
    return {
        "compiled_matmuls_s": statistics.median(samples["compiled_matmuls"]),
        "compiled_matmuls_count": len(matmuls),
        "compiled_matmuls_share_of_call": statistics.median(
            [m / c for m, c in zip(samples["compiled_matmuls"], samples["compiled"])]),
        "compiled_matmuls_fraction_per_round": [
            (flops / t) / (MATMUL_FLOPS / m) for t, m in zip(samples["compiled_matmuls"], samples["matmul"])
        ],
    }


def _fla_naive_seconds(inputs) -> float | None:
    try:
        from fla.ops.gla.naive import naive_recurrent_gla
    except ImportError:
        return None
    return _timed_once("fla's naive_recurrent_gla", forward_backward(naive_recurrent_gla, inputs))


def _timed_once(what: str, fn) -> float:
    say(f"timing {what} once ...")
    seconds = once(fn)
    say(f"  {seconds:.1f} s")
    return seconds


def _text(r: dict) -> str:
    lines = [f"GLA forward+backward {r['shape']} fp32, chunk {r['chunk_size']}, {r['threads']} threads"]
    rows = (("chunked", "chunked_gla (eager)"), ("chunked_recomputing", "  recomputing residuals"),
            ("compiled", "laplace + inductor"), ("compiled_recomputing", "  recomputing residuals"))
    for name, label in rows:
        if r[f"{name}_s"] is None:
            continue
        lines.append(
            f"  {label:<24}{r[f'{name}_s'] * 1e3:9.1f} ms  {r[f'{name}_gflops']:7.1f} GFLOP/s "
            f"= {r[f'{name}_fraction_of_matmul']:.1%} of matmul (rounds {min(r[f'{name}_fraction_per_round']):.1%}"
            f"-{max(r[f'{name}_fraction_per_round']):.1%}); x{r[f'{name}_speedup_vs_recurrence']:.1f} "
            "faster than the recurrence"
            + (f", x{r[f'{name}_speedup_vs_fla_naive']:.1f} than fla naive" if r["fla_naive_s"] else "")
        )
    if r.get("compiled_matmuls_s") is not None:
        ceiling = r["compiled_matmuls_fraction_per_round"]
        lines.append(
            f"  {'  its matmuls alone':<24}{r['compiled_matmuls_s'] * 1e3:9.1f} ms  = "
            f"{statistics.median(ceiling):.1%} of matmul (rounds {min(ceiling):.1%}-{max(ceiling):.1%}): "
            f"the ceiling if the rest cost nothing; {r['compiled_matmuls_count']} products, "
            f"{r['compiled_matmuls_share_of_call']:.0%} of the call's time")
    for name, label in (("chunked", "eager"), ("compiled", "laplace + inductor")):
        if f"{name}_keeping_residuals_speedup" in r:
            per_round = r[f"{name}_keeping_residuals_speedup_per_round"]
            lines.append(f"  {label}: keeping the residuals x{r[f'{name}_keeping_residuals_speedup']:.2f} faster "
                         f"than recomputing them (median of rounds; rounds x{min(per_round):.2f}-x{max(per_round):.2f})")
    lines.append(f"  {'token recurrence':<24}{r['recurrence_s'] * 1e3:9.1f} ms")
    if r["fla_naive_s"] is not None:
        lines.append(f"  {'fla naive_recurrent_gla':<24}{r['fla_naive_s'] * 1e3:9.1f} ms")
    lines.append(f"  {'dense fp32 matmul':<24}{'':9} {r['matmul_gflops']:7.1f} GFLOP/s ({MATMUL_SIZE} x {MATMUL_SIZE}, same run)")
    lines.append(f"  load average {r['load_average'][0]:.2f} before, {r['load_average'][1]:.2f} after the timed rounds")
    if "allocator" in r:
        lines.append(f"  allocator: {r['allocator']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
