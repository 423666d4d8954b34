"""Where the first call of `tiny`'s training step spends its time: Dynamo, AOT Autograd, our passes, Inductor, C++.

    python -m benchmarks.bench_compile                          # T = 2048, targets cpu and trn2, inner inductor
    python -m benchmarks.bench_compile --seq-len 512 --targets cpu
    python -m benchmarks.bench_compile --seq-len 64 --inner eager --json   # seconds: no Inductor
    LAPLACE_PASSES_BODY_HELPER=1 python -m benchmarks.bench_compile --targets cpu   # the helper process on,
                                                                # whatever the cores (=0: off)

Each target compiles in a fresh Python process with an empty Inductor cache
(TORCHINDUCTOR_CACHE_DIR a new temporary folder, the FX graph and AOT
Autograd caches off) and a new system temporary folder (TMPDIR, where
Inductor keeps its precompiled header), as a first compile on a new
machine does. The step is
`cross_entropy(model(ids), ids)` compiled with `laplace_passes.compile`,
then `.backward()`: its first forward and backward are timed (the total),
and split into stages that do not overlap, in wall-clock seconds:

  * Dynamo trace: Dynamo's compile less the backend it calls;
  * our passes: `run_passes` on every graph (Dynamo, forward, backward), from
    the seconds the "laplace.progress" logger reports per graph, and the
    traces of the GLA chunk-loop bodies Inductor compiles once per shape,
    with their host graph or at their first call (NOTE [chunk-loop bodies
    compiled once] in `laplace_passes/unroll/compiled_bodies.py`; their
    Inductor seconds are Inductor's stages);
  * AOT Autograd: the backend call and the backward's compile, less our
    passes, the bodies compiled with their host graph and the inner
    compiler (joint trace, partition, functionalisation);
  * backward sent ahead: the forward's compile sending the backward graph
    to the helper process (the backward's passes and its compile up to
    Inductor's codegen, here; NOTE [backward graphs generated in the helper
    process] in `laplace_passes/driver/backward_ahead.py`);
  * Inductor codegen: Inductor's compile of each graph less its wait for the
    C++ compiler and its ISA probes (lowering, scheduling, code generation;
    the compiler runs in `compile_threads` threads meanwhile);
  * Inductor's ISA probes: the wait for Inductor's test libraries, one built
    and loaded per vector instruction set the CPU reports, once per process
    (their builds once per Inductor cache: an empty cache here, as on a
    machine's first compile). The backend starts them in the background as
    it receives its first graph (NOTE [vector-ISA probes ahead of the
    codegen] in `laplace_passes/infra/inductor_fast.py`); this stage is what
    they had left when Inductor's compile began, plus any probe Inductor ran
    itself. Below the stages: their seconds in the background;
  * C++ compile (waited): the time the main thread waited for compiled
    kernels: Inductor's wait for those it builds itself, and the first calls
    of kernels built together in the background (NOTE [kernels compiled
    together] and NOTE [kernel builds beside the codegen] in
    `laplace_passes/infra/kernel_batches.py`), which wait for the rest of
    their build, the precompiled header included;
  * helper process (waited): the wait for what the helper process compiled
    while this one compiled the forward: the backward's chunk-loop bodies
    (NOTE [bodies compiled in a helper process] in
    `laplace_passes/unroll/body_helper.py`) and the backward graph, and their
    loading; the helper's own seconds are in the CPU seconds;
  * other: the rest (guards, running the step, lazy imports).

Beside the wall-clock total, the CPU seconds of the first call: this process
and every process it started (Inductor's compile workers, g++), user and
system. On a machine shared with other work the wall clock stretches with the
load; the CPU seconds barely do, and bound what a quiet machine takes with
one core (with two, g++ overlaps the codegen).

Stage seconds come from torch's own compile-time counters
(`torch._dynamo.utils.compilation_time_metrics`: `_compile.compile_inner`,
`OutputGraph.call_user_compiler`, `backward._backward_impl`,
`compile_fx_inner`, `async_compile.wait`). Below the stages: the g++ runs
and their seconds summed over the compile threads (they overlap each other
and the codegen, so they are not a stage), the precompiled header's
seconds (built in the background after the probes), and each graph's
nodes before and after the passes.

Above the targets, the machine's reference work (`benchmarks.reference_work`:
CPU seconds of fixed Python and g++ work on one thread, median of
`--reference-repeats` runs), through which first compiles measured on
different machines, or on one machine at different times, compare.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import reference_work
from benchmarks.common import print_row, rusage_seconds, say
from laplace_passes.infra.process_cpu import descendants_cpu_seconds

STAGES = ("Dynamo trace", "AOT Autograd", "our passes", "backward sent ahead", "Inductor codegen",
          "Inductor's ISA probes", "C++ compile (waited)", "helper process (waited)", "other")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--targets", nargs="+", default=["cpu", "trn2"])
    parser.add_argument("--inner", default="inductor", help="the inner compiler (eager: no Inductor, seconds)")
    parser.add_argument("--compile-threads", type=int, default=None,
                        help="Inductor's compile_threads (default: Inductor's own choice)")
    parser.add_argument("--inline-loop-bodies", action="store_true",
                        help="compile with share_loop_bodies=False: every GLA site's body inlined, none compiled once "
                             "for its layers; benchmarks/bench_loop_bodies.py compares both")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--reference-repeats", type=int, default=3,
                        help="runs of the machine's reference work printed above the targets (0: none)")
    parser.add_argument("--one-target", help=argparse.SUPPRESS)  # the fresh process measuring one target
    args = parser.parse_args(argv)
    if args.one_target:
        result = measure_first_call(args.one_target, args.seq_len, args.inner, args.compile_threads,
                                    args.inline_loop_bodies)
        print(json.dumps(result), flush=True)
        return result
    reference = reference_work.measure(args.reference_repeats) if args.reference_repeats > 0 else None
    if not args.json:
        print_row(f"first call of tiny's training step (forward + backward), T = {args.seq_len}, inner "
                  f"{args.inner}, empty Inductor cache, one fresh process per target; wall-clock seconds")
        if reference is not None:
            print_row(reference_work.text(reference))
    results = {}
    for target in args.targets:
        results[target] = in_fresh_process(target, args)
        if not args.json:
            for row in rows(target, results[target]):
                print_row(row)
    summary = {"seq_len": args.seq_len, "inner": args.inner, "reference_work": reference, "targets": results}
    if args.json:
        print(json.dumps(summary, indent=1))
    return summary


def in_fresh_process(target: str, args) -> dict:
    """Run `measure_first_call` for one target in a new Python process with an empty Inductor cache."""
    say(f"compiling for target {target} in a fresh process ...")
    with tempfile.TemporaryDirectory(prefix="bench_compile_") as cache_dir:
        # TMPDIR: Inductor keeps its precompiled header in the system's temporary folder, not in its cache
        # folder; a new one makes the header's build part of the first call, as on a new machine.
        os.makedirs(os.path.join(cache_dir, "tmp"))
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"),
               "TMPDIR": os.path.join(cache_dir, "tmp"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
               "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
        command = [sys.executable, "-m", "benchmarks.bench_compile", "--one-target", target,
                   "--seq-len", str(args.seq_len), "--inner", args.inner]
        if args.compile_threads is not None:
            command += ["--compile-threads", str(args.compile_threads)]
        if getattr(args, "inline_loop_bodies", False):
            command.append("--inline-loop-bodies")
        # stderr (the progress lines) goes straight through; stdout is the JSON result.
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(done.stdout.strip().splitlines()[-1])


def rows(target: str, result: dict) -> list[str]:
    total = result["total_s"]
    lines = [f"target {target}: first call {total:.1f} s, {result['cpu_s']:.1f} CPU s (this process and those it "
             f"started); a later call {result['second_call_s'] * 1e3:.0f} ms"]
    for stage in STAGES:
        seconds = result["stages"][stage]
        lines.append(f"  {stage:<24} {seconds:8.2f} s  {seconds / total:6.1%}")
    cxx = result["cxx"]
    lines.append(f"  g++ runs: {cxx['runs']}, {cxx['summed_s']:.1f} s summed over {result['compile_threads']} "
                 f"compile threads (overlapping the codegen and each other)")
    bodies = result["loop_bodies"]
    if bodies["compiled"]:
        lines.append(f"  GLA loop bodies compiled once per shape: {bodies['compiled']}, {bodies['seconds']:.1f} s "
                     f"({bodies['with_host_graph_s']:.1f} s with their host graph, the rest at a first call; "
                     f"{bodies['inductor_s']:.1f} s of it Inductor's, in its stages; the traces in our passes)")
    backward = result.get("backward_ahead", {})
    if backward.get("sent"):
        lines.append(f"  backward graphs sent to the helper process: {backward['sent']} ({backward['sent_s']:.1f} s), "
                     f"loaded from it: {backward['loaded']}, waited for and loaded in {backward['waited_s']:.1f} s")
    if bodies.get("from_helper"):
        lines.append(f"  GLA loop bodies compiled in the helper process: {bodies['from_helper']}, waited for and "
                     f"loaded in {bodies['helper_waited_s']:.1f} s")
    probes = result["isa_probes"]
    lines.append(f"  ISA probes: {probes['builds']} test libraries, {probes['background_s']:.1f} s summed in the "
                 f"background (two at a time, overlapping Dynamo, AOT Autograd and the passes)")
    header = result["kernel_header"]
    lines.append(f"  Inductor's precompiled header: {header['background_s']:.1f} s building in the background, "
                 f"{header['main_thread_s']:.1f} s on the main thread; the first kernel build waited {header['waited_s']:.1f} s "
                 f"for it (in the background; a kernel's first call waiting for that build is in the C++ compile's "
                 f"wait)")
    for name, graph in result["graphs"].items():
        lines.append(f"  graph {name:<12} {graph['nodes_before']:6d} -> {graph['nodes_after']:6d} nodes")
    return lines


def measure_first_call(target: str, seq_len: int, inner: str, compile_threads: int | None,
                       inline_loop_bodies: bool = False) -> dict:
    """Compile and run the training step once (forward and backward), timed by stage; then once more."""
    import torch
    import torch.nn.functional as F

    if compile_threads is not None:
        torch._inductor.config.compile_threads = compile_threads
    import laplace_passes
    import model_zoo
    from torch._dynamo.utils import compilation_time_metrics

    passes = PassSeconds.listening()
    isa_probes = time_isa_probes()
    header = time_kernel_header()
    bodies = BodySeconds.timing(isa_probes)
    backward = BackwardSeconds.timing()
    kernel_waits = time_kernel_waits()
    torch.manual_seed(0)
    model = model_zoo.build("tiny")
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len))

    def loss_of(ids):
        return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())

    step = laplace_passes.compile(loss_of, target=target, inner=inner, share_loop_bodies=not inline_loop_bodies)
    cpu_start = cpu_seconds()
    start = time.perf_counter()
    step(ids).backward()
    total = time.perf_counter() - start
    cpu = cpu_seconds() - cpu_start
    start = time.perf_counter()
    step(ids).backward()
    second = time.perf_counter() - start
    timed = {key: sum(times) for key, times in compilation_time_metrics.items()}
    return {
        "target": target, "seq_len": seq_len, "inner": inner, "total_s": total, "cpu_s": cpu, "second_call_s": second,
        "compile_threads": torch._inductor.config.compile_threads,
        "stages": stages(timed, passes.seconds, total, isa_probes.main_thread, isa_probes.waited, bodies,
                         kernel_waits.main_thread, backward),
        "loop_bodies": {"compiled": bodies.count, "seconds": bodies.total, "inductor_s": bodies.inductor,
                        "with_host_graph_s": bodies.ahead, "from_helper": bodies.helper_count,
                        "helper_waited_s": bodies.from_helper},
        "backward_ahead": {"sent": backward.sent, "sent_s": backward.sent_s, "loaded": backward.loaded,
                           "waited_s": backward.waited_s},
        "isa_probes": {"builds": isa_probes.calls, "background_s": isa_probes.background},
        "kernel_header": {"background_s": header.background, "main_thread_s": header.main_thread,
                          "waited_s": header.waited},
        "passes_per_graph_s": passes.per_graph,
        "cxx": {"runs": len(compilation_time_metrics.get("compile_file", [])), "summed_s": timed.get("compile_file", 0.0)},
        "graphs": {g.name: {"nodes_before": len(g.before.graph.nodes), "nodes_after": len(g.after.graph.nodes)}
                   for g in step.laplace_report.graphs},
    }


def cpu_seconds() -> float:
    """User and system CPU seconds of this process, its children waited for, and the live processes it started.

    Inductor's compile workers are live descendants (a sidecar process and its
    pool); the g++ they ran count in their children's seconds (/proc/PID/stat,
    Linux). Elsewhere: this process and its waited children only.
    """
    import resource

    return (rusage_seconds(resource.RUSAGE_SELF) + rusage_seconds(resource.RUSAGE_CHILDREN)
            + descendants_cpu_seconds(os.getpid()))


def stages(timed: dict[str, float], passes_s: float, total_s: float, probes_in_codegen_s: float = 0.0,
           probes_waited_s: float = 0.0, bodies: "BodySeconds | None" = None,
           kernels_waited_s: float = 0.0, backward: "BackwardSeconds | None" = None) -> dict[str, float]:
    """Non-overlapping wall-clock stages from torch's nested compile-time counters, our passes' and the ISA probes' seconds.

    `probes_in_codegen_s`: probes Inductor ran itself, inside its compile;
    `probes_waited_s`: the backend's wait for its background probes, before
    Inductor's compile (inside the backend call, outside Inductor's);
    `bodies`: the chunk-loop bodies compiled with their host graph (inside
    the backend call) and at their first call (outside it), with each one's
    Inductor seconds; `kernels_waited_s`: the first calls of kernels built in
    the background, waiting for their build (outside every compile);
    `backward`: the backward graph sent to the helper within the forward's
    compile (the part of it in Inductor's compile_fx_inner: its steps before
    the codegen), and the backward's wait for its answer (inside Inductor's).
    """
    bodies = bodies or BodySeconds()
    backward = backward or BackwardSeconds()
    dynamo = timed.get("_compile.compile_inner", 0.0)
    backend = timed.get("OutputGraph.call_user_compiler", 0.0)
    backward_compile = timed.get("backward._backward_impl", 0.0)  # a backward compiled at its first call
    inductor = timed.get("compile_fx_inner", 0.0)
    waited = timed.get("async_compile.wait", 0.0)
    host_inductor = inductor - bodies.ahead_inductor - bodies.first_call_inductor
    result = {
        "Dynamo trace": dynamo - backend,
        "AOT Autograd": (backend + backward_compile - passes_s - host_inductor - bodies.ahead - bodies.from_helper_ahead
                         - probes_waited_s - (backward.sent_s - backward.sent_inductor_s)),
        "our passes": passes_s + bodies.total - bodies.inductor,
        "backward sent ahead": backward.sent_s,
        "Inductor codegen": inductor - waited - probes_in_codegen_s - backward.sent_inductor_s - backward.waited_s,
        "Inductor's ISA probes": probes_in_codegen_s + probes_waited_s,
        "C++ compile (waited)": waited + kernels_waited_s,
        "helper process (waited)": bodies.from_helper + backward.waited_s,
    }
    result["other"] = total_s - sum(result.values())
    return result


class SecondsByThread:
    """Seconds of a function this benchmark wraps, summed by the thread that called it, and of a wait for it.

    `main_thread`: calls on the main thread; `background`: calls in other
    threads (the backend's background work); `calls`: how many; `waited`:
    the main thread's waits for the background calls.
    """

    def __init__(self):
        self.main_thread = self.background = self.waited = 0.0
        self.calls = 0

    def timed(self, fn):
        """`fn`, each call's seconds added to `main_thread` or `background` by the thread that made it."""
        import threading

        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls += 1
                if threading.current_thread() is threading.main_thread():
                    self.main_thread += time.perf_counter() - start
                else:
                    self.background += time.perf_counter() - start

        return timed_call

    def timed_wait(self, wait):
        """`wait`, its seconds added to `waited`."""

        def timed_call():
            start = time.perf_counter()
            try:
                return wait()
            finally:
                self.waited += time.perf_counter() - start

        return timed_call


def time_isa_probes() -> SecondsByThread:
    """Inductor's vector-ISA probes (`VecISA.check_build`), and the backend's wait for them.

    A probe builds a test library with g++ and loads it in a child process,
    for each instruction set the CPU reports. On the main thread: probes run
    inside Inductor's compile; in the background: probes the backend
    started in its own threads (NOTE [vector-ISA probes ahead of the
    codegen]); waited: `laplace_passes.infra.inner.wait_for_isa_probes`.
    """
    from torch._inductor import cpu_vec_isa

    from laplace_passes.infra import inner

    probes = SecondsByThread()
    cpu_vec_isa.VecISA.check_build = probes.timed(cpu_vec_isa.VecISA.check_build)  # this process only
    inner.wait_for_isa_probes = probes.timed_wait(inner.wait_for_isa_probes)
    return probes


def time_kernel_header() -> SecondsByThread:
    """Inductor's precompiled header for its C++ kernels (`codecache._precompile_header`), and the wait for it.

    In the background: built by the backend's background thread after the
    probes; on the main thread: by Inductor (a call that finds the header
    built takes milliseconds); waited: the first kernels' wait for the
    background build (`laplace_passes.infra.kernel_batches.wait_for_kernel_header`).
    """
    from torch._inductor import codecache

    from laplace_passes.infra import kernel_batches

    header = SecondsByThread()
    codecache._precompile_header = header.timed(codecache._precompile_header)  # this process only
    kernel_batches.wait_for_kernel_header = header.timed_wait(kernel_batches.wait_for_kernel_header)
    return header


class BodySeconds:
    """Seconds of the chunk-loop bodies compiled, and Inductor's share of them: with their host graph, at first call.

    Inductor's share: its `compile_fx_inner` counter's growth during each
    body's compile (the counter also holds the graphs the backend compiled).
    "ahead": compiled within `compile_ahead`, inside the backend call. A body
    compiled first waits there for the ISA probes: that wait is left out
    (it is the stage "Inductor's ISA probes"). `from_helper`: the waits for
    bodies the helper process compiled, and their loading (`from_helper_ahead`
    within `compile_ahead`); `helper_count`: how many.
    """

    def __init__(self):
        self.count = self.helper_count = 0
        self.ahead = self.ahead_inductor = self.first_call = self.first_call_inductor = 0.0
        self.from_helper = self.from_helper_ahead = 0.0
        self._ahead_depth = 0

    @property
    def total(self) -> float:
        return self.ahead + self.first_call

    @property
    def inductor(self) -> float:
        return self.ahead_inductor + self.first_call_inductor

    @classmethod
    def timing(cls, probes: SecondsByThread | None = None) -> "BodySeconds":
        """Times every body compiled from now on; a wait for the ISA `probes` within one is left to that stage."""
        from torch._dynamo.utils import compilation_time_metrics

        from laplace_passes.unroll import split
        from laplace_passes.unroll.compiled_bodies import BODIES

        seconds = cls()
        compiled, from_helper, compile_ahead = BODIES._compiled, BODIES._from_helper, split.compile_ahead

        def inductor_so_far() -> float:
            return sum(compilation_time_metrics.get("compile_fx_inner", []))

        def probes_waited() -> float:
            return probes.waited if probes is not None else 0.0

        def timed_compiled(op, args, key):
            start, inductor_start, probes_start = time.perf_counter(), inductor_so_far(), probes_waited()
            try:
                return compiled(op, args, key)
            finally:
                seconds.count += 1
                elapsed = time.perf_counter() - start - (probes_waited() - probes_start)
                in_inductor = inductor_so_far() - inductor_start
                if seconds._ahead_depth:
                    seconds.ahead, seconds.ahead_inductor = seconds.ahead + elapsed, seconds.ahead_inductor + in_inductor
                else:
                    seconds.first_call += elapsed
                    seconds.first_call_inductor += in_inductor

        def timed_from_helper(*args):
            start = time.perf_counter()
            try:
                body = from_helper(*args)
            finally:
                elapsed = time.perf_counter() - start
                seconds.from_helper += elapsed
                seconds.from_helper_ahead += elapsed if seconds._ahead_depth else 0.0
            seconds.helper_count += body is not None
            return body

        def timed_compile_ahead(gm, kind="inference"):
            seconds._ahead_depth += 1
            try:
                return compile_ahead(gm, kind)
            finally:
                seconds._ahead_depth -= 1

        BODIES._compiled = timed_compiled  # this benchmark's own process only
        BODIES._from_helper = timed_from_helper
        split.compile_ahead = timed_compile_ahead
        return seconds


class BackwardSeconds:
    """The backward graph sent to the helper as the forward compiles, and the wait for its answer.

    NOTE [backward graphs generated in the helper process] in
    `laplace_passes/driver/backward_ahead.py`. `sent_s`: the forward's
    compile sending it (the backward's passes and its compile up to the
    codegen, here); `sent_inductor_s`: the part of that in Inductor's
    compile_fx_inner; `waited_s`: the backward's wait for the answer and its
    loading; `sent`, `loaded`: how many.
    """

    def __init__(self):
        self.sent = self.loaded = 0
        self.sent_s = self.sent_inductor_s = self.waited_s = 0.0

    @classmethod
    def timing(cls) -> "BackwardSeconds":
        from torch._dynamo.utils import compilation_time_metrics

        from laplace_passes.driver.backward_ahead import BackwardAhead
        from laplace_passes.infra import remote_codegen

        seconds = cls()
        send, wait_and_load = BackwardAhead.send, remote_codegen.wait_and_load

        def timed_send(self, *args):
            start, inductor_start = time.perf_counter(), sum(compilation_time_metrics.get("compile_fx_inner", []))
            try:
                sent = send(self, *args)
            finally:
                seconds.sent_s += time.perf_counter() - start
                seconds.sent_inductor_s += sum(compilation_time_metrics.get("compile_fx_inner", [])) - inductor_start
            seconds.sent += bool(sent)
            return sent

        def timed_wait_and_load(*args):
            start = time.perf_counter()
            try:
                loaded = wait_and_load(*args)
            finally:
                seconds.waited_s += time.perf_counter() - start
            seconds.loaded += 1
            return loaded

        BackwardAhead.send = timed_send  # this benchmark's own process only
        remote_codegen.wait_and_load = timed_wait_and_load
        return seconds


def time_kernel_waits() -> SecondsByThread:
    """The first calls of kernels built in the background, waiting for their build (`kernel_batches.Batch.function`)."""
    from laplace_passes.infra import kernel_batches

    waits = SecondsByThread()
    kernel_batches.Batch.function = waits.timed(kernel_batches.Batch.function)  # this process only
    return waits


class PassSeconds(logging.Handler):
    """Adds up the seconds of "NAME: the passes" from the laplace.progress logger (`laplace_passes.infra.logs`)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.per_graph: dict[str, float] = {}

    @property
    def seconds(self) -> float:
        return sum(self.per_graph.values())

    def emit(self, record: logging.LogRecord) -> None:
        what = getattr(record, "laplace_what", "")
        if what.endswith(": the passes"):
            graph = what.removesuffix(": the passes")
            self.per_graph[graph] = self.per_graph.get(graph, 0.0) + record.laplace_seconds

    @classmethod
    def listening(cls) -> "PassSeconds":
        handler = cls()
        progress = logging.getLogger("laplace.progress")
        progress.setLevel(logging.INFO)
        progress.addHandler(handler)
        shown = logging.StreamHandler(sys.stderr)  # the progress lines, for a compile of minutes
        shown.setFormatter(logging.Formatter("  %(message)s"))
        progress.addHandler(shown)
        return handler


if __name__ == "__main__":
    main()
