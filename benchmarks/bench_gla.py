"""Chunked GLA against the token recurrence, and against this machine's matmul rate.

    python -m benchmarks.bench_gla            # B=1, T=2048, H=4, K=128, V=256, fp32
    python -m benchmarks.bench_gla --json

Forward plus backward. Reports:
  * speed-up of chunked_gla over the token-by-token recurrence (the
    `laplace::gla` reference op) and over fla's naive_recurrent_gla when
    installed;
  * achieved GFLOP/s of chunked_gla by DESIGN.md's formula (forward
    2TC(K+V) + 4TKV, backward with recomputation 4TC(K+V) + 10TKV, per batch
    and head) as a fraction of a dense fp32 matmul measured in the same run.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.common import interleaved_medians, once
from laplace_passes import chunked_gla, gla


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


def matmul_gflops(n: int, repeats: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds = interleaved_medians({"mm": lambda: a @ b}, repeats=repeats)["mm"]
    return 2 * n**3 / seconds / 1e9


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--V", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    inputs = make_inputs(args.B, args.T, args.H, args.K, args.V)
    chunked = forward_backward(chunked_gla, inputs, chunk_size=args.chunk_size)
    timed = interleaved_medians(
        {"chunked": chunked, "matmul_probe": lambda: matmul_gflops(1024, 1)}, repeats=args.repeats
    )
    mm_rate = matmul_gflops(2048, args.repeats)
    results = {
        "shape": {k: getattr(args, k) for k in ("B", "T", "H", "K", "V")},
        "chunk_size": args.chunk_size,
        "threads": torch.get_num_threads(),
        "chunked_s": timed["chunked"],
        "recurrence_s": once(forward_backward(gla, inputs)),
    }
    try:
        from fla.ops.gla.naive import naive_recurrent_gla
    except ImportError:
        results["fla_naive_s"] = None
    else:
        results["fla_naive_s"] = once(forward_backward(naive_recurrent_gla, inputs))
    flops = gla_flops(args.B, args.T, args.H, args.K, args.V, args.chunk_size)
    results["chunked_gflops"] = flops / results["chunked_s"] / 1e9
    results["matmul_gflops"] = mm_rate
    results["speedup_vs_recurrence"] = results["recurrence_s"] / results["chunked_s"]
    if results["fla_naive_s"] is not None:
        results["speedup_vs_fla_naive"] = results["fla_naive_s"] / results["chunked_s"]
    results["fraction_of_matmul"] = results["chunked_gflops"] / mm_rate
    print(json.dumps(results, indent=2) if args.json else _text(results))
    return results


def _text(r: dict) -> str:
    lines = [
        f"GLA forward+backward {r['shape']} fp32, chunk {r['chunk_size']}, {r['threads']} threads",
        f"  chunked_gla             {r['chunked_s'] * 1e3:9.1f} ms   {r['chunked_gflops']:7.1f} GFLOP/s",
        f"  token recurrence        {r['recurrence_s'] * 1e3:9.1f} ms   x{r['speedup_vs_recurrence']:.1f} slower",
    ]
    if r["fla_naive_s"] is not None:
        lines.append(f"  fla naive_recurrent_gla {r['fla_naive_s'] * 1e3:9.1f} ms   x{r['speedup_vs_fla_naive']:.1f} slower")
    lines.append(f"  dense fp32 matmul                   {r['matmul_gflops']:7.1f} GFLOP/s")
    lines.append(f"  chunked / matmul rate   {r['fraction_of_matmul']:.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
