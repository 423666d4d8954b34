"""The project's passes are torch passes: they run in torch's PassManager and inside a user's own Inductor
compile, and the declared pipeline is what the backend runs.

Checked against eager execution of the same functions (outputs and gradients)
and on the graphs' structure (which ops are gone, which remain).
"""

import pytest
import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.infra.pass_base import PassBase
from torch.fx.passes.infra.pass_manager import PassManager

import laplace_passes
from laplace_passes.driver.backend import compile_config
from laplace_passes.driver.pipeline import ATEN, DYNAMO, describe
from laplace_passes.fx import RetileGLA
from laplace_passes.infra.inductor_passes import InductorPass
from laplace_passes.infra.pass_base import GraphPass, PassResult
from laplace_passes.unroll import FitGraphToBudget, SizeModel, UnrollLoops
from tests.gla_cases import make_inputs


def dynamo_graph(fn, *inputs) -> torch.fx.GraphModule:
    """The graph Dynamo captures of `fn(*inputs)`, untouched."""
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    (gm,) = captured
    return gm


def gla_in_a_scan(q, k, v, gk, w):
    """A GLA layer, then a scan over its output's time steps: one site and one loop."""
    o, _ = laplace_passes.gla(q, k, v, gk)

    def step(c, x_t):
        c = torch.tanh(w * c + x_t)
        return c, c * 2

    carry, ys = scan(step, torch.zeros_like(o[:, 0]), o.transpose(0, 1))
    return carry, ys


def test_every_pass_of_the_pipeline_is_a_torch_pass():
    config = compile_config({"target": "trn2", "inner": "eager"})
    assert [s.name for s in DYNAMO][:4] == ["inline_regions", "unroll_loops", "recognise_gla", "retile_gla"]
    for step in (*DYNAMO, *ATEN):
        assert step.name in describe(config)
    for cls in (RetileGLA, UnrollLoops, FitGraphToBudget):
        assert issubclass(cls, PassBase) and issubclass(cls, GraphPass)


def test_two_passes_run_in_torch_pass_manager():
    q, k, v, gk = make_inputs(B=1, T=40, H=2, K=8, V=8, seed=3, initial_state=False)[:4]
    w = torch.linspace(0.5, 1.0, 8)
    gm = dynamo_graph(gla_in_a_scan, q, k, v, gk, w)
    expected = gm(q, k, v, gk, w)

    manager = PassManager([UnrollLoops("dynamo"), RetileGLA(chunk_size=16, sub_chunk_size=4)])
    result = manager(gm)

    assert isinstance(result, torch.fx.passes.infra.pass_base.PassResult) and result.modified
    code = result.graph_module.code
    assert "laplace.chunked_gla" in code and "laplace.gla." not in code and "higher_order.scan" not in code
    for a, e in zip(result.graph_module(q, k, v, gk, w), expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_a_pass_result_is_torch_s_with_the_report_s_records():
    q, k, v, gk = make_inputs(B=1, T=20, H=1, K=4, V=4, seed=1)[:4]
    gm = dynamo_graph(lambda *x: laplace_passes.gla(*x)[0], q, k, v, gk)
    result = RetileGLA(chunk_size=8, sub_chunk_size=4)(gm)
    graph_module, modified = result  # torch's namedtuple
    assert graph_module is gm and modified
    assert isinstance(result, PassResult) and [s.status for s in result.sites] == ["retiled"]
    assert result.summary.startswith("1 of 1 GLA sites re-tiled at chunk 8")


def chunked_layer(q, k, v, gk):
    o, state = laplace_passes.chunked_gla(q, k, v, F.logsigmoid(gk), chunk_size=16, output_final_state=True)
    return o.square().sum() + state.sum()


def test_the_unroll_pass_runs_inside_a_user_s_own_inductor_compile():
    inputs = [x.requires_grad_() for x in make_inputs(B=1, T=48, H=2, K=8, V=8, seed=5)[:4]]
    expected_loss = chunked_layer(*inputs)
    expected_grads = torch.autograd.grad(expected_loss, inputs)

    unroll = InductorPass(UnrollLoops("aten", decompositions=select_decomp_table()))
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=unroll, fx_graph_cache=False):
        compiled = torch.compile(chunked_layer, backend="inductor")
        loss = compiled(*inputs)
        grads = torch.autograd.grad(loss, inputs)

    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    for a, e in zip(grads, expected_grads):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    # Inductor's forward and backward graphs each held one chunk loop, now straight-line code it fused.
    kinds = sorted(loop.kind for result in unroll.results for loop in result.loops)
    assert kinds == ["laplace.chunked_gla", "laplace.chunked_gla_backward"], kinds
    assert all(loop.status == "unrolled" for result in unroll.results for loop in result.loops)
    assert all(result.modified for result in unroll.results)


def test_a_pass_that_returns_a_new_module_is_refused_by_the_inductor_hook():
    def matmuls(x):
        for _ in range(8):
            x = (x @ x).relu()
        return x

    gm = make_fx(matmuls, tracing_mode="fake")(torch.randn(1024, 1024))  # ~1,150 estimated instructions
    budget = InductorPass(FitGraphToBudget(400, SizeModel.for_target(laplace_passes.targets.TRN2), "forward"))
    with pytest.raises(RuntimeError, match="returned a new graph module; Inductor's custom passes must rewrite"):
        budget(gm.graph)
    assert budget.uuid() != InductorPass(UnrollLoops("aten")).uuid()
    assert InductorPass(UnrollLoops("aten")).uuid() == InductorPass(UnrollLoops("aten")).uuid()
