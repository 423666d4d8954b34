"""Inductor's C++ kernels timed loop by loop: where a compiled graph's time between its matmuls goes.

    python -m benchmarks.bench_loops                     # GLA forward + backward, B=1, T=2048, H=4, K=128, V=256
    python -m benchmarks.bench_loops --T 512 --top 20    # another shape, more rows
    python -m benchmarks.bench_loops --json

torch.profiler and Inductor's kernel profile (``cpp.enable_kernel_profile``)
time whole kernels, and one fused kernel of the chunked GLA backward holds up
to 30 loops over different tensors: a 6 ms kernel says nothing about which
of them to change. Here the output code Inductor wrote for each graph of
`laplace_passes.compile`'s cpu target (forward and backward of
`laplace_passes.gla`, as `bench_gla` times them) is rewritten so that thread 0
reads a clock before each top-level ``#pragma omp for`` loop (after the
previous loop's closing barrier, so a loop's time is its slowest thread's) and
at the kernel's end; the code then runs in a child process on a copy of the
inputs the graph was called with here, and prints each loop's seconds as it
exits.

Printed per graph: the call's time, the loops' sum (the rest is the matmuls
and other extern calls, and the wrapper), the loops that only copy or fill,
and the slowest loops with their extents, the buffers they read and write,
and whether they compute anything. The clocks cost about a microsecond per
loop.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from unittest import mock

import torch

from benchmarks.bench_gla import compiled_gla, forward_backward, make_inputs
from benchmarks.common import KEEP_FREED_HELP, allocator_setting, say

_KERNEL = re.compile(r"(cpp_fused_\w+) = async_compile\.cpp_pybinding\((\[.*?\]), r'''(.*?)'''\)", re.S)
_LOOP_PRAGMA = "#pragma omp for"
# Every kernel of this torch's C++ backend starts and ends with these statements (its integer-division check).
_KERNEL_START = "inductor_cpu_integer_div_error_flag = &inductor_cpu_integer_div_error;"
_KERNEL_END = "inductor_cpu_integer_div_error_flag = nullptr;"
_PREFIX_INCLUDE = "#include <torch/csrc/inductor/cpp_prefix.h>"
_REPORT = "LOOP_SECONDS"
WARMUP_CALLS = 2  # untimed calls before the timed ones (the first starts OpenMP's threads and touches fresh memory)
_CLOCK_ON = "LAPLACE_BENCH_LOOPS_CLOCK_ON"  # set in the child's environment once the warm-up calls are done

# Thread 0's clock, per kernel library: lap(i) closes the running loop and starts loop i, counting only
# while the child's environment has CLOCK_ON (after its warm-up calls: a kernel may run several times per
# call of the graph); its destructor prints every loop's seconds and the kernel's timed calls at exit.
_CLOCK = r"""
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <omp.h>
namespace {
struct LoopClock {
  const char* kernel; int loops; double seconds[LOOPS] = {0}; long calls = 0; int running = -1;
  std::chrono::steady_clock::time_point since;
  void lap(int loop) {
    auto now = std::chrono::steady_clock::now();
    if (running >= 0 && std::getenv("CLOCK_ON")) seconds[running] += std::chrono::duration<double>(now - since).count();
    running = loop; since = now;
  }
  void start() { if (std::getenv("CLOCK_ON")) calls += 1; lap(0); }
  void stop() { lap(-1); }
  ~LoopClock() {
    for (int i = 0; i < loops; i++) fprintf(stderr, "REPORT %s %d %ld %.9f\n", kernel, i, calls, seconds[i]);
  }
};
LoopClock loop_clock{"KERNEL", LOOPS};
}
"""


@dataclass
class Loop:
    """One top-level loop of a kernel: what it walks and what it does."""

    kernel: str
    index: int
    extents: list[str]  # the bounds of its nested for-loops, outermost first
    reads: int  # distinct buffers it loads from
    writes: int  # distinct buffers it stores to
    kind: str  # "copy" (loads and stores only), "fill" (stores constants), or "computes"
    seconds: float = 0.0  # per call of the graph

    def describe(self) -> str:
        return (f"{self.kernel[:48]:48s} loop {self.index:2d}  {' x '.join(self.extents):22s} "
                f"reads {self.reads}, writes {self.writes}, {self.kind}")


def kernels(code: str) -> list[tuple[str, str, str]]:
    """(name, argument types, C++ source) of every C++ kernel in Inductor's output code."""
    found = _KERNEL.findall(code)
    for name, _, source in found:
        if _KERNEL_START not in source or _KERNEL_END not in source or _PREFIX_INCLUDE not in source:
            raise ValueError(f"kernel {name} does not have the shape bench_loops reads (this torch's C++ backend "
                             "writes kernels otherwise): its loops cannot be timed")
    return found


def loop_bodies(source: str) -> list[str]:
    """Each top-level loop's text; a kernel without an OpenMP loop (run on one thread) is one loop."""
    if "omp for nowait" in source:
        raise ValueError("a loop without its closing barrier (omp for nowait): thread 0's clock would not "
                         "bound the other threads' work")
    parts = source.split(_LOOP_PRAGMA)
    return parts[1:] if len(parts) > 1 else [source]


def describe(kernel: str, index: int, body: str) -> Loop:
    extents = re.findall(r"for\(int64_t (x\d+)=static_cast<int64_t>\(0L\); \1<static_cast<int64_t>\(([^;]*)\);", body)
    outer_first = list(dict.fromkeys(var for var, _ in extents))
    bound = dict(extents)
    stored = set(re.findall(r"\.store\((\w+ptr\d+)", body)) | set(re.findall(r"(\w+ptr\d+)\[[^\]]*\] = ", body))
    # Read: every buffer named but not only stored to (loads, transposed-tile loads), and those loaded explicitly.
    named = set(re.findall(r"\b(\w*ptr\d+)\b", body))
    loaded = (named - stored) | set(re.findall(r"loadu\((\w+ptr\d+)", body)) | set(re.findall(r"= (\w+ptr\d+)\[", body))
    values = re.findall(r"auto tmp\d+ = (.*);", body)
    is_load = [("loadu(" in v or re.fullmatch(r"\w+ptr\d+\[.*\]", v) is not None) for v in values]
    constants = [v for v in values if v.startswith(("static_cast<", "at::vec::Vectorized<float>(tmp"))]
    if values and all(is_load):
        kind = "copy"
    elif not loaded and len(constants) == len(values):
        kind = "fill"
    else:
        kind = "computes"
    return Loop(kernel, index, [bound[v].removesuffix("L") for v in outer_first], len(loaded), len(stored), kind)


def describe_loops(code: str) -> list[Loop]:
    return [describe(name, i, body) for name, _, source in kernels(code) for i, body in enumerate(loop_bodies(source))]


def instrument(code: str) -> str:
    """The output code with thread 0's clock read at every loop of every kernel (see the module docstring)."""
    def clocked(match: re.Match) -> str:
        name, types, source = match.groups()
        loops = len(loop_bodies(source))
        counter = iter(range(loops))
        source = re.sub(re.escape(_LOOP_PRAGMA), lambda _: f"if (omp_get_thread_num() == 0) "
                        f"loop_clock.lap({next(counter)});\n            {_LOOP_PRAGMA}", source)
        clock = (_CLOCK.replace("LOOPS", str(loops)).replace("KERNEL", name).replace("REPORT", _REPORT)
                 .replace("CLOCK_ON", _CLOCK_ON))
        source = source.replace(_PREFIX_INCLUDE, _PREFIX_INCLUDE + clock, 1)
        source = source.replace(_KERNEL_START, _KERNEL_START + "\n    loop_clock.start();", 1)
        source = source.replace(_KERNEL_END, "loop_clock.stop();\n    " + _KERNEL_END, 1)
        return f"{name} = async_compile.cpp_pybinding({types}, r'''{source}''')"

    kernels(code)  # refuses kernels of another shape before anything is rewritten
    return _KERNEL.sub(clocked, code)


_RUNNER = """
import os, runpy, sys, time
import torch
import laplace_passes  # registers the laplace:: ops a graph calls
if sys.argv[5] == "keep":
    laplace_passes.keep_freed_memory()
module = runpy.run_path(sys.argv[1], run_name="bench_loops_child")
args = torch.load(sys.argv[2])
warmup, calls = int(sys.argv[3]), int(sys.argv[4])
for _ in range(warmup):
    module["call"](list(args))
os.environ[sys.argv[6]] = "1"  # the kernels' clocks count from here
start = time.perf_counter()
for _ in range(calls):
    module["call"](list(args))  # call() empties the list it is given
print("CALL_SECONDS", (time.perf_counter() - start) / calls, file=sys.stderr)
"""


def time_loops(code: str, inputs: list, calls: int, keep_freed: bool = False) -> tuple[float, list[Loop]]:
    """Seconds per call of the graph's code on `inputs`, and its loops with their seconds per call (a child
    process; `keep_freed`: one that keeps freed memory, `laplace_passes.keep_freed_memory`)."""
    loops = describe_loops(code)
    with tempfile.TemporaryDirectory(prefix="laplace-bench-loops-") as folder:
        code_path, inputs_path = os.path.join(folder, "clocked_graph.py"), os.path.join(folder, "inputs.pt")
        with open(code_path, "w") as f:
            f.write(instrument(code))
        torch.save(inputs, inputs_path)
        child = subprocess.run([sys.executable, "-c", _RUNNER, code_path, inputs_path, str(WARMUP_CALLS), str(calls),
                                "keep" if keep_freed else "defaults", _CLOCK_ON],
                               capture_output=True, text=True)
    if child.returncode != 0:
        errors = "\n".join(line for line in child.stderr.splitlines() if not line.startswith(_REPORT))
        raise RuntimeError(f"the clocked graph failed in its child process:\n{errors[-3000:]}")
    by_loop = {}
    call_seconds = None
    for line in child.stderr.splitlines():
        fields = line.split()
        if fields[:1] == [_REPORT]:
            kernel, index, kernel_calls, seconds = fields[1], int(fields[2]), int(fields[3]), float(fields[4])
            by_loop[(kernel, index)] = seconds / calls if kernel_calls > 0 else 0.0  # per call of the graph
        elif fields[:1] == ["CALL_SECONDS"]:
            call_seconds = float(fields[1])
    missing = [f"{loop.kernel} loop {loop.index}" for loop in loops if (loop.kernel, loop.index) not in by_loop]
    if call_seconds is None or missing:
        raise RuntimeError(f"the child process did not report every loop (missing: {missing[:5]}):\n"
                           f"{child.stderr[-3000:]}")
    for loop in loops:
        loop.seconds = by_loop[(loop.kernel, loop.index)]
    return call_seconds, loops


def graphs_called(fn) -> list[tuple[str, list]]:
    """Each Inductor graph one call of `fn` runs, in call order: its output code and a copy of its inputs."""
    from torch._inductor.output_code import CompiledFxGraph

    called = []
    run_graph = CompiledFxGraph.__call__

    def recording(graph, inputs):
        called.append((graph.source_code, [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in inputs]))
        return run_graph(graph, inputs)

    with mock.patch.object(CompiledFxGraph, "__call__", recording):
        fn()
    return called


def gla_graphs(shape: dict, chunk_size: int) -> list[tuple[str, list]]:
    """The forward and the backward graph of `bench_gla`'s compiled path: output code and inputs of each."""
    inputs = make_inputs(*(shape[k] for k in ("B", "T", "H", "K", "V")))
    say("compiling and running GLA forward + backward (laplace, cpu target, inner inductor) ...")
    start = time.perf_counter()
    graphs = graphs_called(forward_backward(compiled_gla(chunk_size), inputs))
    say(f"  {time.perf_counter() - start:.1f} s")
    return graphs


def summary(graph: str, call_seconds: float, loops: list[Loop], top: int) -> dict:
    ranked = sorted(loops, key=lambda loop: -loop.seconds)
    return {
        "graph": graph,
        "call_s": call_seconds,
        "loops": len(loops),
        "kernels": len({loop.kernel for loop in loops}),
        "loops_s": sum(loop.seconds for loop in loops),
        "copy_or_fill_s": sum(loop.seconds for loop in loops if loop.kind != "computes"),
        "copy_or_fill_loops": sum(loop.kind != "computes" for loop in loops),
        "slowest": [asdict(loop) for loop in ranked[:top]],
    }


def _text(r: dict) -> str:
    lines = [f"{r['graph']}: {r['call_s'] * 1e3:.1f} ms a call; {r['loops']} loops in {r['kernels']} kernels take "
             f"{r['loops_s'] * 1e3:.1f} ms ({r['loops_s'] / r['call_s']:.0%}; the rest: matmuls, other extern "
             f"calls, the wrapper); {r['copy_or_fill_loops']} loops only copy or fill: "
             f"{r['copy_or_fill_s'] * 1e3:.1f} ms"]
    for row in r["slowest"]:
        loop = Loop(**row)
        lines.append(f"  {loop.seconds * 1e3:6.2f} ms  {loop.describe()}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for dim, default in (("B", 1), ("T", 2048), ("H", 4), ("K", 128), ("V", 256)):
        parser.add_argument(f"--{dim}", type=int, default=default)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--calls", type=int, default=10, help="calls of each graph timed in its child process")
    parser.add_argument("--top", type=int, default=12, help="slowest loops printed per graph")
    parser.add_argument("--keep-freed-memory", action="store_true", help=KEEP_FREED_HELP + " (in the child processes)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.top < 0:
        parser.error("--calls must be at least 1 and --top at least 0")
    if not args.json:
        print(f"allocator of the timed child processes: {allocator_setting(args.keep_freed_memory)}", flush=True)
    shape = {k: getattr(args, k) for k in ("B", "T", "H", "K", "V")}
    results = []
    for graph, (code, inputs) in zip(("forward", "backward"), gla_graphs(shape, args.chunk_size), strict=True):
        say(f"timing the {graph}'s loops over {args.calls} calls in a child process (its kernels compile first) ...")
        results.append(summary(graph, *time_loops(code, inputs, args.calls, args.keep_freed_memory), args.top))
        if not args.json:
            print(_text(results[-1]), flush=True)
    if args.json:
        print(json.dumps({"shape": shape, "chunk_size": args.chunk_size, "graphs": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
