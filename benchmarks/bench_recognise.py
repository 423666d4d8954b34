"""GLA written in plain PyTorch against the same GLA through `laplace_passes.gla`, side by side in one run.

    python -m benchmarks.bench_recognise                     # T = 512; every part
    python -m benchmarks.bench_recognise --part run --repeats 7
    python -m benchmarks.bench_recognise --no-baseline       # skip the loop compiled without recognition (minutes)
    python -m benchmarks.bench_recognise --part compile --inner inductor

Four parts, each row printed as soon as it is measured:

* compile: the token loop of tests/recognise_cases.py (`elementwise`, B = 1,
  H = 4, K = V = 32) at T steps through backend="laplace" (trn2, inner
  eager): the first call, forward and backward, with recognition (the
  default), without it (`recognise_gla=False`: every step traced into the
  ATen graphs, as before the pass existed), and the same layer written with
  `laplace_passes.gla` (`--inner inductor`: the same through Inductor, whose
  compile of the unrecognised loop's T-step graphs takes far longer).
  Printed: seconds, the ATen forward and backward node counts AOT Autograd
  made (before the chunk loops are unrolled), and the ratios.
* run: each spelling of tests/recognise_cases.py that computes per-key GLA
  (broadcasting, einsum in [B, H, T, K], matmul, scan, while_loop, a
  preallocated output) compiled once (cpu target, inner eager), then forward
  plus backward timed, interleaved with the `laplace_passes.gla` spelling of
  the same layer (its layout, its initial state); the median ratio of each
  to it (1.0 = as fast).
* gates: gates one per head, as a recognised loop hands them to GLA (a
  stride-0 view over the keys), against the same copied per key and against
  gates per key: what the op's per-key decays cost a per-head model.
* saved: bytes autograd keeps for the backward of the quadratic form eagerly
  (its T x T scores and decays), recognised, and of `laplace_passes.gla`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import laplace_passes
from benchmarks.common import interleaved_samples
from tests import recognise_cases as cases

SPELLINGS = ("elementwise", "einsum_bhtk", "matmul_cat", "scanned", "while_looped", "preallocated")


def set_shape(T: int, B: int = 1, H: int = 4, K: int = 32, V: int = 32) -> None:
    """The cases read their sizes from their module: set them for this run."""
    cases.B, cases.T, cases.H, cases.K, cases.V = B, T, H, K, V


def op_spelling(q, k, v, g):
    """The same layer through `laplace_passes.gla` ([B, T, H, K], no scale, zero initial state)."""
    o, state = laplace_passes.gla(q, k, v, g, scale=1.0, output_final_state=True)
    return o, state


def op_spelling_h0(q, k, v, g):
    """`preallocated`'s layer: an initial state of 0.1 everywhere, outputs only."""
    h0 = torch.full((cases.B, cases.H, cases.K, cases.V), 0.1)
    return laplace_passes.gla(q, k, v, g, scale=1.0, initial_state=h0)[0]


def op_spelling_bhtk(q, k, v, g):
    o = laplace_passes.gla(*(x.transpose(1, 2) for x in (q, k, v, g)), scale=cases.K ** -0.5)[0]
    return o.transpose(1, 2)


def loss_of(out) -> torch.Tensor:
    out = out if isinstance(out, tuple) else (out,)
    return sum(o.float().square().mean() for o in out)


def inputs_for(name: str):
    return [x.requires_grad_() for x in cases.inputs("bhtk" if name == "einsum_bhtk" else "bthk")]


def first_call(fn, name: str, inner: str, **options) -> tuple[float, int, int]:
    """Seconds of the first forward and backward through the laplace backend; ATen forward, backward nodes."""
    torch._dynamo.reset()
    compiled = laplace_passes.compile(fn, target="trn2", inner=inner, **options)
    args = inputs_for(name)
    start = time.perf_counter()
    loss_of(compiled(*args)).backward()
    seconds = time.perf_counter() - start
    nodes = {g.kind: len(g.before.graph.nodes) for g in compiled.laplace_report.graphs}
    return seconds, nodes.get("forward", 0), nodes.get("backward", 0)


def compile_part(T: int, baseline: bool, inner: str) -> None:
    print(f"compile: first forward + backward at T = {T} (trn2, inner {inner}), ATen nodes before unrolling")
    rows = [("laplace_passes.gla", op_spelling, {}), ("token loop, recognised", cases.elementwise, {})]
    if baseline:
        rows.append(("token loop, recognise_gla=False", cases.elementwise, {"recognise_gla": False}))
    results = {}
    for label, fn, options in rows:
        seconds, forward, backward = first_call(fn, "elementwise", inner, **options)
        results[label] = seconds
        print(f"  {label:34s} {seconds:8.1f} s   forward {forward:6,} nodes   backward {backward:6,} nodes", flush=True)
    op, loop = results["laplace_passes.gla"], results["token loop, recognised"]
    print(f"  recognised loop / op spelling: {loop / op:.2f}x the op's first call")
    if baseline:
        print(f"  without recognition / recognised: {results['token loop, recognise_gla=False'] / loop:.1f}x "
              "longer first call")


def run_part(repeats: int) -> None:
    print(f"run: forward + backward, compiled (cpu, inner eager), median of {repeats} interleaved rounds")
    calls = {}
    for name in ("op", "op_bhtk", "op_h0", *SPELLINGS):
        fn = {"op": op_spelling, "op_bhtk": op_spelling_bhtk, "op_h0": op_spelling_h0}.get(name) or getattr(cases, name)
        torch._dynamo.reset()
        compiled = laplace_passes.compile(fn, target="cpu")
        args = inputs_for("einsum_bhtk" if name == "op_bhtk" else name)
        loss_of(compiled(*args)).backward()  # compiles
        calls[name] = (lambda c=compiled, a=args: loss_of(c(*a)).backward())
    samples = interleaved_samples(calls, repeats)
    for name in SPELLINGS:
        reference = {"einsum_bhtk": "op_bhtk", "preallocated": "op_h0"}.get(name, "op")
        ratios = [s / r for s, r in zip(samples[name], samples[reference])]
        print(f"  {name:14s} {statistics.median(samples[name]) * 1e3:8.1f} ms   "
              f"{statistics.median(ratios):.2f}x the gla op ({min(ratios):.2f}-{max(ratios):.2f})", flush=True)


def gates_part(repeats: int) -> None:
    """Per-head gates as GLA receives them from a recognised loop (a stride-0 view over the keys) against
    the same gates copied per key and against gates per key: the cost of computing decays per key."""
    print(f"gates: GLA forward + backward (cpu, inner eager), median of {repeats} interleaved rounds")
    gen = torch.Generator().manual_seed(1)
    B, T, H, K, V = cases.B, cases.T, cases.H, cases.K, cases.V
    q, k, v = (torch.randn(B, T, H, D, generator=gen).requires_grad_() for D in (K, K, V))
    per_head = torch.nn.functional.logsigmoid(torch.randn(B, T, H, 1, generator=gen)).requires_grad_()
    per_key = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, generator=gen)).requires_grad_()
    forms = {"per-head, view over keys": lambda: per_head.expand(B, T, H, K),
             "per-head, copied per key": lambda: per_head.expand(B, T, H, K).contiguous(),
             "per-key": lambda: per_key}
    calls = {}
    for name, gates in forms.items():
        torch._dynamo.reset()
        step = laplace_passes.compile(lambda q, k, v, g: laplace_passes.gla(q, k, v, g)[0], target="cpu")
        loss_of(step(q, k, v, gates())).backward()
        calls[name] = (lambda f=step, g=gates: loss_of(f(q, k, v, g())).backward())
    samples = interleaved_samples(calls, repeats)
    base = samples["per-key"]
    for name in forms:
        ratios = [a / b for a, b in zip(samples[name], base)]
        print(f"  {name:26s} {statistics.median(samples[name]) * 1e3:8.1f} ms   {statistics.median(ratios):.2f}x "
              "per-key gates", flush=True)


def saved_bytes(fn, args) -> int:
    """Bytes of the tensors autograd keeps for the backward while `fn(*args)` runs (each storage once)."""
    kept = {}

    def pack(t):
        if not isinstance(t, torch._subclasses.FakeTensor):  # a recompile inside the hooks traces with fakes
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(kept.values())


def saved_part() -> None:
    """The quadratic form keeps T x T tensors for its backward; recognised, it keeps what the chunked op does."""
    print("saved for backward: the quadratic form (per-head gates) against laplace_passes.gla of the same layer")
    args = [x.requires_grad_() for x in cases.inputs("bthk", "head")]

    def op(q, k, v, g):
        return laplace_passes.gla(q * cases.K ** -0.5, k, v, g[..., None].expand(*g.shape, cases.K))[0]
    rows = {"quadratic form, eager": cases.quadratic_head_gates}
    for name, fn in (("quadratic form, recognised", cases.quadratic_head_gates), ("laplace_passes.gla", op)):
        torch._dynamo.reset()
        compiled = laplace_passes.compile(fn, target="cpu")
        compiled(*args)
        rows[name] = compiled
    for name, fn in rows.items():
        print(f"  {name:28s} {saved_bytes(fn, args) / 1e6:8.2f} MB", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, default=512)
    parser.add_argument("--part", choices=("compile", "run", "gates", "saved", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", default="eager", help="the compile part's inner compiler (eager, inductor)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the loop compiled without recognition (its first call takes minutes at T = 512)")
    args = parser.parse_args(argv)
    if args.T < 2 or args.repeats < 1:
        parser.error("--T must be at least 2 and --repeats at least 1")
    torch.manual_seed(0)
    set_shape(args.T)
    if args.part in ("compile", "all"):
        compile_part(args.T, baseline=not args.no_baseline, inner=args.inner)
    if args.part in ("run", "all"):
        run_part(args.repeats)
    if args.part in ("gates", "all"):
        gates_part(args.repeats)
    if args.part in ("saved", "all"):
        saved_part()


if __name__ == "__main__":
    main()
