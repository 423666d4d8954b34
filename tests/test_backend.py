"""The `laplace` backend: compiled equals eager, the graph holds the chunked GLA, the report says so."""

import pytest
import torch
import torch._dynamo
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import laplace_passes
import model_zoo
from laplace_passes.infra.targets import TRN2
from tests.lm_cases import capture_inner, loss_and_grads, tokens

# Outputs of an fp32 model whose GLA goes from a token loop to chunked
# matmuls: the sums are reordered, nothing else.
RTOL, ATOL = 1e-4, 1e-5


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return model_zoo.build("tiny")


def test_compiled_tiny_model_equals_eager_at_2048_tokens():
    model, ids = tiny_model(), tokens(2048)
    expected_logits, expected_grads = loss_and_grads(model, ids)
    report = laplace_passes.Report()
    compiled = torch.compile(model, backend="laplace", options={"target": "trn2", "report": report})
    logits, grads = loss_and_grads(model, ids, compiled)
    torch.testing.assert_close(logits, expected_logits, rtol=RTOL, atol=ATOL)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-3, atol=1e-5, msg=name)

    # Two layers, two sites, each 16 chunks of 128 tokens.
    assert [(s.status, s.plan) for s in report.sites] == [
        ("retiled", {"T": 2048, "chunk_size": 128, "n_chunks": 16, "padding": 0})
    ] * 2
    text = str(report)
    assert "2 of 2 GLA sites re-tiled at chunk 128" in text
    # The ATen graphs hold the chunked computation, unrolled: no GLA op of any kind.
    for kind in ("forward", "backward"):
        code = report.graph("after", f"{kind}_0").code
        FileCheck().check_not("laplace.gla").check_not("laplace.chunked_gla").run(code)
        FileCheck().check("aten.bmm").run(code)
    # The Dynamo graph holds one GLA chunk-loop op per site, which AOT Autograd differentiates.
    FileCheck().check("laplace.gla.default").run(report.graph("before").code)
    # tiny's gates are logsigmoid(...) / 16, <= 0 by construction: no run-time check (NOTE [gates proven <= 0]).
    FileCheck().check_not("laplace.gla.default").check_not("laplace.check_gates").check(
        "laplace.chunked_gla.default").run(report.graph("after").code)


def test_chunk_size_comes_from_the_target():
    model, ids = tiny_model(), tokens(256)
    for target, chunks in (("trn2", 2), ("cpu", 4)):
        report = laplace_passes.inspect(model, ids, target=target)
        assert {s.plan["n_chunks"] for s in report.sites} == {chunks}
        assert report.sites[0].plan["chunk_size"] == laplace_passes.get_target(target).chunk_size


def test_decorator_forms_and_report_attribute():
    q, k, v, gk = (torch.randn(1, 96, 2, 8) for _ in range(4))
    gk = -gk.abs()

    @laplace_passes.compile
    def plain(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    @laplace_passes.compile(target="cpu", inner="eager")
    def configured(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    expected = laplace_passes.gla(q, k, v, gk)[0]
    for fn, chunk in ((plain, 128), (configured, 64)):
        torch.testing.assert_close(fn(q, k, v, gk), expected, rtol=RTOL, atol=ATOL)
        assert fn.laplace_report.sites[0].plan["chunk_size"] == chunk
        assert fn.laplace_report.sites[0].plan["padding"] == -96 % chunk


def test_callable_inner_receives_forward_and_backward_aten_graphs():
    capture, seen = capture_inner()
    model, ids = tiny_model(), tokens(64)
    expected, _ = loss_and_grads(model, ids)
    compiled = laplace_passes.compile(model, target="cpu", inner=capture)
    logits, _ = loss_and_grads(model, ids, compiled)
    torch.testing.assert_close(logits, expected, rtol=RTOL, atol=ATOL)
    assert len(seen) == 2  # forward, then backward
    for gm in seen:
        assert all(n.target != torch.ops.laplace.gla.default for n in gm.graph.nodes)


def test_inductor_inner_matches_eager():
    q, k, v, gk = (torch.randn(1, 64, 2, 8, requires_grad=True) for _ in range(4))

    def f(q, k, v, gk):
        o, state = laplace_passes.gla(q, k, v, torch.nn.functional.logsigmoid(gk), output_final_state=True)
        return o.sum() + state.sum()

    expected = f(q, k, v, gk)
    expected_grads = torch.autograd.grad(expected, (q, k, v, gk))
    compiled = laplace_passes.compile(f, target="cpu", inner="inductor")
    got = compiled(q, k, v, gk)
    grads = torch.autograd.grad(got, (q, k, v, gk))
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=1e-4)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-4)


def test_inductor_runs_the_cpu_chunk_recurrence_op_and_matches_eager():
    """T = 200 on cpu: 4 chunks, the recurrence one laplace::chunk_recurrence call in each compiled graph."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, gk = (torch.randn(1, 200, 2, 8, generator=gen, requires_grad=True) for _ in range(4))
    h0 = torch.randn(1, 2, 8, 8, generator=gen, requires_grad=True)

    def f(q, k, v, gk, h0):
        o, state = laplace_passes.gla(q, k, v, torch.nn.functional.logsigmoid(gk), initial_state=h0,
                                      output_final_state=True)
        return (o * o).sum() + (state * state).sum()

    expected = f(q, k, v, gk, h0)
    expected_grads = torch.autograd.grad(expected, (q, k, v, gk, h0))
    compiled = laplace_passes.compile(f, target="cpu", inner="inductor")
    got = compiled(q, k, v, gk, h0)
    grads = torch.autograd.grad(got, (q, k, v, gk, h0))
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=1e-4)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-4)
    for kind in ("forward", "backward"):
        FileCheck().check("laplace.chunk_recurrence").run(compiled.laplace_report.graph("after", f"{kind}_0").code)


def test_inductor_s_cpp_wrapper_setting_is_honoured():
    """NOTE [the C++ wrapper] in laplace_passes/infra/inner.py: with `torch._inductor.config.cpp_wrapper` set, the
    forward and backward graphs get Inductor's C++ wrapper, not its Python one, with eager's values and gradients."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, gk = (torch.randn(1, 16, 2, 8, generator=gen, requires_grad=True) for _ in range(4))

    def f(q, k, v, gk):
        o, state = laplace_passes.gla(q, k, v, torch.nn.functional.logsigmoid(gk), output_final_state=True)
        return (o * o).sum() + state.sum()

    def value_and_grads(fn):
        value = fn(q, k, v, gk)
        return value, torch.autograd.grad(value, (q, k, v, gk))

    expected, expected_grads = value_and_grads(f)
    compiled = laplace_passes.compile(f, target="cpu", inner="inductor")
    with torch._inductor.config.patch(cpp_wrapper=True, fx_graph_cache=False):
        (got, grads), codes = run_and_get_code(value_and_grads, compiled)
    assert len(codes) == 2, len(codes)  # the forward and the backward graph
    for code in codes:  # the C++ wrapper's handles, and none of the Python wrapper's `call`
        assert "AtenTensorHandle" in code and "def call(self, args)" not in code, code[:2000]
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=1e-4)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-4)


def test_dynamic_sequence_length_keeps_the_chunk_loop_as_a_runtime_loop():
    def f(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    report = laplace_passes.Report()
    compiled = torch.compile(f, backend="laplace", options={"report": report, "target": "cpu"})
    for T in (40, 70, 150):  # the second length recompiles with a symbolic T: 2, then 3 chunks of 64
        q, k, v, gk = (torch.randn(1, T, 2, 8) for _ in range(4))
        torch.testing.assert_close(compiled(q, k, v, -gk.abs()), f(q, k, v, -gk.abs()), rtol=RTOL, atol=1e-4)
    static, site = report.sites
    assert static.plan["T"] == 40
    assert site.status == "retiled" and isinstance(site.plan["T"], str) and site.plan["n_chunks"] == "run time"
    assert site.form.startswith("chunked, kept as a runtime loop: T is dynamic")
    # The token recurrence is gone; the chunk loop runs as one op, its trip count taken at run time.
    FileCheck().check_not("laplace.gla.default").check("laplace.chunked_gla").run(
        report.graph("after", "inference_1").code)
    (loop,) = report.graph_record("inference_1").loops
    assert loop.status == "declined" and loop.reason.startswith("kept as a runtime loop: T is dynamic")


def test_dynamic_value_dimension_keeps_the_chunk_loop_as_a_runtime_loop():
    def f(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    q, k, gk = (torch.randn(1, 100, 1, 8) for _ in range(3))  # over cpu's 64 tokens of the recurrent form
    v = torch.randn(1, 100, 1, 6)
    torch._dynamo.mark_dynamic(v, 3)
    report = laplace_passes.Report()
    compiled = torch.compile(f, backend="laplace", options={"report": report, "target": "cpu"})
    torch.testing.assert_close(compiled(q, k, v, -gk.abs()), f(q, k, v, -gk.abs()), rtol=RTOL, atol=1e-4)
    (site,) = report.sites
    assert site.status == "retiled" and site.shape["V"].startswith("s")
    (loop,) = report.graph_record("inference_0").loops
    assert loop.reason.startswith("kept as a runtime loop: a dynamic size other than the batch (s")


def test_default_scale_of_a_dynamic_head_size_is_declined_with_a_reason():
    def f(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    report = laplace_passes.Report()
    compiled = torch.compile(f, backend="laplace", dynamic=True, options={"report": report, "target": "cpu"})
    q, k, v, gk = (torch.randn(1, 20, 2, 8) for _ in range(4))
    torch.testing.assert_close(compiled(q, k, v, -gk.abs()), f(q, k, v, -gk.abs()))
    (site,) = report.sites
    assert site.status == "declined" and site.reason.startswith("the scale is computed at run time")


def test_retiling_can_be_switched_off():
    def f(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    q, k, v, gk = (torch.randn(1, 40, 2, 8) for _ in range(4))
    report = laplace_passes.inspect(f, q, k, v, -gk.abs(), retile_gla=False)
    FileCheck().check("laplace.gla").check_not("chunked_gla").run(report.graph("after").code)
    # The report still lists the site, declined, saying why (not "GLA sites: none").
    (retile,) = [p for p in report.passes if p.name == "retile_gla"]
    assert not retile.modified and retile.summary == "0 of 1 GLA sites re-tiled: option retile_gla=False"
    (site,) = report.sites
    assert (site.origin, site.status) == ("laplace.gla", "declined")
    assert site.reason.startswith("option retile_gla=False: the site stays laplace::gla")
    assert "retile_gla=False" in str(report).split("GLA sites:")[1]


def test_unknown_options_are_named():
    with pytest.raises(ValueError) as error:
        laplace_passes.compile(lambda x: x, chunks=3)
    first_line, *option_lines = str(error.value).splitlines()  # the cause and the likely fix on the first line
    assert first_line == "unknown laplace option(s) ['chunks'] (did you mean chunk_size= for chunks?); known options:"
    # Every option the README's table lists, with what it means, one a line.
    for option in ("target", "inner", "chunk_size", "retile_gla", "report", "muon_all_to_all", "max_graph_instructions"):
        assert any(line.startswith(f"  {option}: ") for line in option_lines)
    with pytest.raises(ValueError, match=r"unknown laplace option\(s\) \['mode'\] \(mode is a setting of "
                                         r"Inductor's own backend: for Inductor after the laplace passes, "
                                         r"inner='inductor', with Inductor's settings in torch._inductor.config"):
        laplace_passes.compile(lambda x: x, mode="max-autotune")
    with pytest.raises(ValueError, match=r"unknown target 'trn9'; known targets: cpu, trn1, trn2"):
        laplace_passes.compile(lambda x: x, target="trn9")
    with pytest.raises(ValueError, match=r"unknown inner compiler 'xla'; known: eager, inductor, iree, neuron, "
                                         r"stablehlo, or a callable \(graph_module, example_inputs\) -> callable"):
        laplace_passes.compile(lambda x: x, inner="xla")
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, got 0"):
        laplace_passes.compile(lambda x: x, chunk_size=0)


def test_trn2_target_numbers():
    assert TRN2.chunk_size == TRN2.partitions == 128
    assert TRN2.sbuf_bytes == 28 * 1024 * 1024
    assert TRN2.max_graph_instructions == 5_000_000
    assert TRN2.collectives.all_to_all_equal_splits_only
    assert [n for n in range(1, 97) if TRN2.collectives.group_size_supported(n)] == [4, 8, 16, 32, 64, 96]
