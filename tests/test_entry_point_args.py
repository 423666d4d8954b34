"""The public entry points check their arguments before any work, and drop none of them silently."""

import importlib

import pytest
import torch

import laplace_passes
from laplace_passes.driver.backend import compile_config, laplace_backend
from laplace_passes.driver import export

preflight = importlib.import_module("laplace_passes.driver.preflight")  # the package exports a function of that name


def fail_if_called(*args, **kwargs):
    raise AssertionError("the work started before the arguments were checked")


@pytest.mark.parametrize("value", [{}, [], "report", "", 0, False])
def test_a_report_option_that_is_not_a_report_is_refused(value):
    with pytest.raises(TypeError, match=r"report must be a laplace_passes.Report, got " + type(value).__name__):
        laplace_passes.compile(lambda x: x + 1, report=value)
    with pytest.raises(TypeError, match=r"report must be a laplace_passes.Report"):  # torch.compile's options=
        compile_config({"report": value})
    with pytest.raises(TypeError, match=r"report must be a laplace_passes.Report"):  # the backend torch.compile calls
        laplace_backend(torch.fx.symbolic_trace(lambda x: x + 1), [torch.ones(2)], {"report": value})
    assert isinstance(compile_config({"report": None}).report, laplace_passes.Report)


@pytest.mark.parametrize("entry_point,module,name", [
    (laplace_passes.preflight, preflight, "preflight"),
    (lambda *a, **kw: laplace_passes.export_stablehlo(*a, out_dir="unused", **kw), export, "export_stablehlo"),
])
def test_preflight_and_export_refuse_an_inner_they_would_ignore(entry_point, module, name, monkeypatch):
    pytest.importorskip("torch_mlir")
    monkeypatch.setattr(module, "capture_graphs", fail_if_called)
    with pytest.raises(TypeError, match=rf"{name}\(\) chooses inner itself; do not pass inner="):
        entry_point(lambda x: x + 1, torch.ones(2), inner="iree")


def test_inspect_fills_the_report_it_is_given():
    mine = laplace_passes.Report()
    returned = laplace_passes.inspect(lambda x: x + 1, torch.ones(2), target="cpu", report=mine)
    assert returned is mine and [g.kind for g in mine.graphs] == ["dynamo", "inference"]


@pytest.mark.parametrize("entry_point", [
    laplace_passes.inspect,
    laplace_passes.preflight,
    lambda *a: laplace_passes.export_stablehlo(*a, out_dir="unused"),
])
def test_a_model_that_is_not_callable_is_refused_by_name(entry_point):
    if entry_point is not laplace_passes.inspect:
        pytest.importorskip("torch_mlir")
    with pytest.raises(TypeError, match="expected a module or a function to run on the example inputs, got int"):
        entry_point(42, torch.ones(2))


def test_compile_flags_are_checked():
    with pytest.raises(TypeError, match="fullgraph must be a bool, got str"):
        laplace_passes.compile(lambda x: x, fullgraph="yes")
    with pytest.raises(TypeError, match="dynamic must be a bool or None, got str"):
        laplace_passes.compile(lambda x: x, dynamic="yes")


@pytest.mark.parametrize("args,message", [
    (["--target", "tpu"], "unknown target 'tpu'"),
    (["--inner", "nope"], "unknown inner compiler 'nope'"),
    (["--seq-len", "8", "--num-pairs", "8"], "seq_len must be >= 4 * num_pairs = 32, got 8"),
])
def test_demo_settings_are_checked_before_any_rank_starts(args, message, monkeypatch, capsys):
    from laplace_passes.demo import train as demo
    from laplace_passes.tools.cli import main

    monkeypatch.setattr(demo, "launch_local", fail_if_called)
    monkeypatch.setattr(demo, "_train", fail_if_called)
    assert main(["demo", "--world-size", "2", "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


def test_library_helpers_check_their_arguments():
    from laplace_passes.lowering import neuron_compiler
    from laplace_passes.unroll import SizeModel

    with pytest.raises(TypeError, match="neuron_compiler options must be a dict of TorchNeuron options, got int"):
        neuron_compiler(42)
    with pytest.raises(TypeError, match="strict_preflight must be a bool, got str"):
        neuron_compiler({}, strict_preflight="no")
    with pytest.raises(ValueError, match="SizeModel.partition_rows must be a positive int, got 0"):
        SizeModel(0, 512)
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        laplace_passes.chunk_plan(10, 0)
    with pytest.raises(ValueError, match="seq_len must be a non-negative int, got -1"):
        laplace_passes.chunk_plan(-1, 128)


def test_a_torch_compile_mode_is_refused_saying_where_the_settings_go():
    """torch.compile passes mode= to a custom backend; it was a TypeError from the backend's signature."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x + 1, backend="laplace", mode="max-autotune")
    with pytest.raises(Exception, match=r"mode='max-autotune'\): mode is a setting of Inductor's own backend.*"
                                        r"options=\{'inner': 'inductor'\}"):
        compiled(torch.ones(2))
    torch._dynamo.reset()
    assert torch.compile(lambda x: x + 1, backend="laplace", mode="default")(torch.ones(2)).tolist() == [2.0, 2.0]
