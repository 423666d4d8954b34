"""The public entry points check their arguments before any work, and drop none of them silently."""

import importlib

import pytest
import torch

import laplace_passes
from laplace_passes.backend import compile_config
from laplace_passes.lowering import export

preflight = importlib.import_module("laplace_passes.lowering.preflight")  # the package exports a function of that name


def fail_if_called(*args, **kwargs):
    raise AssertionError("the work started before the arguments were checked")


@pytest.mark.parametrize("value", [{}, [], "report"])
def test_a_report_option_that_is_not_a_report_is_refused(value):
    with pytest.raises(TypeError, match=r"report must be a laplace_passes.Report, got " + type(value).__name__):
        laplace_passes.compile(lambda x: x + 1, report=value)
    with pytest.raises(TypeError, match=r"report must be a laplace_passes.Report"):  # torch.compile's options=
        compile_config({"report": value})
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
