"""transformers' Mamba-2 chunked scan, forward + backward: as written, and found whole as one GLA site.

    python -m benchmarks.bench_mamba2                 # B=1, T=2048, H=8, P=64, N=64, its chunk 256, fp32
    python -m benchmarks.bench_mamba2 --paths eager laplace --T 256 --repeats 3

`mamba2_chunk_scan` (Mamba2ForCausalLM, Bamba, Zamba2, FalconH1, NemotronH,
GraniteMoeHybrid on a machine without mamba_ssm's kernels) computes all its
chunks at once; the laplace backend reads it as GLA over all the tokens
(NOTE [a chunked form without a loop] in laplace_passes/fx/chunked_quadratic.py)
and re-tiles it at the target's chunk. Paths, timed in interleaved rounds
(medians, and each one's speed-up over the function run eagerly):
  * eager: the function as transformers wrote it;
  * inductor: `torch.compile(fn)`, the same ops fused by Inductor;
  * laplace: `laplace_passes.compile(fn, target="cpu")`, the GLA site with the eager inner compiler;
  * laplace_inductor: the same with `inner="inductor"`.
The report's row for the site is printed first, so a run that did not find it says so.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import laplace_passes
from benchmarks.common import interleaved_samples, print_row, say

PATHS = ("eager", "inductor", "laplace", "laplace_inductor")


def make_inputs(B: int, T: int, H: int, P: int, N: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, P, generator=gen)
    dt = torch.randn(B, T, H, generator=gen)
    A = -torch.rand(H, generator=gen) - 0.1  # Mamba-2's A = -exp(A_log)
    b, c = (torch.randn(B, T, 1, N, generator=gen) for _ in range(2))
    return tuple(t.requires_grad_() for t in (x, dt, A, b, c))


def chunk_scan(chunk: int):
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    def scan(x, dt, A, b, c):
        return mamba2_chunk_scan(x, dt, A, b, c, chunk, dt_softplus=True)
    return scan


def compiled(path: str, fn):
    if path == "eager":
        return fn
    if path == "inductor":
        return torch.compile(fn)
    return laplace_passes.compile(fn, target="cpu", inner="inductor" if path == "laplace_inductor" else "eager")


def forward_backward(fn, inputs):
    def run():
        torch.autograd.grad(fn(*inputs).sum(), inputs)
    return run


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("B", 1), ("T", 2048), ("H", 8), ("P", 64), ("N", 64), ("chunk", 256), ("repeats", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    args = parser.parse_args(argv)
    if "eager" not in args.paths:
        parser.error("--paths must include eager: every speed-up is over it")
    inputs = make_inputs(args.B, args.T, args.H, args.P, args.N)
    scan = chunk_scan(args.chunk)
    runs = {}
    for path in args.paths:
        model = compiled(path, scan)
        runs[path] = forward_backward(model, inputs)
        if path.startswith("laplace"):
            runs[path]()  # the first call compiles and fills the report
            rows = [f"{r.status}: {r.form or r.reason}" for r in model.laplace_report.recurrences]
            say(f"{path}: " + ("; ".join(rows) or "no recurrence found"))
    samples = interleaved_samples(runs, repeats=args.repeats)
    medians = {path: statistics.median(times) for path, times in samples.items()}
    print_row(f"Mamba-2 chunk scan fwd+bwd B={args.B} T={args.T} H={args.H} P={args.P} N={args.N}, "
              f"its chunk {args.chunk} (median of {args.repeats} interleaved rounds)")
    for path, seconds in medians.items():
        print_row(f"  {path:<17} {seconds * 1e3:8.1f} ms  {medians['eager'] / seconds:5.2f}x eager")
    return {"ms": {path: seconds * 1e3 for path, seconds in medians.items()}}


if __name__ == "__main__":
    main()
