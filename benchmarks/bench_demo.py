"""The demo's learning curve over its settings: the sweep its embedded defaults were chosen from.

    python -m benchmarks.bench_demo                                   # the defaults: threads 1, 2 x seeds 0, 1
    python -m benchmarks.bench_demo --num-pairs 4 8 --muon-lr 0.02 0.05 --steps 600 --threads 1
    python -m benchmarks.bench_demo --shift-keys on off --seed 0 --threads 1   # tiny with and without shifted keys
    laplace-passes bench demo --seq-len 32 64 --jobs 2

Every combination of the listed values is one `run_demo` in its own process (a fresh interpreter,
so no compile is shared or cached between rows), with OMP_NUM_THREADS set to its thread count. One
row is printed per run as soon as it ends (`--jobs 2`: in the order they end): its settings, the
training loss at the start and at the end (each the mean of 10 steps: one step's batch is noisy),
the recall accuracy on the demo's evaluation batch after each quarter of the steps (the last one is
the demo's result: the evaluations leave the training as it is), and the training seconds (the
first step's compile and the evaluations included: time the defaults with `laplace-passes demo`). The last lines give the band of the recall over the rows
(min, max), and the load average, since the seconds depend on what else runs: on a shared machine
compare the loss and the recall, which do not.

Loss and recall depend only on the settings and on the last bits of the reductions (thread count,
machine); the seconds are this machine's, now.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from laplace_passes.demo.train import DemoConfig

ROOT = Path(__file__).resolve().parents[1]

# (command-line option, DemoConfig field): the settings a sweep may vary, in the row's column order.
AXES = (("--shift-keys", "shift_keys"), ("--num-pairs", "num_pairs"), ("--seq-len", "seq_len"), ("--batch", "batch"),
        ("--steps", "steps"), ("--muon-lr", "muon_lr"), ("--adamw-lr", "adamw_lr"), ("--seed", "seed"))
MEAN_OF = 10  # steps averaged for the first and the final loss
QUARTERS = 4  # recall measurements per run


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.one:
        _train_one(args.one)
        return 0
    runs = [dict(zip([field for _, field in AXES] + ["threads"], values))
            for values in itertools.product(*(getattr(args, field) for _, field in AXES), args.threads)]
    print(f"{len(runs)} runs of `laplace-passes demo --model {args.model}`, {args.jobs} at a time", flush=True)
    print(_header(), flush=True)
    recalls = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        pending = [pool.submit(run_one, args.model, run) for run in runs]
        for done in as_completed(pending):
            run, result = done.result()
            print(_row(run, result), flush=True)
            if args.save:
                with open(args.save, "a") as out:
                    out.write(json.dumps({"run": run, "losses": result.get("losses"),
                                          "recalls": result.get("recalls"), "seconds": result.get("seconds")}) + "\n")
            if "accuracy" in result:
                recalls.append(result["accuracy"])
    if recalls:
        print(f"recall over {len(recalls)} runs: min {min(recalls):.1%}, max {max(recalls):.1%}")
    print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} "
          f"on {len(os.sched_getaffinity(0))} cores")
    return 0


def _parser() -> argparse.ArgumentParser:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=defaults.model)
    for option, field in AXES:
        kind = _on_off if field == "shift_keys" else float if field.endswith("_lr") else int
        default = [0, 1] if field == "seed" else [getattr(defaults, field)]
        parser.add_argument(option, dest=field, type=kind, nargs="+", default=default,
                            help=f"values to run (default {' '.join(_shown(value) for value in default)})")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="OMP_NUM_THREADS values to run (default 1 2)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time (default 1; on a shared machine more than 2 measure the contention)")
    parser.add_argument("--one", metavar="JSON", help=argparse.SUPPRESS)  # the child process of one run
    parser.add_argument("--save", metavar="FILE",
                        help="append each run's settings, losses (every step), recall and seconds to FILE, a JSON line each")
    return parser


def _shown(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def run_one(model: str, run: dict) -> tuple[dict, dict]:
    """One demo run in a fresh process; its result as a dict, or {"error": ...}."""
    settings = {field: run[field] for _, field in AXES}
    command = [sys.executable, "-m", "benchmarks.bench_demo", "--one", json.dumps({"model": model, **settings})]
    env = {**os.environ, "OMP_NUM_THREADS": str(run["threads"])}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        return run, {"error": lines[-1], "wall": time.perf_counter() - start}
    result = json.loads(done.stdout)
    result["wall"] = time.perf_counter() - start
    return run, result


def _train_one(settings: str) -> None:
    """The child process: one run, the recall measured after each quarter of the steps, printed as JSON."""
    from laplace_passes.demo.train import run_demo

    config = DemoConfig(**json.loads(settings), progress=False)
    config.recall_every = max(1, config.steps // QUARTERS)
    print(json.dumps(run_demo(config).to_dict()))


def _header() -> str:
    return (f"{'shift':>5} {'pairs':>5} {'T':>4} {'batch':>5} {'steps':>5} {'muon_lr':>7} {'adamw_lr':>8} {'seed':>4} {'thr':>3} | "
            f"{'loss first':>10} {'final':>6} | {'recall after each quarter':>27} | {'train s':>7} {'wall s':>6}")


def _row(run: dict, result: dict) -> str:
    settings = (f"{_shown(run['shift_keys']):>5} {run['num_pairs']:>5} {run['seq_len']:>4} {run['batch']:>5} {run['steps']:>5} "
                f"{run['muon_lr']:>7g} {run['adamw_lr']:>8g} {run['seed']:>4} {run['threads']:>3}")
    if "error" in result:
        return f"{settings} | failed after {result['wall']:.0f} s: {result['error']}"
    losses = result["losses"]
    first, final = _mean(losses[:MEAN_OF]), _mean(losses[-MEAN_OF:])
    recalls = " ".join(f"{accuracy:>6.1%}" for _, accuracy in result["recalls"])
    return (f"{settings} | {first:>10.3f} {final:>6.3f} | {recalls:>27} | {result['seconds']:>7.1f} "
            f"{result['wall']:>6.1f}")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


if __name__ == "__main__":
    sys.exit(main())
