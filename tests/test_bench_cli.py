"""`laplace-passes bench unroll|muon|decode|recognise|compile|paths|mamba2`, smallest arguments: their figures agree.

Performance is never asserted: each check is that a printed figure is what
the other printed figures (or a formula written here) make it, so a ratio
upside down, a sum that misses a part or a wrong formula fails. `bench gla`
is checked in test_cli.py. `bench lowering` is not run here: lowering even
its smallest point with torch-mlir takes about a minute on 2 cores.
`bench_loops` is checked on a small graph of its own (its GLA shapes compile
for a minute): every loop clocked, copies and fills told from computation.
"""

import io
import json
import math
import re
import sys

import pytest

from laplace_passes.tools.cli import main


def bench(capfd, *args) -> str:
    assert main(["bench", *args]) == 0, capfd.readouterr().err[-3000:]
    return capfd.readouterr().out


def test_bench_unroll_sizes_add_up_per_layer_and_partitions_fit_the_budget(capfd):
    budget = 300  # between the tiny model's graphs at T = 128 (about 210 to 860 instructions): some are cut
    results = json.loads(bench(capfd, "unroll", "--model", "tiny", "--layers", "1", "2", "--seq-len", "128",
                               "--budget", str(budget), "--json"))
    assert [r["layers"] for r in results] == [1, 2]
    for result in results:
        assert set(result["graphs"]) >= {"forward_0", "backward_0"}
        for name, graph in result["graphs"].items():
            by_layer = graph["by_layer"]
            # Every node and instruction is attributed to one layer or to "other", and each layer has its own.
            assert sum(by_layer["nodes"].values()) == graph["nodes"], name
            assert sum(by_layer["instructions"].values()) == graph["instructions"], name
            assert set(by_layer["nodes"]) - {"other"} == {str(i) for i in range(result["layers"])}, name
            assert graph["budget"] == budget
            # The fewest partitions that fit: none over the budget, and no fewer than the size demands.
            assert graph["partitions"] >= math.ceil(graph["instructions"] / budget), name
            if graph["partitions"] > 1:
                assert len(graph["partition_instructions"]) == graph["partitions"], name
                assert max(graph["partition_instructions"]) <= budget, name
    assert any(g["partitions"] > 1 for r in results for g in r["graphs"].values())
    one, two = results
    for name in one["graphs"]:  # the layers are alike: each layer of the deeper model is the one layer's size
        layer = {key: one["graphs"][name]["by_layer"][key]["0"] for key in ("nodes", "instructions")}
        for key in ("nodes", "instructions"):
            assert two["graphs"][name]["by_layer"][key]["0"] == two["graphs"][name]["by_layer"][key]["1"] == layer[key]


def test_bench_decode_rates_rooflines_and_state_agree(capfd):
    """One repeat, so every printed median is that repeat's figure and each ratio follows from the others.

    Batch sizes 2 and 3 share one compiled decode step (its batch is dynamic from 2 on), where 1 and 3 took two.
    With --gate-checks, the step compiled with gate_checks="always" is timed in the same repeat.
    """
    result = json.loads(bench(capfd, "decode", "--sequences", "2", "3", "--steps", "1", "--repeats", "1",
                              "--generate-steps", "2", "--gate-checks", "--json"))
    (bandwidth,), (matmul_rate,) = result["copy_GB_per_s"], result["matmul_GFLOP_per_s"]
    weights = result["bytes_per_step"]["weights"]
    state_rw = result["bytes_per_step"]["state_read_and_written_per_sequence"]
    assert sorted(int(b) for b in result["decode"]) == [2, 3]
    for batch, row in result["decode"].items():
        batch = int(batch)
        # Memory roofline: every step reads the weights once and each sequence's state twice (read, write).
        assert row["memory_roofline"]["median"] == pytest.approx(batch * bandwidth * 1e9 / (weights + batch * state_rw))
        assert row["matmul_roofline"]["median"] == pytest.approx(matmul_rate * 1e9 / result["flops_per_token"])
        binding = min(row["memory_roofline"]["median"], row["matmul_roofline"]["median"])
        for form in ("eager", "compiled", "generate"):
            rate = row[form]["median"]  # generate's is a difference of two times: its sign is not checked
            assert form == "generate" or 0 < rate < math.inf
            for roof in ("memory_roofline", "matmul_roofline"):
                assert row[f"{form}_share_of_{roof}"]["median"] == pytest.approx(rate / row[roof]["median"])
            assert row[f"{form}_share_of_binding_roofline"]["median"] == pytest.approx(rate / binding)
        matmuls = row["matmuls_alone"]["median"]
        assert row["matmuls_alone_share_of_binding_roofline"]["median"] == pytest.approx(matmuls / binding)
        with_states = row["matmuls_and_states"]["median"]
        assert 0 < with_states < math.inf
        assert row["matmuls_and_states_share_of_binding_roofline"]["median"] == pytest.approx(with_states / binding)
        state_traffic = bandwidth * 1e9 / state_rw  # tokens/s if a step only read and wrote the states
        assert row["sequential_share_of_binding_roofline"]["median"] == pytest.approx(
            1 / (1 / matmuls + 1 / state_traffic) / binding)
        assert row["compiled_over_eager"]["median"] == pytest.approx(row["compiled"]["median"] / row["eager"]["median"])
        assert 0 < row["checked"]["median"] < math.inf
        assert row["compiled_over_checked"]["median"] == pytest.approx(
            row["compiled"]["median"] / row["checked"]["median"])
    for row in result["state"]:
        contexts = sorted(int(key.rsplit("_", 1)[1]) for key in row if key.startswith("kv_bytes_"))
        assert len(contexts) >= 2, row
        for context in contexts:
            assert row[f"kv_over_state_{context}"] == pytest.approx(row[f"kv_bytes_{context}"] / row["state_bytes"])
            # A KV cache grows with the context; the recurrent state does not.
            assert row[f"kv_bytes_{context}"] == row[f"kv_bytes_{contexts[0]}"] * context // contexts[0]


TRAFFIC_ROW = re.compile(
    r"^\s*(?P<W>\d+)\s+(?P<comm>\w+)\s+(?P<G>[\d.]+) MB\s+(?P<before>[\d.]+) MB\s+(?P<after>[\d.]+) MB\s+"
    r"(?P<ratio>[\d.]+)x\s+(?P<half_W>[\d.]+)\s+(?P<ratio_over_half_W>[\d.]+)\s+(?P<bound>[\d.]+) MB\s+"
    r"(?P<after_over_bound>[\d.]+)\s", re.MULTILINE)


def test_bench_decode_state_updates_are_the_recurrence_before_each_output_projection():
    """The updates timed beside the step's matmuls: each advances its layer's buffer as the reference op does,
    and runs before that layer's output projection."""
    import torch

    import model_zoo
    from benchmarks.bench_decode import StateUpdates, _linears
    from laplace_passes.ops.gla import gla_op

    model = model_zoo.build("tiny")
    updates = StateUpdates(model, batch=3)
    linears = _linears(model)
    assert {linears[i]: layer for i, layer in updates.before.items()} == {
        block.attn.o_proj: layer for layer, block in enumerate(model.layers)}
    updates.buffers[1].normal_()
    for layer, buffer in enumerate(updates.buffers):
        o_ref, state_ref = gla_op(*updates.inputs, buffer.clone(), updates.scale, "test")
        o = updates(layer)
        torch.testing.assert_close(o, o_ref)
        torch.testing.assert_close(buffer, state_ref)


def test_bench_muon_traffic_ratios_follow_from_the_bytes_printed(capfd):
    """The traffic part at W = 4 on the tiny model (the step-time part needs 4 gloo processes for minutes)."""
    out = bench(capfd, "muon", "--part", "traffic", "--models", "tiny", "--world-sizes", "4")
    rows = [{k: (v if k == "comm" else float(v)) for k, v in m.groupdict().items()} for m in TRAFFIC_ROW.finditer(out)]
    assert sorted(row["comm"] for row in rows) == ["all_gather", "gather_broadcast"], out
    for row in rows:
        W, G = row["W"], row["G"]
        assert W == 4 and row["half_W"] == W / 2
        assert row["ratio"] == pytest.approx(row["before"] / row["after"], rel=0.01)
        assert row["ratio_over_half_W"] == pytest.approx(row["ratio"] / (W / 2), rel=0.01)
        assert row["bound"] == pytest.approx(2 * (W - 1) * G / W**2, rel=0.01)  # README's lower bound
        assert row["after_over_bound"] == pytest.approx(row["after"] / row["bound"], rel=0.01)
        assert row["after"] >= row["bound"] * 0.999
    (gather,) = [row for row in rows if row["comm"] == "all_gather"]
    assert gather["before"] == pytest.approx((gather["W"] - 1) * gather["G"] / gather["W"], rel=0.01)


def test_bench_decode_profiles_the_sequences_asked_for(capfd):
    """--profile splits a step of each batch size given (it profiled 1, 64 and 1280 whatever was asked)."""
    out = bench(capfd, "decode", "--profile", "--sequences", "2", "--steps", "1")
    rows = re.findall(r"^\s+(\d+) sequences, (\w+)\s+([\d.]+) ms: (.*)$", out, re.MULTILINE)
    assert [(batch, form) for batch, form, _, _ in rows] == [("2", "eager"), ("2", "compiled")], out
    for _, _, total, parts in rows:  # the parts add up to the step's total
        shares = re.findall(r"[\w ()/,]+? ([\d.]+) \(\d+%\)", parts)
        assert sum(map(float, shares)) == pytest.approx(float(total), abs=0.01 * len(shares)), parts


def test_bench_recognise_node_counts_do_not_grow_with_the_loop(capfd):
    """The recognised loop's ATen graphs are the op spelling's plus a constant at two lengths, while without
    recognition they grow with the loop."""
    counts = {}
    for T in (8, 24):  # short loops: the counts' growth, not their size, is the point
        out = bench(capfd, "recognise", "--part", "compile", "--T", str(T))
        rows = dict(re.findall(r"  (laplace_passes.gla|token loop, recognised|token loop, recognise_gla=False)\s+"
                               r"([\d.]+ s\s+forward\s+[\d,]+ nodes\s+backward\s+[\d,]+ nodes)", out))
        parsed = {name: [float(x.replace(",", "")) for x in re.findall(r"[\d.,]+", row)] for name, row in rows.items()}
        counts[T] = {name: values[1:] for name, values in parsed.items()}
    for T in counts:  # forward and backward nodes: the op's plus the same constant at every length
        assert counts[T]["token loop, recognised"][0] - counts[T]["laplace_passes.gla"][0] == \
            counts[8]["token loop, recognised"][0] - counts[8]["laplace_passes.gla"][0]
    unrecognised = [counts[T]["token loop, recognise_gla=False"][0] for T in (8, 24)]
    assert unrecognised[1] > 2 * unrecognised[0]  # without recognition every step is in the graph


PLAN_ROW = re.compile(r"^\s+(?P<model>\S+)\s+(?P<W>\d+)\s+(?P<plan>all-gather baseline|branch-free \(uniform\)|"
                      r"balanced \(a cond per owner\))\s+(?P<received>[\d.]+) MB\s+(?P<bytes_x>[\d.]+)\s+"
                      r"(?P<gflop>[\d.]+)\s+(?P<flops_x>[\d.]+)\s+(?P<zeros>\d+)$", re.M)


def test_bench_muon_plans_against_the_baseline_formula_and_the_pass(capfd):
    """The branch-free and balanced plans at W = 4 on the demo's model: the baseline's bytes from the shapes,
    the ratios from the printed figures, and the plans the same as the Muon pass's own table for that step."""
    from benchmarks.bench_muon import muon_shapes, traffic_through_backend

    out = bench(capfd, "muon", "--part", "plans", "--models", "tiny", "--world-sizes", "4")
    rows = {m["plan"]: m.groupdict() for m in PLAN_ROW.finditer(out)}
    assert set(rows) == {"all-gather baseline", "branch-free (uniform)", "balanced (a cond per owner)"}, out
    shapes = muon_shapes("tiny")
    baseline = float(rows["all-gather baseline"]["received"]) * 1e6
    assert baseline == pytest.approx(3 * sum(-(-r // 4) * c for r, c in shapes) * 2, rel=1e-3)
    for row in rows.values():
        assert float(row["bytes_x"]) == pytest.approx(float(row["received"]) * 1e6 / baseline, abs=2e-3)
    assert int(rows["branch-free (uniform)"]["zeros"]) > 0 and int(rows["balanced (a cond per owner)"]["zeros"]) == 0
    import torch.distributed as dist

    try:
        traffic = traffic_through_backend(shapes, 4, "all_gather")  # the pass on the captured step, target cpu
    finally:  # its fake process group of 4 would stay this test process's world for the tests after it
        if dist.is_initialized():
            dist.destroy_process_group()
    by_kind = {p["kind"]: p for p in traffic.plans}
    for kind, plan in (("uniform", "branch-free (uniform)"), ("balanced", "balanced (a cond per owner)")):
        assert by_kind[kind]["received"] / 1e6 == pytest.approx(float(rows[plan]["received"]), abs=1e-3)
        assert by_kind[kind]["ns_flops"] / 1e9 == pytest.approx(float(rows[plan]["gflop"]), abs=6e-3)


class Screen(io.StringIO):
    """stdout as a reader sees it: what was written shows only once it is flushed."""

    def __init__(self):
        super().__init__()
        self.shown = ""

    def flush(self):
        self.shown = self.getvalue()


def fake_depth(layers: int, *args, **kwargs) -> dict:
    graph = {"nodes": 10 * layers, "instructions": 100 * layers, "budget": 1000, "partitions": 1, "cut_bytes": [],
             "by_layer": {"nodes": {}, "instructions": {}}, "saved_for_backward_bytes": None}
    return {"model": "tiny", "seq_len": 128, "layers": layers, "passes_s": 0.1, "pipeline_s": 0.2, "inspect_s": 0.3,
            "graphs": {"forward_0": graph}}


def test_bench_unroll_shows_each_depth_as_soon_as_it_is_measured(monkeypatch):
    from benchmarks import bench_unroll

    screen = Screen()
    shown_at_each_measure = []

    def measure(layers, *args, **kwargs):
        shown_at_each_measure.append(screen.shown)
        return fake_depth(layers)

    monkeypatch.setattr(bench_unroll, "measure", measure)
    monkeypatch.setattr(sys, "stdout", screen)
    bench_unroll.main(["--layers", "1", "2", "3"])
    warmup, first, second, third = shown_at_each_measure
    assert warmup == first == "" and "\n1 layers:" in second and "\n2 layers:" in third and "\n3 layers" not in third
    assert "\n3 layers:" in screen.shown and "growth with depth" in screen.shown


def test_interleaved_rounds_are_said_on_stderr_as_they_end(capsys):
    from benchmarks.common import interleaved_samples

    samples = interleaved_samples({"a": lambda: None, "b": lambda: None}, repeats=2)
    err = capsys.readouterr().err
    assert re.findall(r"round (\d)/2: a [\d.]+ ms, b [\d.]+ ms", err) == ["1", "2"]
    assert "warming up a (a first call compiles) ..." in err and "warming up b" in err
    assert [len(times) for times in samples.values()] == [2, 2]


# The machine's reference work above the compile figures: one run each (median = min = max), or no g++ figure.
REFERENCE_LINE = re.compile(r"^  reference work, CPU seconds on one thread .*: "
                            r"python (?P<py>[\d.]+) \[(?P=py)-(?P=py)\] s, "
                            r"(g\+\+ (?P<cxx>[\d.]+) \[(?P=cxx)-(?P=cxx)\] s"
                            r"|g\+\+ not timed \(no compiler, or it failed\))$", re.M)


def test_reference_work_times_the_compiler_inductor_uses_and_says_when_it_cannot():
    import shutil

    from torch._inductor.cpp_builder import get_cpp_compiler

    from benchmarks import reference_work

    assert reference_work.python_seconds() > 0
    if shutil.which(get_cpp_compiler()) is not None:  # the g++ child's own CPU seconds, not this process's
        assert reference_work.compiler_seconds() > 0.05
    original = reference_work.compiler_command
    try:
        for command in (["/nonexistent/c++"], ["false"]):  # missing, and a compile that fails
            reference_work.compiler_command = lambda source, output, command=command: command
            assert reference_work.compiler_seconds() is None
            reference = reference_work.measure(repeats=1)
            assert reference["cxx_s"] is None
            assert REFERENCE_LINE.search(reference_work.text(reference))
            assert reference_work.text(reference).endswith("g++ not timed (no compiler, or it failed)")
    finally:
        reference_work.compiler_command = original


def test_bench_compile_splits_the_first_call_into_stages_within_its_total(capfd):
    """Inner eager, T = 64: seconds. Each stage one row; the named stages never add up past the first call."""
    from benchmarks.bench_compile import STAGES

    out = bench(capfd, "compile", "--seq-len", "64", "--targets", "cpu", "--inner", "eager", "--reference-repeats", "1")
    assert REFERENCE_LINE.search(out), out
    total = float(re.search(r"^target cpu: first call ([\d.]+) s", out, re.M).group(1))
    seconds = {}
    for stage in STAGES:
        rows = re.findall(rf"^  {re.escape(stage)} +(-?[\d.]+) s +(-?[\d.]+)%$", out, re.M)
        assert len(rows) == 1, (stage, out)
        seconds[stage], share = map(float, rows[0])
        # Printed rounded (stage to 0.01 s, share to 0.1%, total to 0.1 s): checked to what the rounding leaves.
        leeway = 0.1 + 100 * 0.01 / total + share * 0.05 / total
        assert share == pytest.approx(100 * seconds[stage] / total, abs=leeway), stage
    # "other" is what the named stages leave of the total: never negative, and the rows add up to the total,
    # to the printing's rounding: the total's (0.05 s) and each row's (0.005 s; 2.66 against 2.6 was seen).
    assert seconds["other"] >= 0, out
    assert sum(seconds.values()) == pytest.approx(total, abs=0.05 + 0.005 * len(STAGES))
    assert seconds["our passes"] > 0 and seconds["Dynamo trace"] > 0 and seconds["AOT Autograd"] > 0
    # No Inductor with inner eager: no codegen, no C++, no ISA probes and no body compiled in the helper.
    assert seconds["Inductor codegen"] == seconds["C++ compile (waited)"] == seconds["Inductor's ISA probes"] == 0
    assert seconds["helper process (waited)"] == seconds["backward sent ahead"] == 0
    graphs = dict(re.findall(r"^  graph (\w+) +\d+ -> +(\d+) nodes$", out, re.M))
    assert set(graphs) == {"dynamo_0", "forward_0", "backward_0"}, out


PATH_ROW = re.compile(r"^(?P<path>(?:prefill|decode|GLA|compile)\S*.*?)  +(?P<median>-?[\d.,]+)(?P<unit>x|%| s)(?![\w.])"
                      r".*?  (?P<comparison><=|>=) (?P<goal>[\d.]+)(?P<goal_unit>x|%| s)  +(?P<met>yes|no)$", re.M)


def test_bench_paths_quick_prints_every_row_of_the_table_with_a_figure(capfd):
    """Every path of the goal table, one row each, under the machine's figures; met agrees with figure and goal."""
    out = bench(capfd, "paths", "--quick")
    assert re.search(r"^machine: .+, \d+ cores, torch .+ with \d+ threads$", out, re.M), out
    assert re.search(r"^  copy bandwidth [\d.]+ \[[\d.]+-[\d.]+\] GB/s; dense fp32 matmul [\d.]+ \[[\d.]+-[\d.]+\] "
                     r"GFLOP/s$", out, re.M), out
    assert REFERENCE_LINE.search(out), out
    rows = [m.groupdict() for m in PATH_ROW.finditer(out)]
    assert [(r["path"].split(":")[0].split()[0], r["comparison"], r["goal"], r["goal_unit"]) for r in rows] == [
        ("prefill", "<=", "1.25", "x"), ("decode", ">=", "60", "%"), ("GLA", ">=", "50", "%"),
        ("compile", "<=", "25", " s"), ("compile", "<=", "40", " s"), ("GLA", ">=", "50", "%")], out
    assert rows[3]["path"].endswith("cpu") and rows[4]["path"].endswith("trn2")
    # The decode and GLA rows carry their ceiling: the path's matmuls alone, timed in the same run.
    ceilings = re.findall(r"^(decode|GLA)\b.*; its matmuls alone (\d+)%\)", out, re.M)
    assert [name for name, _ in ceilings] == ["decode", "GLA", "GLA"] and all(int(p) > 0 for _, p in ceilings), out
    # The GLA row once more, last: after keep_freed_memory, which stays for the rest of the process.
    assert "freed memory kept" in rows[5]["path"] and "freed memory kept" not in rows[2]["path"], out
    for r in rows:
        value, goal = float(r["median"].replace(",", "")), float(r["goal"])
        assert r["unit"].strip() == r["goal_unit"].strip(), r
        if value == goal:  # printed rounded: a figure that rounds to its goal may lie on either side of it
            continue
        met = value <= goal if r["comparison"] == "<=" else value >= goal
        assert r["met"] == ("yes" if met else "no"), r


def test_bench_paths_judges_the_gla_row_by_the_share_it_prints(monkeypatch):
    """Rounds whose median share is below the goal while the share of the two medians is above it: the row
    says the median of the rounds and, by that figure, not met (a noisy run once printed 47.3% beside "yes")."""
    from benchmarks import bench_gla, bench_paths

    rounds = [0.44, 0.45, 0.47, 0.55, 0.62]
    result = {"compiled_fraction_per_round": rounds, "compiled_fraction_of_matmul": 0.51, "compiled_gflops": 87.0,
              "compiled_matmuls_fraction_per_round": [0.7, 0.8, 0.75]}
    monkeypatch.setattr(bench_gla, "measure", lambda *args, **kwargs: result)
    (gla_row,) = bench_paths.measure_gla(bench_paths.QUICK)
    assert gla_row.figure.startswith("47.0% [44.0%-62.0%]"), gla_row.figure
    assert gla_row.figure.endswith("(87 GFLOP/s; its matmuls alone 75%)"), gla_row.figure
    assert gla_row.value == 0.47 and not gla_row.met, gla_row


def test_bench_paths_prints_the_default_decode_beside_the_jit_step_repeat_by_repeat(monkeypatch):
    """Two decode rows where the full table asks for the ahead-of-time step: the JIT step's and the default's
    (after a decode="ahead-of-time" call, saying what it ran) median share of the roofline, and the default's
    ratio to the JIT step taken per repeat, not of the two medians."""
    from benchmarks import bench_paths

    def measured(model, sequences, steps, prompt_len, repeats, modes, warm_up):
        assert modes == ("compiled", "auto") and warm_up == ("compiled", "ahead-of-time", "auto")
        return {"compiled": {"tokens_per_s": [100.0, 300.0, 200.0], "share_of_binding_roofline": [0.5, 0.6, 0.55]},
                "auto": {"tokens_per_s": [150.0, 240.0, 260.0], "share_of_binding_roofline": [0.7, 0.5, 0.65]},
                "matmuls_alone_share": [0.9], "binding": "matmul", "default_ran": "the library compiled ahead of time"}

    monkeypatch.setattr(bench_paths, "decode_steps_through_generate", measured)
    monkeypatch.setattr(bench_paths, "tiny", lambda inner: None)
    sizes = {**bench_paths.QUICK, "decode": {**bench_paths.QUICK["decode"], "ahead_of_time": True}}
    jit, default = bench_paths.measure_decode(sizes)
    assert "decode='compiled'" in jit.path and jit.value == 0.55 and not jit.met
    assert "default steps, which ran the library compiled ahead of time" in default.path
    assert default.value == 0.65 and default.met
    assert default.figure.endswith("; 1.30x [0.80x-1.50x] the JIT step's tokens/s"), default.figure


def test_bench_decode_ratio_of_the_ahead_of_time_step_is_per_repeat():
    from benchmarks.bench_decode import AHEAD, GENERATE, GENERATE_AHEAD, _summary

    samples = {form: [1.0, 2.0, 4.0] for form in ("eager", "compiled", "matmuls_alone", "matmuls_and_states",
                                                   "memory_roofline", "matmul_roofline", "state_traffic")}
    samples.update({GENERATE: [2.0, 4.0, 1.0], GENERATE_AHEAD: [3.0, 4.0, 2.0], AHEAD: [3.0, 8.0, 4.0]})
    row = _summary(samples)
    assert row["ahead_of_time_over_generate"]["median"] == pytest.approx(1.5)  # of 1.5, 1.0 and 2.0
    assert row["ahead_of_time_over_compiled"]["median"] == pytest.approx(3.0)  # of 3, 4 and 1
    assert row[f"{GENERATE_AHEAD}_share_of_binding_roofline"]["median"] == pytest.approx(2.0)  # of 3, 2 and 0.5
    without = _summary({k: v for k, v in samples.items() if k not in (AHEAD, GENERATE_AHEAD)})
    assert "ahead_of_time_over_generate" not in without and "ahead_of_time_over_compiled" not in without


def test_bench_paths_says_in_the_table_why_the_freed_memory_row_is_not_measured(monkeypatch):
    """Where keep_freed_memory is refused (a C library other than glibc), the row is in the table, saying so."""
    import laplace_passes
    from benchmarks import bench_paths

    def refused():
        raise OSError("the C library is not glibc: keep_freed_memory sets glibc's malloc thresholds only")

    monkeypatch.setattr(laplace_passes, "keep_freed_memory", refused)
    monkeypatch.setattr(bench_paths, "measure_gla", lambda sizes: pytest.fail("measured after a refusal"))
    (kept_row,) = bench_paths.measure_gla_freed_memory_kept(bench_paths.QUICK)
    text = bench_paths.row_text(kept_row)
    assert "freed memory kept" in text and "not measured: the C library is not glibc" in text, text
    assert text.endswith("no") and not kept_row.met and kept_row.value is None  # JSON has no NaN


def test_bench_loops_times_every_loop_of_a_graph_and_tells_copies_from_computation():
    import torch

    from benchmarks import bench_loops

    def step(x, y):
        return x.t().contiguous(), (y.exp() * 2).sum(-1), torch.zeros(33, 40)

    x, y = torch.randn(96, 80), torch.randn(64, 48)
    with torch._inductor.config.patch({"cpp.threads": 2}):  # OpenMP loops, as outside the suite's one thread
        compiled = torch.compile(step, backend="inductor")
        ((code, inputs),) = bench_loops.graphs_called(lambda: compiled(x, y))
    assert [tuple(t.shape) for t in inputs] == [(96, 80), (64, 48)]
    assert bench_loops.instrument(code).count("loop_clock.lap(") == code.count("#pragma omp for") > 0
    call_seconds, loops = bench_loops.time_loops(code, inputs, calls=3)
    assert [(loop.kernel, loop.index) for loop in loops] == [
        (loop.kernel, loop.index) for loop in bench_loops.describe_loops(code)]
    by_kind = {kind: [loop for loop in loops if loop.kind == kind] for kind in ("copy", "fill", "computes")}
    assert [math.prod(int(e) for e in loop.extents) for loop in by_kind["copy"]] == [96 * 80], loops
    assert [math.prod(int(e) for e in loop.extents) for loop in by_kind["fill"]] == [33 * 40], loops
    assert by_kind["computes"] and all(loop.reads >= 1 for loop in by_kind["computes"]), loops
    # The loops run inside the calls timed around them: their sum cannot exceed the calls' time.
    assert all(loop.seconds >= 0 for loop in loops) and 0 < sum(loop.seconds for loop in loops) < call_seconds


def test_bench_loops_refuses_kernels_it_cannot_clock():
    from benchmarks import bench_loops

    kernel = ("cpp_fused_0 = async_compile.cpp_pybinding(['float*'], r'''\n"
              "#include <torch/csrc/inductor/cpp_prefix.h>\n"
              "extern \"C\" void kernel(float* out_ptr0) { out_ptr0[0] = 1; }\n''')")
    with pytest.raises(ValueError, match="cannot be timed"):
        bench_loops.instrument(kernel)


def test_matmuls_alone_are_the_products_a_call_ran_each_counted_once():
    """The ceiling's products: every mm / bmm / addmm / baddbmm at its recorded shapes, none inside another
    counted again, FLOPs from the shapes; running them again writes outputs of the products' shapes."""
    import torch

    from benchmarks.matmuls_alone import MatmulsAlone

    a, b, bias = torch.randn(8, 4), torch.randn(4, 5), torch.randn(5)
    x, y = torch.randn(2, 3, 4), torch.randn(2, 4, 6)

    def call():
        torch.mm(a, b)
        torch.addmm(bias, a, b)
        torch.bmm(x, y)
        torch.baddbmm(torch.zeros(2, 3, 6), x, y)
        (a + 1).relu()  # not a product

    matmuls = MatmulsAlone.of(call)
    assert dict(matmuls.shapes) == {("aten::mm", (8, 4), (4, 5)): 1, ("aten::addmm", (8, 4), (4, 5)): 1,
                                    ("aten::bmm", (2, 3, 4), (2, 4, 6)): 1, ("aten::baddbmm", (2, 3, 4), (2, 4, 6)): 1}
    assert len(matmuls) == 4
    assert matmuls.flops == 2 * (2 * 8 * 4 * 5) + 2 * (2 * 2 * 3 * 4 * 6)
    matmuls()


def test_bench_mamba2_times_the_scan_as_written_and_as_one_gla_site(capfd):
    pytest.importorskip("transformers")
    from benchmarks import bench_mamba2

    result = bench_mamba2.main(["--paths", "eager", "laplace", "--T", "64", "--H", "2", "--P", "8", "--N", "8",
                                "--chunk", "16", "--repeats", "2"])
    out, err = capfd.readouterr()
    assert "laplace: GLA site: chunked form with no loop over its 4 chunks of 16 tokens" in err, err
    assert set(result["ms"]) == {"eager", "laplace"} and all(ms > 0 for ms in result["ms"].values())
    for path, ms in result["ms"].items():
        assert f"{path:<17} {ms:8.1f} ms  {result['ms']['eager'] / ms:5.2f}x eager" in out, out


def test_bench_recompile_reuses_the_traces_it_says_it_reuses(capfd, monkeypatch):
    """Of its four compiles (a warm-up and a round of each), the reused one after the warm-up traces no
    chunk-loop body and the others trace both (the forward's and the backward's); its row is printed."""
    from benchmarks import bench_recompile
    from laplace_passes.infra.fx_helpers import GraphsAcrossModes
    from laplace_passes.unroll import chunk_loops

    traces = []
    trace_here = chunk_loops.ChunkLoopExpander._traced
    monkeypatch.setattr(chunk_loops.ChunkLoopExpander, "_traced",
                        lambda self, *args: traces.append(1) or trace_here(self, *args))
    monkeypatch.setattr(chunk_loops, "_ACROSS_MODES", GraphsAcrossModes(4))  # none from earlier tests
    (result,) = bench_recompile.main(["--seq-len", "64", "--targets", "trn2", "--repeats", "1"])
    assert len(traces) == 3 * 2
    out, _ = capfd.readouterr()
    assert result["ratio"] == pytest.approx(result["reused_s"] / result["traced_again_s"])
    assert (f"trn2  T=64 inner eager: second compile + step {result['reused_s']:.2f} s with traces reused, "
            f"{result['traced_again_s']:.2f} s traced again ({result['ratio']:.2f}x)") in out, out
