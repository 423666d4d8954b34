"""A backward graph generated in the helper process (laplace_passes.driver.backward_ahead, infra.remote_codegen).

NOTE [backward graphs generated in the helper process]: the backward's
codegen request is sent to the helper as the forward compiles, and the
helper's compiled graph is used only for a request with the same key (NOTE
[what makes two codegens the same]). A backward loaded from the helper must
give the gradients of one generated here, bit for bit; a request that
differs, a failed answer, or a request the key cannot compare leaves the
codegen here, and the numbers are the same.
"""

import os
from concurrent.futures import Future

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

import laplace_passes
from laplace_passes.driver import backward_ahead
from laplace_passes.driver.config import CompileConfig
from laplace_passes.infra.remote_codegen import (
    answering_codegen,
    captured_codegen,
    codegen_from_payload,
    load_answer,
    request_key,
)
from laplace_passes.unroll import body_helper
from tests.test_logs import Records

switched_off = pytest.mark.skipif(os.environ.get(body_helper.SWITCH) == "0",
                                  reason="the helper process is switched off (LAPLACE_PASSES_BODY_HELPER=0)")


def scaled_softplus(x, w, c):
    return ((F.softplus(x @ w) * c + x.sum(dim=1, keepdim=True)).cumsum(dim=0),)  # Inductor takes a tuple


def graph_and_inputs(transposed_x=False):
    torch.manual_seed(3)
    x, w, c = torch.randn(6, 5), torch.randn(5, 5), torch.randn(5)
    gm = make_fx(scaled_softplus, decomposition_table=select_decomp_table())(x, w, c)  # as Inductor takes it
    if transposed_x:
        x = x.t().contiguous().t()
    return gm, [x, w, c]


def compile_here(gm, inputs):
    return compile_fx_inner(gm, inputs)


def test_a_request_generated_from_its_bytes_and_loaded_runs_as_the_graph_compiled_here():
    """The transport: the request as bytes, Inductor's codegen of them, the compiled graph loaded back."""
    gm, inputs = graph_and_inputs()
    request = captured_codegen(lambda: compile_here(gm, inputs))
    answer = codegen_from_payload(request.payload())  # in this process: the helper runs the same function
    loaded = load_answer(answer, request.gm)
    expected = compile_here(*graph_and_inputs())(list(inputs))
    got = loaded(list(inputs))
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    torch.testing.assert_close(got[0], scaled_softplus(*inputs)[0])


def test_the_key_is_the_same_for_the_same_compile_and_differs_with_a_layout_or_a_constant():
    first = captured_codegen(lambda: compile_here(*graph_and_inputs()))
    again = captured_codegen(lambda: compile_here(*graph_and_inputs()))
    transposed = captured_codegen(lambda: compile_here(*graph_and_inputs(transposed_x=True)))
    assert first.key is not None and first.key == again.key
    assert transposed.key != first.key
    offset, scale = torch.ones(5), torch.tensor(2.0)
    gm = make_fx(lambda x: (x * scale + offset,))(torch.zeros(5))  # the graph reads both as constants
    for constant in [n.target for n in gm.graph.nodes if n.op == "get_attr"]:
        with_constant = request_key(gm, [torch.zeros(5)], [], {})
        getattr(gm, constant).add_(1)
        assert with_constant is not None and request_key(gm, [torch.zeros(5)], [], {}) != with_constant


def test_the_graph_number_does_not_count_and_what_the_key_cannot_compare_has_no_key():
    gm, inputs = graph_and_inputs()
    kwargs = {"is_backward": True, "graph_id": 1}
    assert request_key(gm, inputs, [], kwargs) == request_key(gm, inputs, [], {**kwargs, "graph_id": 7})
    assert request_key(gm, inputs, [], kwargs) != request_key(gm, inputs, [], {**kwargs, "is_backward": False})
    assert request_key(gm, inputs, [], {"extern_node_serializer": print}) is None
    assert request_key(gm, [object()], [], {}) is None
    with torch._inductor.config.patch(post_grad_custom_post_pass=lambda graph: None):
        assert request_key(gm, inputs, [], {}) is None


def answered(value=None, error=None):
    future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


def test_a_failed_answer_leaves_the_codegen_here_with_the_reason_logged():
    gm, inputs = graph_and_inputs()
    key = captured_codegen(lambda: compile_here(gm, inputs)).key
    with Records("laplace") as records, \
            answering_codegen({key: answered(error=RuntimeError("the helper process exited"))}) as loaded:
        compiled = compile_here(*graph_and_inputs())
    assert loaded == []
    logged = "\n".join(r.getMessage() for r in records)
    assert "not used (RuntimeError: the helper process exited); generating it here" in logged
    torch.testing.assert_close(compiled(list(inputs))[0], scaled_softplus(*inputs)[0])


def test_an_answer_to_another_request_is_not_loaded():
    gm, inputs = graph_and_inputs()
    other = captured_codegen(lambda: compile_here(*graph_and_inputs(transposed_x=True)))
    wrong = answered(error=AssertionError("an answer to another request was read"))
    with answering_codegen({other.key: wrong}) as loaded:
        compiled = compile_here(gm, inputs)
    assert loaded == []
    torch.testing.assert_close(compiled(list(inputs))[0], scaled_softplus(*inputs)[0])


class Mixer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def gradients(helper_switch, monkeypatch):
    monkeypatch.setenv(body_helper.SWITCH, helper_switch)
    monkeypatch.setattr(backward_ahead, "MIN_FORWARD_NODES", 0)  # this small model's backward sent too
    torch.manual_seed(0)
    model, x = Mixer(), torch.randn(4, 16)
    step = laplace_passes.compile(lambda x: model(x).square().mean(), target="cpu", inner="inductor")
    # Generated, not found in Inductor's cache from an earlier run.
    with Records("laplace") as records, torch._inductor.config.patch(fx_graph_cache=False):
        step(x).backward()
    return [p.grad for p in model.parameters()], "\n".join(r.getMessage() for r in records)


@switched_off
def test_a_backward_generated_in_the_helper_gives_the_gradients_generated_here_bit_for_bit(monkeypatch):
    helped, logged = gradients("1", monkeypatch)
    assert "backward_0: its code generated in the helper process" in logged
    here, logged_here = gradients("0", monkeypatch)
    assert "helper process" not in logged_here
    for h, e in zip(helped, here, strict=True):
        assert torch.equal(h, e)


@switched_off
def test_a_backward_in_inductors_cache_is_not_sent_and_leaves_the_forward_as_it_was(monkeypatch):
    """Found in Inductor's FX graph cache, the backward's compile completes in the forward's: nothing to send."""
    monkeypatch.setenv(body_helper.SWITCH, "1")
    monkeypatch.setattr(backward_ahead, "MIN_FORWARD_NODES", 0)
    expected = None
    for _ in range(2):  # the second compile finds the first's backward in the cache
        torch.manual_seed(0)
        model, x = Mixer(), torch.randn(4, 16)
        step = laplace_passes.compile(lambda x: model(x).square().mean(), target="cpu", inner="inductor")
        with Records("laplace") as records, torch._inductor.config.patch(fx_graph_cache=True):
            step(x).backward()
        grads = [p.grad for p in model.parameters()]
        expected = expected or grads
        for g, e in zip(grads, expected, strict=True):
            assert torch.equal(g, e)
    logged = "\n".join(r.getMessage() for r in records)
    assert "not sent to the helper process (RuntimeError: the compile did not reach Inductor's codegen" in logged


def test_without_the_helper_nothing_is_sent(monkeypatch):
    monkeypatch.setenv(body_helper.SWITCH, "0")
    config = CompileConfig.from_options({"target": "cpu", "inner": "inductor"})
    assert backward_ahead.BackwardAhead.for_graph(config, [torch.zeros(2, requires_grad=True)]) is None


def test_a_graph_decomposed_ahead_is_traced_once_for_its_layouts(monkeypatch):
    """The backward's decomposition in the forward's compile is the one its own compile takes, once."""
    from torch.fx.experimental import proxy_tensor

    from laplace_passes.infra import inner

    traces = []
    make_fx_here = proxy_tensor.make_fx
    monkeypatch.setattr(proxy_tensor, "make_fx", lambda *a, **k: traces.append(1) or make_fx_here(*a, **k))
    gm, inputs = graph_and_inputs()
    with inner.decomposing_ahead():
        ahead = inner._decomposed_for_inductor(gm, inputs)
    again = inner._decomposed_for_inductor(gm, inputs)
    assert len(traces) == 1 and again is not ahead and again.code == ahead.code
    _, transposed = graph_and_inputs(transposed_x=True)
    inner._decomposed_for_inductor(gm, transposed)  # other layouts: traced
    inner._decomposed_for_inductor(gm, inputs)  # the kept graph was taken once
    assert len(traces) == 3
