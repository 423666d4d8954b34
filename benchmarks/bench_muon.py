"""Muon's communication: gathers against the paired all-to-alls of `laplace_passes.collectives`.

    python -m benchmarks.bench_muon                       # parts 1 and 2, one run
    python -m benchmarks.bench_muon --part traffic --models small
    python -m benchmarks.bench_muon --part plans          # branch-free vs balanced vs all-gather, W = 4, 8
    python -m benchmarks.bench_muon --part time --repeats 15 --threads 1
    python -m benchmarks.bench_muon --part ns --repeats 3 --profile   # Newton-Schulz-bound step

1. Per-rank bytes received, from graphs captured at each world size W (no
   data moves; a fake process group and meta tensors stand in for W ranks):
   - model_zoo "small" (and "tiny", `--models tiny`: the same in seconds):
     `ShardedMuon(backend=laplace)` steps once per W, for comm="all_gather"
     and comm="gather_broadcast"; the laplace report's traffic record gives
     the bytes of the captured graph before and after the rewrite.
   - model_zoo "laplace-3b" (shapes only): the same shard step traced with
     make_fx (Dynamo needs minutes for its 360 matrices) and rewritten with
     the public `rewrite_muon_step`; all-gather baseline.
   Muon matrices are the 2D parameters except the embedding, which goes to
   AdamW as is usual for Muon. Printed against the targets: received
   W/2 times less than all-gather, and within 5% of 2 (W-1) G / W^2.
2. Step time of `ShardedMuon.step()` on 4 gloo processes for the "small"
   model's parameters: laplace with muon_all_to_all off (baseline) and on,
   steps interleaved (off, on, off, on, ...) in one run, median per rank,
   the slowest rank's median reported; ratio = baseline / rewritten. Three
   cases: comm="all_gather" and "gather_broadcast" with the embedding on
   AdamW (the usual split), and "all_gather" with every 2D parameter on Muon
   (ShardedMuon's default grouping).
3. (`--part ns`) Step time where Newton-Schulz is the work: 8 matrices of
   512 x 512 and 4 of 1024 x 256 (`--shapes`), 4 gloo processes, one thread
   each, ShardedMuon with comm="all_gather" without the rewrite, with it, and
   comm="gather_broadcast", steps interleaved; per steady step the slowest
   rank's time; printed: medians with min and max, the ratio of medians and
   the median (min, max) of the per-round ratios, the load average.
   `--profile` adds one more step per run under torch.profiler and splits its
   self time into Newton-Schulz matmuls, copies, other math, collectives
   (waiting for peers included) and the rest (Python, dispatch).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
import torch.distributed as dist

import laplace_passes
import model_zoo
from benchmarks.common import self_time_by_part
from laplace_passes.driver.backend import laplace_backend
from laplace_passes.collectives import newton_schulz_flops, rewrite_muon_step
from model_zoo.muon import MuonHParams, RowSplit, ShardedMuon, adjust_lr, assign_owners, muon_shard_step

WORLD_SIZES = (2, 4, 8, 16, 32, 48, 64)
TIMED_WORLD_SIZE = 4
MUON_LR = 0.02


def muon_shapes(model_name: str) -> list[tuple[int, int]]:
    model = model_zoo.build(model_name, device="meta")
    return [tuple(p.shape) for name, p in model.named_parameters() if p.ndim == 2 and "embed" not in name]


def _laplace(report: laplace_passes.Report, **options):
    return functools.partial(laplace_backend, options={"target": "cpu", "report": report, **options})


def _outputs_only(gm: torch.fx.GraphModule, example_inputs) -> object:
    """Inner compiler that runs nothing: meta outputs of the right shapes (a cond cannot branch on meta)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = [n.meta["val"] for n in output.args[0]]
    return lambda *args: [torch.empty(v.shape, dtype=v.dtype, device="meta") for v in values]


# ---------------------------------------------------------------- part 1: traffic


def _fake_world(world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def traffic_through_backend(shapes, world_size: int, comm: str):
    """One ShardedMuon step on meta tensors over a fake group of `world_size`: the report's traffic."""
    _fake_world(world_size)
    torch._dynamo.reset()  # a new world size is a new graph; keep clear of the recompile limit
    report = laplace_passes.Report()
    params = [torch.empty(s, device="meta", requires_grad=True) for s in shapes]
    opt = ShardedMuon(params, lr=MUON_LR, comm=comm, backend=_laplace(report, inner=_outputs_only))
    for p in params:
        p.grad = torch.empty(p.shape, device="meta")
    opt.step()
    (traffic,) = report.traffic
    return traffic


def traffic_through_make_fx(shapes, world_size: int):
    """The all_gather shard step traced at `world_size` with fake tensors, rewritten by the public API."""
    from torch.fx.experimental.proxy_tensor import make_fx

    splits = tuple(RowSplit(r, c, world_size) for r, c in shapes)
    hparams = tuple(
        MuonHParams(MUON_LR, 0.1, 0.95, True, (3.4445, -4.7750, 2.0315), 5, 1e-7, adjust_lr(MUON_LR, None, r, c))
        for r, c in shapes
    )
    step = functools.partial(muon_shard_step, splits=splits, hparams=hparams,
                             owners=assign_owners(splits, world_size), comm="all_gather",
                             world_size=world_size, group="0")
    shards = lambda: [torch.empty(sp.shard_rows, sp.cols, device="meta") for sp in splits]  # noqa: E731
    gm = make_fx(torch.func.functionalize(step), tracing_mode="fake")(
        shards(), shards(), shards(), torch.tensor(0, device="meta")
    )
    result = rewrite_muon_step(gm, world_size=world_size)
    if not result.modified:
        raise RuntimeError(f"rewrite declined at W={world_size}: {result.declined}")
    return result.traffic


def print_traffic(model_name: str, rows: list[tuple[int, str, object]]) -> None:
    print(f"\n[traffic] {model_name}: per-rank bytes received by the Muon step (worst rank)")
    header = (f"{'W':>3} {'baseline':>16} {'G':>10} {'baseline rcvd':>14} {'all-to-all':>12} {'ratio':>8} "
              f"{'W/2':>5} {'ratio/(W/2)':>11} {'bound':>11} {'a2a/bound':>9} {'plan':>9} "
              f"{'NS GFLOP/rank before':>20} {'after':>7}  targets")
    print(header)
    for world_size, comm, t in rows:
        ratio = t.received_ratio
        over_bound = t.received_after / t.lower_bound_bytes
        meets = []
        if comm == "all_gather":
            meets.append("ratio>=W/2 " + ("yes" if ratio >= world_size / 2 else "NO"))
        meets.append("<=5% over bound " + ("yes" if over_bound <= 1.05 else "NO"))
        print(f"{world_size:>3} {comm:>16} {_mb(t.matrix_bytes):>10} {_mb(t.received_before):>14} "
              f"{_mb(t.received_after):>12} {ratio:>7.2f}x {world_size / 2:>5g} {ratio / (world_size / 2):>11.3f} "
              f"{_mb(t.lower_bound_bytes):>11} {over_bound:>9.3f} {t.ownership:>9} "
              f"{t.ns_flops_before / 1e9:>20.2f} {t.ns_flops_after / 1e9:>7.2f}  {', '.join(meets)}")


def _mb(n: int) -> str:
    return f"{n / 1e6:.3f} MB"


# Models whose Muon step Dynamo captures in reasonable time; laplace-3b goes through make_fx.
CAPTURED_MODELS = ("tiny", "small")


def run_traffic(models: list[str], world_sizes: tuple[int, ...]) -> None:
    for name in (m for m in CAPTURED_MODELS if m in models):
        shapes = muon_shapes(name)
        print(f"\n{name}: {len(shapes)} Muon matrices, {sum(r * c for r, c in shapes) / 1e6:.2f} M elements")
        rows = []
        for world_size in world_sizes:
            for comm in ("all_gather", "gather_broadcast"):
                start = time.perf_counter()
                rows.append((world_size, comm, traffic_through_backend(shapes, world_size, comm)))
                print(f"  captured W={world_size} {comm} in {time.perf_counter() - start:.0f}s", flush=True)
        print_traffic(f"{name} (ShardedMuon + laplace backend, fake process group)", rows)
    if "laplace-3b" in models:
        shapes = muon_shapes("laplace-3b")
        print(f"\nlaplace-3b: {len(shapes)} Muon matrices, {sum(r * c for r, c in shapes) / 1e9:.2f} G elements")
        rows = []
        for world_size in world_sizes:
            start = time.perf_counter()
            rows.append((world_size, "all_gather", traffic_through_make_fx(shapes, world_size)))
            print(f"  captured W={world_size} in {time.perf_counter() - start:.0f}s", flush=True)
        print_traffic("laplace-3b (make_fx + rewrite_muon_step)", rows)
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- part 1b: ownership plans

PLAN_WORLD_SIZES = (4, 8)
BF16_BYTES = 2


def plan_rows(shapes: list[tuple[int, int]], world_size: int, ns_steps: int = 5) -> dict[str, tuple[int, int, int]]:
    """{plan: (bytes received per rank, Newton-Schulz FLOPs of the busiest rank, zero matrices)}.

    The plans the Muon pass chooses from (`laplace_passes.collectives.plan`), for row shards padded to
    ceil(rows / W) as ShardedMuon sends them in bf16, and the all-gather baseline (every rank receives
    every other rank's shards and runs every Newton-Schulz).
    """
    from laplace_passes.collectives.plan import plan_candidates

    W = world_size
    numels = [-(-r // W) * c for r, c in shapes]
    flops = [newton_schulz_flops(r, c, ns_steps) for r, c in shapes]
    rows = {"all-gather baseline": ((W - 1) * sum(numels) * BF16_BYTES, sum(flops), 0)}
    for plan in plan_candidates(shapes, numels, flops, W):
        name = "branch-free (uniform)" if plan.kind == "uniform" else "balanced (a cond per owner)"
        rows[name] = (2 * (W - 1) * plan.chunk_numel * BF16_BYTES, plan.flops_per_rank, plan.padding_matrices)
    return rows


def run_plans(models: list[str], world_sizes: tuple[int, ...]) -> None:
    print("\n[plans] the Muon step's ownership plans: bytes received per rank (bf16 shards) and the busiest "
          "rank's Newton-Schulz GFLOP (5 steps); trn2 takes the branch-free plan")
    print(f"  {'model':<11} {'W':>3}  {'plan':<28} {'received':>12} {'x baseline':>10} {'NS GFLOP':>9} "
          f"{'x baseline':>10} {'zero matrices':>13}")
    for name in models:
        shapes = muon_shapes(name)
        for world_size in world_sizes:
            rows = plan_rows(shapes, world_size)
            base_bytes, base_flops, _ = rows["all-gather baseline"]
            for plan, (received, flops, zeros) in rows.items():
                print(f"  {name:<11} {world_size:>3}  {plan:<28} {received / 1e6:>9.4f} MB {received / base_bytes:>10.3f} "
                      f"{flops / 1e9:>9.2f} {flops / base_flops:>10.3f} {zeros:>13}", flush=True)


# ---------------------------------------------------------------- part 2: step time

# (comm, which parameters Muon gets): the usual split sends the embedding to
# AdamW; ShardedMuon's own default (use_muon=None) gives Muon every 2D one.
TIMED_CASES = (
    ("all_gather", "embedding to AdamW"),
    ("gather_broadcast", "embedding to AdamW"),
    ("all_gather", "every 2D parameter to Muon"),
)


def _split(model: torch.nn.Module, grouping: str) -> tuple[list, list]:
    named = list(model.named_parameters())
    is_muon = (lambda n, p: p.ndim == 2) if grouping.startswith("every") else (
        lambda n, p: p.ndim == 2 and "embed" not in n)
    return [p for n, p in named if is_muon(n, p)], [p for n, p in named if not is_muon(n, p)]


def _time_rank(rank, world_size, comm, grouping, repeats):
    """Median seconds of ShardedMuon.step() with the rewrite off and on, interleaved.

    Also the median of its middle part, shard step + AdamW, timed between the
    optimizer's phase hooks ("shard_step" .. "all_gather_params"): the rest of
    a step (gradient reduce-scatter, parameter all-gather) is the same work
    with and without the rewrite.
    """
    muon, other = _split(model_zoo.build("small"), grouping)
    gen = torch.Generator().manual_seed(100 + rank)
    grads = [torch.randn(p.shape, generator=gen) for p in muon + other]
    runs, reports = {}, {}
    for label, rewrite in (("baseline", False), ("all_to_all", True)):
        copies = [p.detach().clone().requires_grad_() for p in muon + other]
        reports[label] = laplace_passes.Report()
        opt = ShardedMuon(
            [{"params": copies[: len(muon)]}, {"params": copies[len(muon) :], "use_muon": False}],
            lr=MUON_LR, comm=comm, backend=_laplace(reports[label], muon_all_to_all=rewrite),
        )
        runs[label] = (opt, copies)
    steps = {label: [] for label in runs}
    middles = {label: [] for label in runs}
    for repeat in range(repeats + 2):  # two warm-up rounds: compile, first-touch
        for label, (opt, copies) in runs.items():
            stamps = {}
            opt._fault_hook = lambda phase: stamps.__setitem__(phase, time.perf_counter())  # timestamps only
            for p, g in zip(copies, grads):
                p.grad = g
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            if repeat >= 2:
                steps[label].append(time.perf_counter() - start)
                middles[label].append(stamps["all_gather_params"] - stamps["shard_step"])
    rewritten = [p.modified for p in reports["all_to_all"].passes if p.name == "muon_all_to_all"]
    medians = {label: (statistics.median(steps[label]), statistics.median(middles[label])) for label in runs}
    return medians, rewritten, len(muon)


def run_time(repeats: int, threads: int) -> None:
    from tests._dist import run_ranks

    print(f"\n[step time] ShardedMuon.step(), model_zoo 'small' parameters, {TIMED_WORLD_SIZE} gloo processes, "
          f"{threads} thread(s) each, {repeats} interleaved steps, median; slowest rank")
    for comm, grouping in TIMED_CASES:
        results = run_ranks(TIMED_WORLD_SIZE, _time_rank, comm, grouping, repeats, timeout=1500, threads=threads)
        assert all(rewritten == [True] for _, rewritten, _ in results), "the rewrite did not apply"
        base, base_mid = (max(r["baseline"][k] for r, _, _ in results) for k in (0, 1))
        new, new_mid = (max(r["all_to_all"][k] for r, _, _ in results) for k in (0, 1))
        ratio = base / new
        print(f"  comm={comm:<16} {grouping} ({results[0][2]} Muon matrices): "
              f"step {base * 1e3:7.1f} -> {new * 1e3:7.1f} ms, {ratio:4.2f}x "
              f"(target 1.63x: {'met' if ratio >= 1.63 else 'NOT met'}); "
              f"shard step + AdamW {base_mid * 1e3:7.1f} -> {new_mid * 1e3:6.1f} ms, {base_mid / new_mid:4.2f}x")


# ---------------------------------------------------------------- part 2b: Newton-Schulz-bound step

# Matrices whose Newton-Schulz is the step's work: with W = 4, both groups'
# counts are multiples of W (a uniform plan without zero matrices).
NS_BOUND_SHAPES = ((512, 512),) * 8 + ((1024, 256),) * 4
# (label, comm, rewrite): the all-gather step without and with the rewrite,
# and the gather-and-broadcast step (owners already run Newton-Schulz once).
NS_BOUND_RUNS = (("all_gather", "all_gather", False), ("all_to_all", "all_gather", True),
                 ("gather_broadcast", "gather_broadcast", False))


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """'512x512*8,1024x256*4' -> eight 512 x 512 and four 1024 x 256 shapes."""
    shapes = []
    for item in text.split(","):
        shape, _, count = item.partition("*")
        rows, cols = (int(n) for n in shape.split("x"))
        shapes += [(rows, cols)] * int(count or 1)
    return tuple(shapes)


def _ns_bound_rank(rank, world_size, shapes, runs, repeats, profile):
    """Per-step seconds of every run's ShardedMuon.step(), the runs interleaved step by step.

    Returns {label: [seconds per steady step]} and, with `profile`, each
    run's torch.profiler self-time breakdown of one more step.
    """
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(100 + rank)) for s in shapes]
    optimizers = {}
    for label, comm, rewrite in runs:
        copies = [p.clone().requires_grad_() for p in params]
        opt = ShardedMuon(copies, lr=MUON_LR, comm=comm,
                          backend=_laplace(laplace_passes.Report(), muon_all_to_all=rewrite))
        optimizers[label] = (opt, copies)
    times = {label: [] for label in optimizers}
    for repeat in range(repeats + 1):  # one warm-up round: compile, first touch
        for label, (opt, copies) in optimizers.items():
            seconds = _one_step(opt, copies, grads)
            if repeat:
                times[label].append(seconds)
    breakdown = {}
    if profile:
        for label, (opt, copies) in optimizers.items():
            breakdown[label] = _profiled_step(opt, copies, grads)
    return times, breakdown


def _one_step(opt, copies, grads) -> float:
    for p, g in zip(copies, grads):
        p.grad = g
    dist.barrier()
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


# Profiler op names -> the part of a step they are, tried in this order
# (ATen ops first, so that aten::broadcast_tensors is no collective); what
# no part takes, and the step's wall time beyond the parts' self times, is
# Python, dispatch and time descheduled.
STEP_PARTS = (
    ("Newton-Schulz matmuls", ("aten::mm", "aten::addmm")),
    ("copies and layout (cat, clone, copy, index, fill)", ("aten::cat", "aten::clone", "aten::copy_", "aten::index",
                                                          "aten::_to_copy", "aten::contiguous", "aten::full",
                                                          "aten::zeros", "aten::empty", "aten::fill_")),
    ("other tensor math (norm, lerp, scale, AdamW)", ("aten::",)),
    ("collectives (incl. waiting for peers)", ("c10d", "gloo", "all_to_all", "all_gather", "broadcast",
                                               "reduce_scatter", "allreduce", "barrier", "record_param_comms")),
)
WALL = "step wall time"


def _profiled_step(opt, copies, grads) -> dict[str, float]:
    """Self time per step part (seconds) of one step under torch.profiler, and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds = _one_step(opt, copies, grads)
    by_substring = {name: (lambda key, ks=keys: any(k in key for k in ks)) for name, keys in STEP_PARTS}
    return {**self_time_by_part(prof, by_substring), WALL: seconds}


def run_ns_bound(shapes, repeats: int, threads: int, profile: bool) -> None:
    from tests._dist import run_ranks

    counts = ", ".join(f"{shapes.count(s)} of {s[0]}x{s[1]}" for s in dict.fromkeys(shapes))
    print(f"\n[step time, Newton-Schulz bound] ShardedMuon.step() on {counts}, {TIMED_WORLD_SIZE} gloo processes, "
          f"{threads} thread(s) each, {repeats} steady steps per run interleaved (after one warm-up), "
          "slowest rank per step; load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
    results = run_ranks(TIMED_WORLD_SIZE, _ns_bound_rank, shapes, NS_BOUND_RUNS, repeats, profile,
                        timeout=7200, pg_timeout=1800, threads=threads)
    steps = {label: [max(r[0][label][i] for r in results) for i in range(repeats)] for label, _, _ in NS_BOUND_RUNS}
    for label in steps:
        print(f"  {label:<16} median {statistics.median(steps[label]):8.3f} s  "
              f"(min {min(steps[label]):.3f}, max {max(steps[label]):.3f})")
    rewritten = steps["all_to_all"]
    for label in ("all_gather", "gather_broadcast"):
        paired = [b / a for b, a in zip(steps[label], rewritten)]  # same round: side by side
        ratio = statistics.median(steps[label]) / statistics.median(rewritten)
        target = f" (target 1.63x: {'met' if ratio >= 1.63 else 'NOT met'})" if label == "all_gather" else ""
        print(f"  {label} / all_to_all: {ratio:.2f}x of medians; per round {statistics.median(paired):.2f}x "
              f"(min {min(paired):.2f}, max {max(paired):.2f}){target}")
    if profile:
        _print_breakdown([r[1] for r in results])
    print("  load average (1, 5, 15 min) at the end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))


def _print_breakdown(per_rank: list[dict[str, dict[str, float]]]) -> None:
    print("  one more step per run under torch.profiler: self time in seconds, mean over ranks "
          "(wall-clock: includes time descheduled on an oversubscribed machine)")
    labels = list(per_rank[0])
    print(f"    {'part':<52}" + "".join(f"{label:>18}" for label in labels))
    for part in [name for name, _ in STEP_PARTS] + [WALL]:
        row = [statistics.mean(r[label][part] for r in per_rank) for label in labels]
        print(f"    {part:<52}" + "".join(f"{v:>18.3f}" for v in row))
    rest = [statistics.mean(r[label][WALL] - sum(v for k, v in r[label].items() if k != WALL) for r in per_rank)
            for label in labels]
    print(f"    {'rest (Python, dispatch, descheduled)':<52}" + "".join(f"{v:>18.3f}" for v in rest))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("traffic", "plans", "time", "ns", "both"), default="both")
    parser.add_argument("--models", nargs="+", choices=(*CAPTURED_MODELS, "laplace-3b"),
                        help="default: small and laplace-3b (traffic), tiny (the demo's) and laplace-3b (plans)")
    parser.add_argument("--world-sizes", nargs="+", type=int, help=f"default: {WORLD_SIZES} (traffic), "
                        f"{PLAN_WORLD_SIZES} (plans)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", type=parse_shapes, default=NS_BOUND_SHAPES,
                        help="matrices of --part ns, e.g. 512x512*8,1024x256*4 (the default)")
    parser.add_argument("--profile", action="store_true", help="--part ns: also a torch.profiler breakdown")
    args = parser.parse_args(argv)
    args.models_given, args.world_sizes_given = args.models is not None, args.world_sizes is not None
    args.models = args.models or ["small", "laplace-3b"]
    args.world_sizes = args.world_sizes or list(WORLD_SIZES)
    if args.part in ("traffic", "both"):
        run_traffic(args.models, tuple(args.world_sizes))
    if args.part == "plans":  # the demo's model (tiny) unless --models says otherwise
        models = args.models if args.models_given else ["tiny", "laplace-3b"]
        run_plans(models, tuple(args.world_sizes) if args.world_sizes_given else PLAN_WORLD_SIZES)
    if args.part in ("time", "both"):
        run_time(args.repeats, args.threads)
    if args.part == "ns":  # not in "both": at the default shapes a step takes minutes on 2 cores
        run_ns_bound(args.shapes, args.repeats, args.threads, args.profile)


if __name__ == "__main__":
    main()
