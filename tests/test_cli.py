"""The `laplace-passes` command, in-process and as a subprocess."""

import ast
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import model_zoo
from laplace_passes.infra import process_cpu
from laplace_passes.tools.cli import available_benchmarks, main
from laplace_passes.demo.train import DemoConfig, run_demo
from tests import processes


def run_cli(*args, timeout=600):
    """The CLI in a subprocess; on a timeout its ranks (`--world-size`) are killed with it."""
    return processes.run([sys.executable, "-m", "laplace_passes.tools.cli", *args], timeout=timeout)


def test_demo_lowers_the_loss(capsys):
    assert main(["demo", "--steps", "30", "--batch", "16", "--no-progress", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    losses = result["losses"]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2
    # MQAR's keys and values are disjoint halves of the vocabulary after the padding token 0: chance is one in
    # the value tokens. 30 steps leave the accuracy near chance (the README quotes the full run's, a benchmark:
    # benchmarks/bench_demo.py).
    vocab = model_zoo.config("tiny").vocab_size
    assert result["chance"] == pytest.approx(1 / (vocab - 1 - (vocab - 1) // 2))
    # One of the sequence's listed values at random: what recall without key-value association reaches.
    assert result["listed_chance"] == pytest.approx(1 / DemoConfig().num_pairs)
    recalls = DemoConfig().eval_batch * DemoConfig().num_pairs  # the evaluation batch's recall positions
    correct = result["accuracy"] * recalls
    assert 0 <= result["accuracy"] <= 1 and correct == pytest.approx(round(correct))
    assert [s["plan"]["chunk_size"] for s in result["report_dict"]["sites"]][:2] == [128, 128]


def test_demo_subprocess_prints_progress_report_and_summary():
    done = run_cli("demo", "--steps", "3", "--batch", "4", "--seq-len", "32", "--num-pairs", "2")
    assert done.returncode == 0, done.stderr
    assert "train [" in done.stderr and "3/3" in done.stderr
    assert done.stderr.index("compiling") < done.stderr.index("1/3")  # said before the first step
    assert "retile_gla" in done.stdout and "recall accuracy" in done.stdout


DEMO_SETTINGS = ("num_pairs", "shift_keys", "seq_len", "batch", "steps", "muon_lr", "adamw_lr", "seed")


def test_the_readme_writes_out_the_demo_defaults():
    """The README quotes the recall of `demo` with no arguments from a benchmark: its settings must be the defaults."""
    from laplace_passes.tools.cli import _parser

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (written,) = re.findall(r"`laplace-passes demo (--num-pairs [^`]*)`", readme)
    args = _parser().parse_args(["demo", *written.split()])
    assert {name: getattr(args, name) for name in DEMO_SETTINGS} == \
        {name: getattr(DemoConfig(), name) for name in DEMO_SETTINGS}
    assert all(f"--{name.replace('_', '-')} " in written + " " for name in DEMO_SETTINGS), written


SHORT_DEMO = ["demo", "--steps", "4", "--batch", "4", "--seq-len", "32", "--num-pairs", "2", "--no-progress", "--json"]


def test_the_recall_curve_leaves_the_training_as_it_is(capsys):
    """Evaluations every 2 steps (what --plot draws) change no training loss; the curve ends at the result's recall."""
    assert main(SHORT_DEMO) == 0
    plain = json.loads(capsys.readouterr().out)
    result = run_demo(DemoConfig(steps=4, batch=4, seq_len=32, num_pairs=2, progress=False, recall_every=2))
    assert result.losses == plain["losses"] and plain["recalls"] == []
    assert [step for step, _ in result.recalls] == [2, 4] and result.recalls[-1][1] == result.accuracy
    assert result.accuracy == plain["accuracy"]


def test_plot_without_matplotlib_is_refused_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr("laplace_passes.demo.train._train", no_work)
    assert main(["demo", "--plot", str(tmp_path / "curves.png")]) == 2
    err = capsys.readouterr().err
    assert err == ("laplace-passes demo: error: --plot needs matplotlib, which is not installed: "
                   "pip install 'laplace_passes[plot]' (or pip install matplotlib)\n")
    assert not (tmp_path / "curves.png").exists()


def test_plot_draws_the_curves(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the 'plot' extra), not installed here")
    path = tmp_path / "curves.png"
    assert main([*SHORT_DEMO, "--plot", str(path)]) == 0
    assert path.read_bytes().startswith(b"\x89PNG") and f"drew the loss and recall curves into {path}" in \
        capsys.readouterr().err


@pytest.fixture
def busy_machine(monkeypatch):
    """A load average of twice the cores, OMP_NUM_THREADS unset, PyTorch on 2 threads: the demo must say the fix."""
    monkeypatch.setattr(process_cpu, "CPU_QUOTA", "/nonexistent/cpu.max")  # whatever the machine's container says
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "getloadavg", lambda: (2.0 * cores, 1.0, 1.0))
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("laplace_passes.demo.train._train", no_work)
    return cores


def test_a_busy_machine_is_told_the_thread_fix(busy_machine, capsys):
    with pytest.raises(AssertionError, match="the work started"):  # the line comes before the training
        main(["demo"])
    cores = f"{busy_machine} core{'s' * (busy_machine != 1)}"
    assert capsys.readouterr().err == (
        f"the load average ({2.0 * busy_machine:.2f}) is above the {cores} this process may run on (its CPU "
        "affinity, within a container's CPU quota): PyTorch's threads spin against the other work and training "
        "can run 35-40x slower; set OMP_NUM_THREADS=1 (`OMP_NUM_THREADS=1 laplace-passes demo ...`)\n")


def test_a_container_s_quota_counts_as_the_cores(busy_machine, monkeypatch, tmp_path, capsys):
    """A container limited to one CPU on a 16-core host: a load average of 1.04 fills it."""
    limits = tmp_path / "cpu.max"
    limits.write_text("100000 100000\n")
    monkeypatch.setattr(process_cpu, "CPU_QUOTA", str(limits))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "getloadavg", lambda: (1.04, 1.0, 1.0))  # above 1, though it rounds to 1.0
    with pytest.raises(AssertionError, match="the work started"):
        main(["demo"])
    assert capsys.readouterr().err.startswith("the load average (1.04) is above the 1 core this process may run on")


@pytest.mark.parametrize("quiet", ["threads set", "load at the cores"])
def test_no_thread_line_when_the_threads_are_set_or_the_cores_free(busy_machine, quiet, monkeypatch, capsys):
    if quiet == "threads set":
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
    else:
        monkeypatch.setattr(os, "getloadavg", lambda: (float(busy_machine), 1.0, 1.0))
    with pytest.raises(AssertionError, match="the work started"):
        main(["demo"])
    assert capsys.readouterr().err == ""


def test_inspect_json_has_the_documented_fields():
    done = run_cli("inspect", "tiny", "--seq-len", "256", "--json")
    assert done.returncode == 0, done.stderr
    assert "inspect tiny: capturing and transforming its graphs" in done.stderr and "done in" in done.stderr
    data = json.loads(done.stdout)
    assert set(data) == {"target", "inner", "graphs", "passes", "sites", "recurrences", "notes", "dynamic_dims",
                         "specialised", "graph_breaks"}
    assert data["dynamic_dims"] == [] and data["specialised"] == []  # static example inputs
    assert data["graph_breaks"] == []  # tiny's forward is one graph
    assert {"name", "kind", "nodes_before", "nodes_after", "passes"} <= set(data["graphs"][0])
    assert {"name", "graph", "modified", "nodes_before", "nodes_after", "summary", "declined"} <= set(data["passes"][0])
    assert {"graph", "node", "origin", "status", "reason", "plan", "shape"} <= set(data["sites"][0])
    assert data["sites"][0]["plan"] == {"T": 256, "chunk_size": 128, "n_chunks": 2, "padding": 0}


def test_inspect_dump_writes_readable_python_and_graphviz(tmp_path, capsys):
    pydot = pytest.importorskip("pydot")
    assert main(["inspect", "tiny", "--seq-len", "128", "--target", "cpu", "--dump", str(tmp_path)]) == 0
    assert "retile_gla" in capsys.readouterr().out
    py_files = sorted(tmp_path.glob("*.py"))
    dot_files = sorted(tmp_path.glob("*.dot"))
    names = {p.name for p in py_files}
    assert {"dynamo_0.0.input.py", "dynamo_0.3.retile_gla.py", "forward_0.0.input.py", "backward_0.0.input.py"} <= names
    for path in py_files:
        ast.parse(path.read_text())
    # pydot's parser takes ~3 s per 1,000 lines: it parses the Dynamo graph at every stage and the
    # forward's input (~1,400 lines); every file gets the cheaper checks.
    assert {p.stem for p in dot_files} == {p.stem for p in py_files}
    for path in dot_files:
        text = path.read_text()
        assert text.startswith("digraph") and text.rstrip().endswith("}"), path.name
        node_statements = [line for line in text.splitlines() if re.match(r'\s*"?\w+"?\s*\[label=', line)]
        assert node_statements, path.name
        if path.name.startswith("dynamo_") or path.name == "forward_0.0.input.dot":
            (graph,) = pydot.graph_from_dot_data(text)
            nodes = [n for n in graph.get_node_list() if n.get_name() != "node"]  # "node [...]" sets defaults
            assert len(nodes) == len(node_statements), path.name
    diff = (tmp_path / "dynamo_0.diff").read_text()
    assert "-    gla_default = torch.ops.laplace.gla.default" in diff
    assert "+    chunked_gla = torch.ops.laplace.chunked_gla.default" in diff
    assert json.loads((tmp_path / "report.json").read_text())["target"] == "cpu"


def test_inspect_module_attr_form(capsys):
    assert main(["inspect", "tests.cli_models:two_layer_gla", "--target", "cpu"]) == 0
    printed = capsys.readouterr()
    assert "2 of 2 GLA sites re-tiled at chunk 64" in printed.out
    # The callable's own inputs, not --batch and --seq-len, which it does not read.
    assert ("capturing and transforming its graphs at the inputs it was given ([1, 100, 2, 8], [1, 100, 2, 8], "
            "[1, 100, 2, 8], [1, 100, 2, 8])") in printed.err


@pytest.mark.parametrize(
    "args,message",
    [
        (["inspect", "huge"], "unknown model 'huge': use one of tiny, small, laplace-3b"),
        (["inspect", "tiny", "--seq-len", "0"], "--batch and --seq-len must be positive"),
        (["inspect", "tests.cli_models:missing"], "has no attribute 'missing'"),
        (["inspect", "tests.cli_models:NOT_A_MODEL"], "expected an nn.Module or a callable"),
        (["inspect", "tiny", "--target", "tpu"], "unknown target 'tpu'"),
        (["inspect", "tiny", "--inner", "foo"], "unknown inner compiler 'foo'"),
        (["demo", "--steps", "0"], "steps must be a positive int"),
        (["demo", "--world-size", "-1"], "world_size must be a positive int, got -1"),
        (["demo", "--batch", "-4"], "batch must be a positive int, got -4"),
        (["export", "tiny", "--stablehlo", "unused", "--muon", "--world-size", "1"],
         "--muon needs --world-size of at least 2 (got 1)"),
        (["export", "tiny", "--stablehlo", "unused", "--world-size", "3"],
         "--world-size (3) sets the ranks of the --muon step: add --muon, or leave --world-size out"),
        (["bench", "nope"], "unknown benchmark 'nope'; available: "),
        (["inspect", "tiny", "--passes", "--json"], "--passes prints the pipeline only (for --target and --inner); "
                                                    "MODEL, --json would be ignored"),
    ],
)
def test_errors_are_clear(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args,message", [
    (["export", "tests.cli_models:spectrum", "--stablehlo", "{out}"],
     "export: error: torch-mlir cannot lower 1 node(s): node _fft_r2c (aten._fft_r2c.default)"),
    (["export", "tests.cli_models:branch", "--stablehlo", "{out}"],
     "export: error: torch-mlir cannot lower this graph: Higher-order operation 'cond' not implemented"),
    (["inspect", "tests.cli_models:branch", "--inner", "stablehlo"], "(the graph holds control flow: cond,"),
    (["inspect", "tests.cli_models:no_tensor_work"], "inspect: error: captured no graph: Dynamo ran the function"),
    (["export", "tests.cli_models:spectrum", "--stablehlo", "{out}", "--muon"],
     "export: error: --muon exports the demo's ShardedMuon step over a model_zoo config's parameters"),
    (["demo", "--inner", "neuron", "--steps", "1", "--no-progress"],
     "demo: error: inner='neuron' hands the ATen graphs to TorchNeuron (the torch-neuronx package), which is not "
     "installed here"),
])
def test_what_the_work_meets_is_one_line_too(args, message, tmp_path, capsys):
    """Errors met after the work began (a graph that does not lower, one never compiled, a compiler missing inside
    the demo's training step, where Dynamo wraps it): one line of the error, no traceback."""
    assert main([a.format(out=tmp_path / "out") for a in args]) == 2
    err = capsys.readouterr().err
    last = err.rstrip().splitlines()[-1]
    assert last.startswith(f"laplace-passes {args[0]}: error: ") and message in last and "Traceback" not in err, err


def test_inspect_runs_the_graphs_with_the_inner_compiler_asked_for(monkeypatch, capsys):
    """--inner reaches laplace_passes.inspect (it had been taken for --passes alone and dropped otherwise)."""
    import laplace_passes

    asked = {}

    def inspect(model, *inputs, **options):
        asked.update(options)
        return laplace_passes.Report()

    monkeypatch.setattr("laplace_passes.inspect", inspect)
    assert main(["inspect", "tiny", "--seq-len", "32", "--target", "cpu", "--inner", "stablehlo"]) == 0
    assert asked == {"target": "cpu", "inner": "stablehlo"}, asked


def no_work(*args, **kwargs):
    raise AssertionError("the work started before its size was checked")


@pytest.mark.parametrize("args,message", [
    (["demo", "--seq-len", str(10**12)], "demo: error: the evaluation batch of 256 sequences of 1,000,000,000,000 "
     "tokens (their ids, targets and logits) need at least 120.1 PiB, more than this machine's "),
    (["demo", "--seq-len", "64", "--batch", str(10**14)], "demo: error: a rank's training batch of "
     "100000000000000 sequences of 64 tokens (their ids, targets and logits) need at least 3,001.3 PiB"),
    (["inspect", "tiny", "--seq-len", str(10**12)], "inspect: error: --batch 1 x --seq-len 1,000,000,000,000 "
     "tokens (their ids and logits) need at least 472.9 TiB, more than this machine's "),
    (["export", "tiny", "--stablehlo", "unused", "--seq-len", str(10**20)], "export: error: --batch 1 x --seq-len "),
])
def test_a_batch_larger_than_memory_is_refused_before_the_work(args, message, monkeypatch, capsys):
    """The token ids and logits alone, a lower bound of what the work allocates, against the machine's memory."""
    monkeypatch.setattr("laplace_passes.demo.train._train", no_work)
    monkeypatch.setattr("laplace_passes.inspect", no_work)
    monkeypatch.setattr("laplace_passes.export_stablehlo", no_work)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert err.rstrip().endswith(("of memory: use a smaller --seq-len", "of memory: use a smaller --seq-len or --batch"))


def test_an_allocation_failing_in_training_is_one_line(monkeypatch, capsys):
    """What the lower bound lets through fails where it allocates (here the batch's token ids): one line, the fix."""
    monkeypatch.setattr("laplace_passes.tools.memory.physical_memory_bytes", lambda: 2**100)
    assert main(["demo", "--steps", "1", "--batch", "4", "--seq-len", str(10**14), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("laplace-passes demo: error: out of memory ("), err
    assert err.rstrip().endswith("): use a smaller --seq-len or --batch") and "enforce fail" not in err


TINY_GLA_BENCH = ["gla", "--T", "64", "--H", "1", "--K", "8", "--V", "8", "--repeats", "1", "--no-compiled",
                  "--recompute-residuals", "--json"]


def test_bench_runs_a_benchmark_script(capfd):
    assert {"gla", "unroll", "muon", "lowering", "decode"} <= set(available_benchmarks())
    assert main(["bench", *TINY_GLA_BENCH]) == 0  # in-process: the other CLI tests cover the console script
    result = json.loads(capfd.readouterr().out)
    assert result["shape"] == {"B": 1, "T": 64, "H": 1, "K": 8, "V": 8}
    # The ratios are those of the times measured in the same run (a ratio upside down would differ).
    assert 0 < result["chunked_s"] < float("inf") and 0 < result["recurrence_s"] < float("inf")
    assert result["chunked_speedup_vs_recurrence"] == pytest.approx(result["recurrence_s"] / result["chunked_s"])
    assert result["chunked_fraction_of_matmul"] == pytest.approx(result["chunked_gflops"] / result["matmul_gflops"])
    if result["fla_naive_s"] is not None:
        assert result["chunked_speedup_vs_fla_naive"] == pytest.approx(result["fla_naive_s"] / result["chunked_s"])
    # One repeat: the speed-up of keeping the residuals is that round's ratio of the two times.
    keeping = result["chunked_recomputing_s"] / result["chunked_s"]
    assert result["chunked_keeping_residuals_speedup"] == pytest.approx(keeping)
    assert result["chunked_keeping_residuals_speedup_per_round"] == [pytest.approx(keeping)]


def test_export_writes_stablehlo_files_and_their_manifest(tmp_path, capsys):
    pytest.importorskip("torch_mlir")
    assert main(["export", "tiny", "--stablehlo", str(tmp_path), "--seq-len", "128", "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest == json.loads((tmp_path / "manifest.json").read_text())
    assert [(g["name"], g["kind"]) for g in manifest["graphs"]] == [("forward_0", "forward"), ("backward_0", "backward")]
    for entry in manifest["graphs"]:
        text = (tmp_path / entry["file"]).read_text()
        assert "stablehlo." in text and "stablehlo.while" not in text
        assert "neuronx-cc compile" in entry["neuronx_cc"]


def test_export_subprocess_inference_graph(tmp_path):
    pytest.importorskip("torch_mlir")
    done = run_cli("export", "tiny", "--stablehlo", str(tmp_path), "--seq-len", "64", "--inference")
    assert done.returncode == 0, done.stderr
    assert "inference_0.mlir" in done.stdout and "StableHLO ops" in done.stdout
    assert "export tiny: lowering every graph" in done.stderr and "done in" in done.stderr
    # What the minutes of lowering are spent on, as it goes: capture, then each graph's passes and lowering.
    progress = [line.strip() for line in done.stderr.splitlines() if line.startswith("  ")]
    assert progress[0] == "capturing the graphs of GLALM at inputs [1, 64] ...", done.stderr
    steps = ["dynamo_0: the passes ...", "inference_0: the passes and the lowering to StableHLO (torch-mlir) ..."]
    assert [line for line in progress if line in steps] == steps
    # The lowering's seconds are the passes' (it is their last step), not a line of 0.0 s after them.
    assert not any(line.startswith("lowering ") for line in progress), done.stderr
    assert progress[-1].startswith("capturing the graphs of GLALM at inputs [1, 64]: done in ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inference_0.mlir", "inference_0.mlirbc", "manifest.json"]


def test_export_without_torch_mlir_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch_mlir.fx", None)
    assert main(["export", "tiny", "--stablehlo", str(tmp_path), "--seq-len", "64"]) == 2
    err = capsys.readouterr().err
    assert "export_stablehlo needs the package 'torch-mlir'" in err and 'laplace_passes[lowering]"' in err
    assert not list(tmp_path.iterdir())


def test_export_refuses_a_meta_model(tmp_path, capsys):
    assert main(["export", "laplace-3b", "--stablehlo", str(tmp_path)]) == 2
    assert "lives on the meta device" in capsys.readouterr().err


def test_bench_in_process_returns_the_script_exit_code(capfd):
    # A successful run's exit code and output: test_bench_runs_a_benchmark_script.
    assert main(["bench", "gla", "--no-such-flag"]) == 2  # argparse's exit code, passed through
    assert "unrecognized arguments: --no-such-flag" in capfd.readouterr().err


def test_inspect_passes_prints_the_declared_pipeline_for_the_inner_compiler(capsys):
    from laplace_passes.driver.pipeline import ATEN, DYNAMO

    assert main(["inspect", "--passes", "--target", "cpu", "--inner", "stablehlo"]) == 0
    lowered = capsys.readouterr().out
    assert main(["inspect", "--passes"]) == 0
    eager = capsys.readouterr().out
    dynamo, aten = lowered.split("aten graphs:")
    for text, steps in ((dynamo, DYNAMO), (aten, ATEN)):
        positions = [text.index(f" {step.name} ") for step in steps]
        assert positions == sorted(positions), text
    assert "+ 11. lower_to_stablehlo" in lowered and "- 11. lower_to_stablehlo" in eager
    assert "+  3. clamp_gate_checks" in lowered and "+  6. expand_scaled_adds" in lowered
    assert "-  8. neuron_preflight" in lowered
    assert "target trn2, inner eager" in eager


def help_text(capsys, *command) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    return re.sub(r"\s+", " ", capsys.readouterr().out)  # argparse wraps lines at the terminal's width


def test_help_shows_defaults_and_the_choices_of_target_and_inner(capsys):
    from laplace_passes.driver.backend import INNER_COMPILERS
    from laplace_passes.infra.targets import TARGETS

    targets = f"hardware target: {', '.join(sorted(TARGETS))} (default: trn2)"
    inners = f"inner compiler: {', '.join(INNER_COMPILERS)}"
    demo = help_text(capsys, "demo")
    assert f"past its step (default: {DemoConfig().steps})" in demo and f"(default: {DemoConfig().batch})" in demo
    assert targets in demo and inners in demo
    inspect = help_text(capsys, "inspect")
    assert "--seq-len SEQ_LEN (default: 2048)" in inspect and targets in inspect and inners in inspect
    assert "(default: False)" not in inspect  # flags have no default to show
    export = help_text(capsys, "export")
    assert "--seq-len SEQ_LEN (default: 256)" in export and "(default: 4)" in export and targets in export


def test_inspect_help_explains_the_report_columns(capsys):
    from laplace_passes.infra.report import COLUMNS

    text = help_text(capsys, "inspect")
    for column in ("whole-tile mm", "small mm", "padding", "saved for bwd"):
        assert f"{column} {COLUMNS[column]}" in text, column


def test_bench_help_names_each_benchmark_from_its_script(capsys, tmp_path, monkeypatch):
    text = help_text(capsys, "bench")
    for name in available_benchmarks():
        assert f" {name} " in text, name
    assert "gla Chunked GLA against the token recurrence" in text
    (tmp_path / "bench_new.py").write_text('"""A benchmark added later.\n\nMore.\n"""\n')
    monkeypatch.setattr("laplace_passes.tools.cli.BENCHMARKS_DIR", tmp_path)
    assert "one of: new" in help_text(capsys, "bench") and "new A benchmark added later." in help_text(capsys, "bench")
