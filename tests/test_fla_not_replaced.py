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
    with pytest.raises(FlaCallNotReplaced, match=r"fla\.modules\.activations\.ops\.swish_fwd .*outside a laplace") as error:
        activations.ACT2FN["swish"](torch.randn(4, 8))
    assert "model.compile(backend=" in str(error.value)
    (row,) = [p for p in laplace_passes.last_report().passes if p.name == "fla_calls" and p.graph == "eager"]
    assert row.declined == ["fla.modules.activations.ops.swish_fwd: not replaced: reached eagerly, outside a "
                            "laplace-compiled graph"]
    assert "swish_fwd" in str(laplace_passes.last_report())  # the 'declined' table the error points to


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


class Inner(torch.nn.Module):
    def forward(self, q, k, v, g, gv):
        return value_gated(q, k, v, g, gv)


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Inner()])

    def forward(self, *inputs):
        return self.layers[0](*inputs)


def test_the_declined_row_names_the_module_the_call_was_made_in():
    report = laplace_passes.inspect(Outer(), *inputs(), target="cpu")
    (line,) = [d for p in report.passes if p.name == "fla_calls" for d in p.declined]
    assert line.startswith("fla.fused_recurrent_gla (node ") and ", in model.layers.0): not replaced" in line, line


def test_torch_compile_then_generate_names_the_form_that_works():
    """`torch.compile(model).generate(...)` runs the model's own forward: the error says to use model.compile."""
    fla_models = pytest.importorskip("fla.models")
    torch.manual_seed(0)
    model = fla_models.GLAForCausalLM(fla_models.GLAConfig(hidden_size=64, num_hidden_layers=1, num_heads=2,
                                                           vocab_size=128))
    laplace_passes.fla.install(import_fla=True)
    compiled = torch.compile(model, backend="laplace")
    with pytest.raises(FlaCallNotReplaced, match=r"model\.compile\(backend=.laplace.\)"):
        compiled.generate(torch.zeros(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False)


def two_graphs(q, k, v, g, gv):
    """A re-tiled GLA site, a graph break, then a call without a replacement: the call raises in its 2nd graph."""
    o, _ = laplace_passes.gla(q, k, v, g)
    torch._dynamo.graph_break()
    return value_gated(o, k, v, g, gv)


def test_the_report_of_a_call_that_raised_covers_its_graphs_before_the_break():
    torch._dynamo.reset()
    compiled = torch.compile(two_graphs, backend="laplace", options={"target": "cpu"})
    with pytest.raises(FlaCallNotReplaced, match=r"fla\.fused_recurrent_gla"):
        compiled(*inputs())
    report = laplace_passes.last_report()
    assert len({graph.name for graph in report.graphs if graph.name.startswith("dynamo_")}) == 2
    assert len(report.sites) == 1 and "GLA sites: none" not in str(report)
    assert any(line.startswith("fla.fused_recurrent_gla") for p in report.passes for line in p.declined)


def test_each_call_that_compiles_gets_a_report_of_its_own():
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, g: laplace_passes.gla(q, k, v, g)[0], backend="laplace", dynamic=False,
                             options={"target": "cpu"})
    q, k, v, g, _ = inputs()
    compiled(q, k, v, g)
    first = laplace_passes.last_report()
    compiled(q[:, :16], k[:, :16], v[:, :16], g[:, :16])  # a new length: a recompile in a second call
    second = laplace_passes.last_report()
    assert second is not first and len(second.graphs) == len(first.graphs)
    assert [site.plan["T"] for site in first.sites] == [32] and [site.plan["T"] for site in second.sites] == [16]


def test_a_call_under_activation_checkpointing_is_listed_with_the_body_it_is_in():
    """torch.utils.checkpoint puts the call in a body graph (NOTE [run-once bodies]): it is listed all the same."""
    import torch.utils.checkpoint as checkpoint

    def checkpointed(*args):
        return checkpoint.checkpoint(value_gated, *args, use_reentrant=False)

    report = laplace_passes.inspect(checkpointed, *inputs(), target="cpu")
    (line,) = [d for p in report.passes if p.name == "fla_calls" for d in p.declined]
    assert line.startswith("fla.fused_recurrent_gla (node wrap_body_0.") and "value gates (gv)" in line, line
