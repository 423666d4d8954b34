"""An fla call without a PyTorch replacement: a report line and a clear error, never Triton's driver error."""

import pytest
import torch

import laplace_passes
from laplace_passes.fla import FlaCallNotReplaced

fla_gla = pytest.importorskip("fla.ops.gla")
activations = pytest.importorskip("fla.modules.activations")


def value_gated(q, k, v, g, gv):
    """fused_recurrent_gla with value gates: laplace::gla has no form for them."""
    o, _ = fla_gla.fused_recurrent_gla(q, k, v, g, gv=gv, output_final_state=True)
    return o * 2


def inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 2, 8, generator=gen)
    return q, q.clone(), q.clone(), -torch.rand(1, 32, 2, 8, generator=gen), -torch.rand(1, 32, 2, 8, generator=gen)


def test_inspect_returns_the_report_with_a_line_naming_the_call():
    report = laplace_passes.inspect(value_gated, *inputs(), target="cpu")
    (fla_pass,) = [p for p in report.passes if p.name == "fla_calls"]
    (line,) = fla_pass.declined
    assert line.startswith("fla.fused_recurrent_gla") and "value gates (gv)" in line
    assert "fla.fused_recurrent_gla" in str(report) and "value gates (gv)" in str(report)
    assert any("stopped at an fla call without a replacement" in note for note in report.notes)


def test_running_it_raises_a_clear_error_not_tritons():
    compiled = laplace_passes.compile(value_gated, target="cpu")
    with pytest.raises(FlaCallNotReplaced, match=r"fla\.fused_recurrent_gla .*value gates \(gv\).*cannot run on cpu"):
        compiled(*inputs())
    assert "fla.fused_recurrent_gla" in str(compiled.laplace_report)


def test_fla_kernels_reached_outside_a_compiled_graph_are_named():
    """Eagerly, fla's dispatched kernels meet the guard registered in fla.backends, not Triton."""
    laplace_passes.fla.install(import_fla=True)
    laplace_passes.compile(lambda x: x + 1, target="cpu")(torch.ones(2))  # a report to note into
    with pytest.raises(FlaCallNotReplaced, match=r"fla\.modules\.activations\.ops\.swish_fwd .*outside a laplace"):
        activations.ACT2FN["swish"](torch.randn(4, 8))
    assert any("swish_fwd" in note for note in laplace_passes.last_report().notes)


def test_report_pass_lists_markers_and_captured_triton_kernels_on_a_bare_graph():
    from laplace_passes.fla.not_replaced import MARKER
    from laplace_passes.fla.report_pass import ReportFlaCalls

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    marked = graph.call_function(MARKER, (x, "fla.fused_recurrent_gla", "reverse=True has no form"))
    kernel = graph.call_function(torch.ops.higher_order.triton_kernel_wrapper_functional,
                                 kwargs={"kernel_idx": 7, "constant_args_idx": 0, "grid": [(1, 1, 1)],
                                         "tma_descriptor_metadata": {}, "kwargs": {}, "tensors_to_clone": []})
    graph.output((marked, kernel))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    outcome = ReportFlaCalls()(gm)
    assert not outcome.modified and outcome.summary == "2 fla call(s) left to fla"
    assert outcome.declined[0] == f"fla.fused_recurrent_gla (node {marked.name}): not replaced: reverse=True has no form"
    assert outcome.declined[1].startswith(f"Triton kernel #7 (node {kernel.name}): not replaced")
