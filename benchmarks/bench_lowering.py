"""StableHLO size and IREE compile time against sequence length (chunks) and depth (layers).

    python -m benchmarks.bench_lowering                  # both sweeps, IREE compile times included (minutes)
    python -m benchmarks.bench_lowering --no-iree        # op counts only (seconds)
    python -m benchmarks.bench_lowering --json

For the GLA model (tiny: d 64, 2 heads) at trn2's chunk of 128 tokens:
  * chunks: T = 256 .. 4096 (2 .. 32 chunks), 2 layers;
  * layers: 1, 2, 4, 8 layers at T = 1024 (8 chunks).
Each point exports the forward and backward ATen graphs as StableHLO
(`laplace_passes.export_stablehlo`), counts their ops, and (unless --no-iree)
compiles each with IREE for llvm-cpu, timing it (the fastest of --repeats),
and counts the distinct kernels (dispatch executables) IREE forms. Linear
least-squares fits (slope, intercept, R^2) show whether growth is linear.

Calibration: the unroll issue's instruction estimate (`laplace_passes.unroll.
SizeModel`, 128 x 512 tiles per op, what the budget pass and the preflight
use) is computed on the ATen graph; neuronx-cc gets the StableHLO. The same
tile formula applied to the StableHLO, op by op
(`laplace_passes.lowering.calibrate`), is what it is fitted against, per
sweep and pooled over every point (tiny and small models):
estimate = a * stablehlo_estimate + b, with the worst relative gap.
Raw StableHLO op counts do not measure size: they depend on the graph's
structure only, identical for the tiny and the small model.

TensorEngine use (`laplace_passes.unroll.tiles`), per trn2 graph: the share
of matmul FLOPs on whole 128 x 128 tiles and the count of small products,
with the estimated instructions per layer, for the models and for the
intra-chunk halving's leaf sizes (`sub_chunk_size`: 4; 16, the trn2 default;
64), on one GLA layer with head dims 64 and 128:

    python -m benchmarks.bench_lowering --tiles          # this part only (a minute)
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from dataclasses import asdict, dataclass

import torch

import laplace_passes
import model_zoo
from benchmarks.common import once
from laplace_passes.lowering.calibrate import stablehlo_instructions
from laplace_passes.infra.targets import TRN2
from laplace_passes.unroll import SizeModel
from laplace_passes.unroll.tiles import tile_use

CHUNK_SWEEP_T = (256, 512, 1024, 2048, 4096)
LAYER_SWEEP = (1, 2, 4, 8)
LAYER_SWEEP_T = 1024


@dataclass
class Point:
    model: str
    T: int
    chunks: int
    layers: int
    forward_ops: int
    backward_ops: int
    estimated_instructions: int
    stablehlo_instructions: int  # the same tile formula on the StableHLO (forward + backward)
    kernels: int | None  # distinct IREE dispatch executables, forward + backward
    iree_compile_s: float | None

    @property
    def ops(self) -> int:
        return self.forward_ops + self.backward_ops


def measure(model_name: str, T: int, layers: int, compile_iree: bool, repeats: int = 1) -> Point:
    # Every point is a new Dynamo compile of the same wrapper code: without a
    # reset, Dynamo's recompile limit (8) stops capturing graphs.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = model_zoo.build(model_name, num_layers=layers)
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    with tempfile.TemporaryDirectory() as out_dir:
        exported = laplace_passes.export_stablehlo(model, ids, target="trn2", out_dir=out_dir)
        graphs = {g["kind"]: g for g in exported.manifest["graphs"]}
        texts = [exported.path(g["name"]).read_text() for g in exported.manifest["graphs"]]
    size_model = SizeModel.for_target(TRN2)
    instructions = sum(
        size_model.measure(exported.report.graph("after", g["name"])).instructions for g in exported.manifest["graphs"]
    )
    hlo_instructions = sum(stablehlo_instructions(text, size_model) for text in texts)
    seconds = sum(_iree_seconds(text, repeats) for text in texts) if compile_iree else None
    kernels = sum(_iree_kernels(text) for text in texts) if compile_iree else None
    return Point(
        model=model_name, T=T, chunks=-(-T // TRN2.chunk_size), layers=layers,
        forward_ops=graphs["forward"]["total_ops"], backward_ops=graphs["backward"]["total_ops"],
        estimated_instructions=instructions, stablehlo_instructions=hlo_instructions, kernels=kernels, iree_compile_s=seconds,
    )


def _iree_seconds(text: str, repeats: int) -> float:
    """Fastest of `repeats` compiles: the machine is shared, the minimum is the least disturbed."""
    from laplace_passes.lowering.iree import compile_vmfb

    return min(once(lambda: compile_vmfb(text)) for _ in range(repeats))


def _iree_kernels(text: str) -> int:
    """Distinct dispatch executables IREE forms (identical ones, e.g. across layers, are shared)."""
    from laplace_passes.lowering.iree import compile_vmfb

    flow = compile_vmfb(text, flags=("--iree-llvmcpu-target-cpu=host", "--compile-to=flow"))
    return len(re.findall(rb"flow\.executable private @", flow))


def linear_fit(xs: list[float], ys: list[float]) -> dict:
    """Least squares y = slope * x + intercept, with R^2."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - mean_y) ** 2 for y in ys)
    return {"slope": slope, "intercept": intercept, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0}


def calibration_fit(points: list[Point]) -> dict:
    fit = linear_fit([p.stablehlo_instructions for p in points], [p.estimated_instructions for p in points])
    fit["worst_relative_gap"] = max(
        abs(p.estimated_instructions - p.stablehlo_instructions) / p.stablehlo_instructions for p in points
    )
    return fit


def sweep_fits(points: list[Point], axis: str) -> dict:
    xs = [getattr(p, axis) for p in points]
    fits = {
        "ops": linear_fit(xs, [p.ops for p in points]),
        "estimated_instructions": linear_fit(xs, [p.estimated_instructions for p in points]),
        "stablehlo_instructions": linear_fit(xs, [p.stablehlo_instructions for p in points]),
    }
    if all(p.iree_compile_s is not None for p in points):
        fits["kernels"] = linear_fit(xs, [p.kernels for p in points])
        fits["iree_compile_s"] = linear_fit(xs, [p.iree_compile_s for p in points])
    return fits


def print_sweep(title: str, points: list[Point], axis: str, fits: dict) -> None:
    print(f"\n{title}")
    print(f"  {'T':>5} {'chunks':>6} {'layers':>6} {'fwd ops':>8} {'bwd ops':>8} {'total':>7} "
          f"{'est. instr':>10} {'HLO instr':>10} {'kernels':>7} {'IREE s':>7}")
    for p in points:
        seconds = f"{p.iree_compile_s:7.1f}" if p.iree_compile_s is not None else "      -"
        kernels = f"{p.kernels:>7}" if p.kernels is not None else "      -"
        print(f"  {p.T:>5} {p.chunks:>6} {p.layers:>6} {p.forward_ops:>8} {p.backward_ops:>8} {p.ops:>7} "
              f"{p.estimated_instructions:>10} {p.stablehlo_instructions:>10} {kernels} {seconds}")
    for quantity, fit in fits.items():
        print(f"  fit {quantity} = {fit['slope']:.2f} * {axis} + {fit['intercept']:.1f}   (R^2 = {fit['r2']:.4f})")


TILE_MODELS = (("tiny", 1024, 2), ("small", 1024, 2))
TILE_SUB_CHUNKS = (4, 16, 64)


def tile_rows(report, layers: int) -> list[dict]:
    """Per graph of `report`: whole-tile share, small products, estimated instructions per layer."""
    rows = []
    for record in report.graphs:
        if record.kind == "dynamo":
            continue
        use = tile_use(report.graph("after", record.name))
        rows.append({"graph": record.name, "whole_tile_share": use.whole_tile_share,
                     "small_products": use.small_products, "products": use.products,
                     "instructions_per_layer": record.size.instructions / layers})
    return rows


def measure_tiles() -> dict:
    """The models, then one GLA layer per head dim and leaf size (`sub_chunk_size`) of the intra-chunk halving."""
    result: dict = {"models": {}, "gla_layer": {}}
    for name, T, layers in TILE_MODELS:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = model_zoo.build(name, num_layers=layers)
        ids = torch.randint(0, model.config.vocab_size, (1, T))
        result["models"][f"{name} T={T}"] = tile_rows(laplace_passes.inspect(model, ids, target="trn2"), layers)

    def attention(q, k, v, gk):
        return laplace_passes.gla(q, k, v, torch.nn.functional.logsigmoid(gk))[0]

    for head_dim in (64, 128):
        for sub in TILE_SUB_CHUNKS:
            torch._dynamo.reset()
            gen = torch.Generator().manual_seed(0)
            inputs = [torch.randn(1, 1024, 4, head_dim, generator=gen, requires_grad=True) for _ in range(4)]
            report = laplace_passes.inspect(attention, *inputs, target=TRN2.with_overrides(sub_chunk_size=sub))
            result["gla_layer"][f"K={head_dim} leaves {sub}"] = tile_rows(report, 1)
    return result


def print_tiles(result: dict) -> None:
    print("\nTensorEngine use per trn2 graph: matmul FLOPs on whole 128x128 tiles, small products (K or max(M, N) < 128)")
    for section, title in (("models", "models"), ("gla_layer", "one GLA layer, T = 1024, 4 heads (intra-chunk formulations)")):
        print(f"  {title}")
        for name, rows in result[section].items():
            for row in rows:
                print(f"    {name:<22} {row['graph']:<11} whole-tile {row['whole_tile_share']:6.1%}   "
                      f"small {row['small_products']:>6} of {row['products']:>6} products   "
                      f"~{row['instructions_per_layer']:>8,.0f} instructions per layer")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-iree", action="store_true", help="op counts only, no IREE compile")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--repeats", type=int, default=1, help="IREE compiles per graph; the fastest counts")
    parser.add_argument("--tiles", action="store_true", help="the TensorEngine use only")
    args = parser.parse_args(argv)
    compile_iree = not args.no_iree
    tiles = measure_tiles()
    if args.tiles:
        print(json.dumps(tiles, indent=2)) if args.json else print_tiles(tiles)
        return tiles

    chunk_points = [measure("tiny", T, 2, compile_iree, args.repeats) for T in CHUNK_SWEEP_T]
    layer_points = [measure("tiny", LAYER_SWEEP_T, n, compile_iree, args.repeats) for n in LAYER_SWEEP]
    small_points = [measure("small", T, 2, False) for T in (256, 1024, 4096)]
    calibration = {
        "tiny, chunks": calibration_fit(chunk_points),
        "tiny, layers": calibration_fit(layer_points),
        "small, chunks": calibration_fit(small_points),
        "pooled": calibration_fit(chunk_points + layer_points + small_points),
    }
    result = {
        "chunks": {"points": [asdict(p) for p in chunk_points], "fits": sweep_fits(chunk_points, "chunks")},
        "layers": {"points": [asdict(p) for p in layer_points], "fits": sweep_fits(layer_points, "layers")},
        "small": {"points": [asdict(p) for p in small_points], "fits": sweep_fits(small_points, "chunks")},
        "calibration": calibration,
        "tiles": tiles,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print_sweep("StableHLO ops and IREE compile time against chunks (tiny, 2 layers, chunk 128)",
                chunk_points, "chunks", result["chunks"]["fits"])
    print_sweep(f"... against layers (tiny, T = {LAYER_SWEEP_T})", layer_points, "layers", result["layers"]["fits"])
    print_sweep("small model (d 256, 4 heads), 2 layers: calibration points", small_points, "chunks",
                sweep_fits(small_points, "chunks"))
    print("\ncalibration: SizeModel's estimate on the ATen graphs against the same formula on their StableHLO")
    for name, fit in calibration.items():
        print(f"  {name:<14} estimate = {fit['slope']:6.3f} * stablehlo + {fit['intercept']:8.0f}   "
              f"(R^2 = {fit['r2']:.4f}; worst gap {fit['worst_relative_gap']:.1%})")
    print_tiles(tiles)
    return result


if __name__ == "__main__":
    main()
