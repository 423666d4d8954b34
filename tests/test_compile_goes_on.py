"""A laplace compile goes on whatever its passes meet: a pass that fails declines for that graph (NOTE [a failing
pass declines]), and inputs that once made passes fail are handled.

A failure is planted inside a real pass (after it has half-changed the
graph) or in a pass of our own; the compiled function must then give the
eager results, outputs and gradients, with the failure named in the
report. Strict mode (the `strict` option, LAPLACE_PASSES_STRICT=1, which
the test suite sets) raises it instead, and so do the passes whose failure
is the user's answer.
"""

import pytest
import torch
import torch.nn.functional as F

import laplace_passes
import laplace_passes.fx.retile as retile_module
from laplace_passes.driver.compile_fx import fresh_code
from laplace_passes.infra.pass_base import GraphPass, PassResult, run_passes
from laplace_passes.infra.report import Report
from laplace_passes.infra.strict import ENVIRONMENT_VARIABLE
from laplace_passes.lowering.preflight import RequireCleanPreflight
from laplace_passes.lowering.stablehlo import LowerToStableHLO


def layer(q, k, v, x):
    return laplace_passes.gla(q, k, v, F.logsigmoid(x) / 16, scale=0.5)[0]


def _inputs():
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 40, 2, 4), (1, 40, 2, 4), (1, 40, 2, 8), (1, 40, 2, 4)]
    return [torch.randn(*shape, generator=gen).requires_grad_() for shape in shapes]


@pytest.fixture
def planted_retile_failure(monkeypatch):
    """The re-tiling pass raises after it has put the chunked op into the graph."""
    def fail(*args, **kwargs):
        raise RuntimeError("planted failure while measuring the saved bytes")

    monkeypatch.setattr(retile_module, "chunked_gla_saved_bytes", fail)


def _grads(fn, inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.square().sum().backward()
    return out.detach(), [t.grad for t in inputs]


def test_a_pass_that_raises_declines_and_the_compile_gives_the_eager_results(planted_retile_failure):
    inputs = _inputs()
    compiled = laplace_passes.compile(layer, target="cpu", strict=False)
    out, grads = _grads(compiled, inputs)
    expected_out, expected_grads = _grads(layer, inputs)
    torch.testing.assert_close(out, expected_out)
    for actual, expected in zip(grads, expected_grads):
        torch.testing.assert_close(actual, expected)
    report = compiled.laplace_report
    (retile,) = [p for p in report.passes if p.name == "retile_gla"]
    assert not retile.modified and retile.summary == "failed and skipped: RuntimeError"
    (reason,) = retile.declined
    assert reason.startswith("RuntimeError: planted failure while measuring the saved bytes at laplace_passes/fx/retile.py:")
    assert "on node gla" in reason and "LAPLACE_PASSES_STRICT=1" in reason
    assert reason in str(report)  # the report's table of declined rewrites
    # The graph after the failed pass is the one before it: the reference op, no chunked op half-inserted.
    ops = {str(n.target) for n in report.graph("after").graph.nodes}
    assert "laplace.gla.default" in ops and not any("chunked_gla" in op for op in ops)


def test_strict_mode_raises_the_failure(planted_retile_failure, monkeypatch):
    with pytest.raises(RuntimeError, match="planted failure") as raised:
        laplace_passes.compile(layer, target="cpu", strict=True)(*_inputs())
    error = getattr(raised.value, "inner_exception", raised.value)  # torch.compile wraps a backend's exception
    assert "while running laplace pass 'retile_gla'" in "".join(getattr(error, "__notes__", []))
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "1")
    with pytest.raises(RuntimeError, match="planted failure"):
        laplace_passes.compile(layer, target="cpu")(*_inputs())
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "0")
    laplace_passes.compile(layer, target="cpu")(*_inputs())  # declined, not raised


class _LeavesAnIllFormedGraph(GraphPass):
    name = "leaves_an_ill_formed_graph"

    def call(self, gm):
        output = next(iter(gm.graph.find_nodes(op="output")))
        first = next(iter(gm.graph.nodes))
        with gm.graph.inserting_before(first):  # reads the output's argument before it is defined
            gm.graph.call_function(torch.neg, (output.args[0],))
        return PassResult(gm, True)


class _Raises(GraphPass):
    name = "raises"

    def call(self, gm):
        raise ValueError("planted")


def _traced():
    return torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)


def test_a_pass_leaving_an_ill_formed_graph_declines_and_the_graph_is_the_one_before_it():
    gm, report = _traced(), Report()
    record = report.new_graph("dynamo", gm)
    result = run_passes(gm, [_LeavesAnIllFormedGraph()], record, report)
    x = torch.randn(5)
    torch.testing.assert_close(result(x), torch.relu(x) + 1)
    (declined,) = report.passes[0].declined
    assert declined.startswith("PassLintError: left an ill-formed graph (")
    with pytest.raises(Exception, match="ill-formed"):
        run_passes(_traced(), [_LeavesAnIllFormedGraph()], Report().new_graph("dynamo", _traced()), Report(),
                   strict=True)


@pytest.mark.parametrize("answer_pass", [LowerToStableHLO, RequireCleanPreflight])
def test_passes_whose_failure_is_the_user_s_answer_raise_outside_strict_mode(answer_pass, monkeypatch):
    assert answer_pass.stops_compile_on_error
    monkeypatch.setattr(_Raises, "stops_compile_on_error", True)
    gm, report = _traced(), Report()
    with pytest.raises(ValueError, match="planted"):
        run_passes(gm, [_Raises()], report.new_graph("dynamo", gm), report)


def test_errors_from_inspect_start_with_the_cause_not_the_backend_s_repr(planted_retile_failure):
    with pytest.raises(RuntimeError) as raised:
        laplace_passes.inspect(layer, *_inputs(), target="cpu", strict=True)
    assert str(raised.value).startswith("planted failure")
    assert "CompileConfig" not in str(raised.value)
    assert len(repr(laplace_passes.targets.TRN2)) < 120


def test_a_second_head_size_on_a_static_target_is_re_tiled_in_its_specialised_graph():
    """dynamic=True on trn2: every shape is specialised, and `q.shape[-1] ** -0.5` is a number in each copy."""
    def scaled_layer(q, k, v, x):
        return laplace_passes.gla(q, k, v, F.logsigmoid(x) / 16, scale=q.shape[-1] ** -0.5)[0]

    torch._dynamo.reset()
    compiled = torch.compile(scaled_layer, backend="laplace", dynamic=True,
                             options={"target": "trn2", "inner": "stablehlo"})
    gen = torch.Generator().manual_seed(0)
    for K in (4, 8):
        inputs = [torch.randn(1, 40, 2, size, generator=gen) for size in (K, K, 8, K)]
        torch.testing.assert_close(compiled(*inputs), scaled_layer(*inputs), rtol=1e-4, atol=1e-5)
        (site,) = laplace_passes.last_report().sites
        assert site.status == "retiled" and site.shape["K"] == K, site


@pytest.mark.parametrize("target", ["cpu", "trn2"])
@pytest.mark.parametrize("T", [1, 8])
def test_the_recurrent_form_runs_on_gates_whose_kernel_and_meta_strides_differ(target, T):
    """F.logsigmoid of a transposed tensor is contiguous on the CPU but keeps the transposed strides in its
    fake tensor: the recurrent form's reshapes must not trace a view that only the fake allows."""
    def transposed_layer(q, k, v, x, state):
        return laplace_passes.gla(q, k, v, F.logsigmoid(x) / 4, scale=0.5, initial_state=state,
                                  output_final_state=True)

    gen = torch.Generator().manual_seed(0)
    q, k, x = (torch.randn(2, 2, T, 4, generator=gen).transpose(1, 2) for _ in range(3))  # [B, T, H, K] views
    v = torch.randn(2, 2, T, 8, generator=gen).transpose(1, 2)
    state = torch.randn(2, 2, 4, 8, generator=gen)
    compiled = laplace_passes.compile(fresh_code(transposed_layer), target=target)
    with torch.no_grad():
        actual, expected = compiled(q, k, v, x, state), transposed_layer(q, k, v, x, state)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    (site,) = compiled.laplace_report.sites
    assert site.form.startswith("recurrent"), site.form
