"""Graph size after static unrolling, partitions under the trn2 budget, and what the passes cost.

    python -m benchmarks.bench_unroll                  # laplace-3b on meta, T=2048; 1, 8, 32 and 36 layers
    python -m benchmarks.bench_unroll --layers 1 8 --json
    python -m benchmarks.bench_unroll --layers 36 --budget 1000000   # force partitions
    python -m benchmarks.bench_unroll --model tiny --layers 1 2 --seq-len 256   # seconds: another model_zoo config

Nothing is allocated: the model is built on the meta device and
`laplace_passes.inspect` runs Dynamo, the passes and AOT Autograd on fake
tensors. For each depth it prints, per ATen graph (forward, backward):

  * nodes and estimated instructions (`laplace_passes.unroll.SizeModel`),
    in total, per layer and outside the layers (embedding, norm, head), nodes
    attributed to a layer by the module they came from;
  * the partitions needed under trn2's budget (5,000,000) and the bytes
    crossing each cut;
  * seconds spent in the laplace pass pipeline: in the passes themselves, and
    in all of `run_passes` (linting and the report's graph snapshots
    included), beside the whole inspect (Dynamo and AOT Autograd included).

Then how size and time grow with depth: per-layer increments between the
depths, which are flat when growth is linear.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from unittest import mock

import torch

from benchmarks.common import print_row, say
import laplace_passes
import laplace_passes.driver.compile_fx as compile_fx
import model_zoo
from laplace_passes.infra.pass_base import GraphPass
from laplace_passes.unroll import SizeModel

LAYER = re.compile(r"layers[.\[](\d+)")


def measure(num_layers: int, seq_len: int, budget: int | None = None, model_name: str = "laplace-3b") -> dict:
    model = model_zoo.build(model_name, num_layers=num_layers, device="meta")
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    seconds: dict[str, float] = defaultdict(float)
    run_passes, call_pass = compile_fx.run_passes, GraphPass.__call__

    def timed(key, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - start

        return run

    torch._dynamo.reset()
    start = time.perf_counter()
    with mock.patch.object(compile_fx, "run_passes", timed("pipeline", run_passes)), \
            mock.patch.object(GraphPass, "__call__", timed("passes", call_pass)):
        options = {} if budget is None else {"max_graph_instructions": budget}
        report = laplace_passes.inspect(model, ids, target="trn2", **options)
    total_seconds = time.perf_counter() - start
    model_size = SizeModel.for_target(laplace_passes.get_target("trn2"))
    graphs = {}
    for record in report.graphs:
        if record.size is None:
            continue
        graphs[record.name] = {
            "nodes": record.size.nodes,
            "instructions": record.size.instructions,
            "budget": record.size.budget,
            "partitions": max(1, len(record.size.partitions)),
            "partition_instructions": [p.instructions for p in record.size.partitions],
            "cut_bytes": record.size.cut_bytes,
            "saved_for_backward_bytes": record.size.saved_for_backward_bytes,
            "loops": len(record.loops),
            "by_layer": by_layer(_uncut(report, record.name), model_size),
        }
    return {
        "model": model_name,
        "layers": num_layers,
        "seq_len": seq_len,
        "inspect_s": total_seconds,
        "passes_s": seconds["passes"],
        "pipeline_s": seconds["pipeline"],
        "graphs": graphs,
    }


def _uncut(report, name: str) -> torch.fx.GraphModule:
    """The graph the inner compiler would get whole: before the budget pass, when it cut it."""
    record = report.graph_record(name)
    labels = [label for label, _ in record.snapshots]
    index = labels.index("fit_to_budget") - 1 if "fit_to_budget" in labels else -1
    return record.snapshots[index][1]


def by_layer(gm: torch.fx.GraphModule, model: SizeModel) -> dict:
    """Nodes and instructions per layer index ("other": outside the layers)."""
    nodes, instructions = defaultdict(int), defaultdict(int)
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
        paths = [path for path, _ in stack.values()]
        found = LAYER.search(paths[-1]) if paths else None
        key = int(found.group(1)) if found else "other"
        nodes[key] += 1
        instructions[key] += model.node_instructions(node)
    return {"nodes": dict(nodes), "instructions": dict(instructions)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 8, 32, 36])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=None, help="instruction budget (default: trn2's)")
    parser.add_argument("--model", default="laplace-3b", help="a model_zoo GLA config (built on meta)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    say(f"warming up: {args.model} with 1 layer at T = {args.seq_len} (imports, tracing the chunk ops) ...")
    measure(1, args.seq_len, model_name=args.model)  # first-call costs (imports, tracing the chunk ops) out
    results = []
    for n in args.layers:
        say(f"measuring {args.model} with {n} layers at T = {args.seq_len} ...")
        results.append(measure(n, args.seq_len, args.budget, args.model))
        if not args.json:
            print_row("\n".join(_text(results[-1], header=len(results) == 1)))
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print_row(_growth(results))
    return results


def _text(r: dict, header: bool) -> list[str]:
    """One depth's rows, under the table's title line when `header`."""
    budget = next(iter(r["graphs"].values()))["budget"]
    title = f"{r['model']} on meta, T={r['seq_len']}, target trn2, budget {budget:,} estimated instructions"
    lines = [title] if header else []
    lines.append(
        f"\n{r['layers']} layers: passes {r['passes_s']:.2f} s, pass pipeline with lint and report snapshots "
        f"{r['pipeline_s']:.2f} s, whole inspect {r['inspect_s']:.2f} s"
    )
    total_nodes = total_instructions = 0
    for name, g in r["graphs"].items():
        total_nodes += g["nodes"]
        total_instructions += g["instructions"]
        layer_nodes = [v for k, v in g["by_layer"]["nodes"].items() if k != "other"]
        layer_instr = [v for k, v in g["by_layer"]["instructions"].items() if k != "other"]
        cuts = ", ".join(f"{b / 1e6:.1f} MB" for b in g["cut_bytes"]) or "-"
        lines.append(
            f"  {name:11s} {g['nodes']:7d} nodes {g['instructions']:11,d} instructions "
            f"({g['instructions'] / g['budget']:.0%} of budget), {g['partitions']} partition(s), cuts: {cuts}"
        )
        if layer_nodes:
            lines.append(
                f"  {'':11s} per layer: {min(layer_nodes)}-{max(layer_nodes)} nodes, "
                f"{min(layer_instr):,}-{max(layer_instr):,} instructions; outside the layers: "
                f"{g['by_layer']['nodes'].get('other', 0)} nodes, "
                f"{g['by_layer']['instructions'].get('other', 0):,} instructions"
            )
        if g["saved_for_backward_bytes"]:
            lines.append(f"  {'':11s} activations saved for it: {g['saved_for_backward_bytes'] / 1e9:.2f} GB")
    lines.append(f"  {'total':11s} {total_nodes:7d} nodes {total_instructions:11,d} instructions")
    return lines


def _growth(results: list[dict]) -> str:
    """Per added layer, between consecutive depths: printed once every depth is measured."""
    lines = ["\ngrowth with depth (per added layer, between consecutive depths):"]
    for a, b in zip(results, results[1:]):
        added = b["layers"] - a["layers"]
        if added <= 0:
            continue
        cells = []
        for name in b["graphs"]:
            if name in a["graphs"]:
                dn = (b["graphs"][name]["nodes"] - a["graphs"][name]["nodes"]) / added
                di = (b["graphs"][name]["instructions"] - a["graphs"][name]["instructions"]) / added
                cells.append(f"{name} {dn:+.0f} nodes {di:+,.0f} instructions")
        times = ", ".join(
            f"{label} {(b[key] - a[key]) / added * 1e3:+.0f} ms"
            for label, key in (("passes", "passes_s"), ("pipeline", "pipeline_s"), ("inspect", "inspect_s"))
        )
        lines.append(f"  {a['layers']:>2} -> {b['layers']:>2}: " + "; ".join(cells) + f"; {times}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
