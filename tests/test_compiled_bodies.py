"""Chunk-loop bodies compiled once per signature (laplace_passes.unroll.compiled_bodies).

NOTE [chunk-loop bodies compiled once]: with inner inductor on the cpu
target, each GLA chunk-loop op stays one node calling its twin, whose body
Inductor compiles once for every site of a signature. Checked against the
token-by-token recurrence and its autograd (values and gradients of two
layers sharing one body), by the graphs (twins, no inlined body; inlined
where a size is symbolic or the inner compiler is not Inductor), by what
the process compiled (one forward and one backward body for both layers),
and by the fallback when Inductor fails (the same numbers, and a warning).
"""

import os
import warnings

import pytest
import torch
from torch.testing import FileCheck

import laplace_passes
from laplace_passes.ops.chunked import CHUNK_LOOP_OPS, chunked_gla_op
from laplace_passes.ops.gla import gla_recurrence
from laplace_passes.unroll import body_helper, compiled_bodies, split
from laplace_passes.unroll.compiled_bodies import BODIES, CompiledBodies, signature
from tests.gla_cases import make_inputs

B, T, H, K, V = 1, 100, 2, 8, 6  # two chunks of 64 on the cpu target, the second padded


def two_layers(q, k, v, gk, h0):
    """Two GLA sites of the same signature, the second fed by the first: what a model's layers look like."""
    o1, s1 = laplace_passes.gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    o2, s2 = laplace_passes.gla(q, k, torch.tanh(o1), gk, initial_state=s1, output_final_state=True)
    return (o2 * o2).sum() + (s2 * s2).sum()


def two_layers_by_the_recurrence(q, k, v, gk, h0):
    scale = K ** -0.5
    o1, s1 = gla_recurrence(q, k, v, gk, h0, scale)
    o2, s2 = gla_recurrence(q, k, torch.tanh(o1), gk, s1, scale)
    return (o2 * o2).sum() + (s2 * s2).sum()


def leaves():
    return [t.clone().requires_grad_(True) for t in make_inputs(B, T, H, K, V, gate_divisor=0.5, seed=7)]


@pytest.fixture(scope="module")
def compiled_two_layers():
    signatures_before = BODIES.signatures()
    compiled_ahead = []  # per graph compiled: the bodies compiled with it, before its first call
    real_compile_ahead, real_run, forward_calls = split.compile_ahead, BODIES.run, []

    def run(op, args):
        if op is CHUNK_LOOP_OPS[0] and not forward_calls:
            forward_calls.append(tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args))
        return real_run(op, args)

    with pytest.MonkeyPatch.context() as patch:
        if os.environ.get(body_helper.SWITCH) != "0":  # on one core the helper is off unless switched on
            patch.setenv(body_helper.SWITCH, "1")
        patch.setattr(split, "compile_ahead",
                      lambda gm, kind: compiled_ahead.append(real_compile_ahead(gm, kind)))
        patch.setattr(BODIES, "run", run)
        compiled = laplace_passes.compile(two_layers, target="cpu", inner="inductor")
        inputs = leaves()
        loss = compiled(*inputs)
        grads = torch.autograd.grad(loss, inputs)
    return compiled, loss, grads, BODIES.signatures() - signatures_before, compiled_ahead, forward_calls[0]


def test_two_layers_sharing_one_compiled_body_match_the_recurrence_and_its_autograd(compiled_two_layers):
    _, loss, grads, *_ = compiled_two_layers
    inputs = leaves()
    expected = two_layers_by_the_recurrence(*inputs)
    expected_grads = torch.autograd.grad(expected, inputs)
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    for name, got, want in zip(("q", "k", "v", "gk", "h0"), grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4, msg=name)


def test_each_graph_calls_the_twins_and_the_process_compiled_one_body_per_direction(compiled_two_layers):
    compiled, _, _, new_signatures, *_ = compiled_two_layers
    report = compiled.laplace_report
    for kind, twin in (("forward", "laplace.chunked_gla_inductor"),
                       ("backward", "laplace.chunked_gla_backward_inductor")):
        code = report.graph("after", f"{kind}_0").code
        assert code.count(f"torch.ops.{twin}.default(") == 2, code
        FileCheck().check_not("laplace.chunk_recurrence").check_not("aten.bmm").run(code)  # no inlined body
    # Both layers' sites share a signature: one forward body and one backward body for the two of them.
    assert sorted(str(key[0]) for key in new_signatures) == sorted(map(str, CHUNK_LOOP_OPS)), new_signatures
    loops = [loop for g in report.graphs for loop in g.loops]
    assert [loop.status for loop in loops] == ["compiled"] * 4 and {loop.trip_count for loop in loops} == {2}
    summaries = [p.summary for p in report.passes if p.name == "unroll_loops" and not p.graph.startswith("dynamo")]
    assert all("2 loops kept whole, their bodies compiled once per shape" in s for s in summaries), summaries


def test_a_site_alone_in_its_graph_gets_the_inlined_body():
    """One site: its body is compiled once either way, and inlined it runs faster."""
    report = laplace_passes.Report()
    q, k, v, gk, h0 = make_inputs(B, T, H, K, V)

    def one_layer(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    compiled = torch.compile(one_layer, backend="laplace", options={"report": report, "target": "cpu",
                                                                    "inner": "inductor"})
    torch.testing.assert_close(compiled(q, k, v, gk), one_layer(q, k, v, gk), rtol=1e-4, atol=1e-5)
    assert [loop.status for g in report.graphs for loop in g.loops] == ["unrolled"]
    FileCheck().check("laplace.chunk_recurrence").check_not("_inductor.default").run(
        report.graph("after", "inference_0").code)


def test_a_symbolic_batch_gets_the_inlined_body():
    report = laplace_passes.Report()
    q, k, v, gk, h0 = make_inputs(3, T, H, K, V)
    for x in (q, k, v, gk):
        torch._dynamo.mark_dynamic(x, 0)  # the batch symbolic, the rest static

    def two_sites(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0] + laplace_passes.gla(k, q, v, gk)[0]

    compiled = torch.compile(two_sites, backend="laplace",
                             options={"report": report, "target": "cpu", "inner": "inductor"})
    torch.testing.assert_close(compiled(q, k, v, gk), two_sites(q, k, v, gk), rtol=1e-4, atol=1e-5)
    statuses = [loop.status for g in report.graphs for loop in g.loops]
    assert statuses == ["unrolled", "unrolled"], statuses
    FileCheck().check("laplace.chunk_recurrence").check_not("_inductor.default").run(
        report.graph("after", "inference_0").code)


@pytest.mark.parametrize("options", [{"inner": "eager"}, {"inner": "inductor", "share_loop_bodies": False}])
def test_the_eager_inner_compiler_and_the_option_off_get_the_inlined_body(options):
    """The inference graph only: Inductor's codegen of the inlined forward and backward took 43 s; which body
    a graph gets is decided alike for both."""
    compiled = laplace_passes.compile(two_layers, target="cpu", **options)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*leaves()), two_layers_by_the_recurrence(*leaves()), rtol=1e-4, atol=1e-5)
    loops = {g.name: [loop.status for loop in g.loops] for g in compiled.laplace_report.graphs}
    assert loops == {"dynamo_0": [], "inference_0": ["unrolled"] * 2}, loops


def test_share_loop_bodies_takes_a_bool_only():
    with pytest.raises(TypeError, match="share_loop_bodies must be a bool, got str"):
        laplace_passes.compile(two_layers, target="cpu", inner="inductor", share_loop_bodies="yes")


def test_a_body_inductor_cannot_compile_runs_op_by_op_with_a_warning():
    def failing(gm, fakes):
        raise RuntimeError("no C++ compiler")

    bodies = CompiledBodies(compile_body=failing)
    q, k, v, gk, h0 = make_inputs(B, T, H, K, V, seed=3)
    args = (q, k, v, gk, h0, 0.3, 64, 8, True)
    with pytest.warns(UserWarning, match=r"could not compile the body of laplace.chunked_gla at .*"
                                         r"\(RuntimeError: no C\+\+ compiler\); it runs op by op instead"):
        got = bodies.run(CHUNK_LOOP_OPS[0], args)
    expected = chunked_gla_op(*args)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per signature
        bodies.run(CHUNK_LOOP_OPS[0], args)
    assert len(bodies) == 1


def test_a_body_that_cannot_be_traced_runs_op_by_op_with_a_warning(monkeypatch):
    def untraceable(*args):
        raise RuntimeError("data-dependent control flow")

    monkeypatch.setattr(compiled_bodies, "_traced_body", untraceable)
    bodies = CompiledBodies()
    q, k, v, gk, h0 = make_inputs(B, T, H, K, V, seed=4)
    args = (q, k, v, gk, h0, 0.3, 64, 8, True)
    with pytest.warns(UserWarning, match=r"\(RuntimeError: data-dependent control flow\); it runs op by op instead"):
        got = bodies.run(CHUNK_LOOP_OPS[0], args)
    for g, e in zip(got, chunked_gla_op(*args)):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_a_new_layout_is_a_new_signature_and_outputs_keep_the_fake_kernel_strides():
    compiles = []

    def counting(gm, fakes):
        compiles.append(gm)
        return lambda tensors: gm(*tensors)

    bodies = CompiledBodies(compile_body=counting)
    q, k, v, gk, h0 = make_inputs(B, T, H, K, V, seed=5)
    strided_q = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, another layout
    assert signature(CHUNK_LOOP_OPS[0], (q,)) != signature(CHUNK_LOOP_OPS[0], (strided_q,))
    grad_o = torch.randn(B, T, H, V)
    args = (q, k, v, gk, h0, grad_o, None, None, None, 0.3, 64, 8)
    for query in (q, strided_q, q):
        got = bodies.run(CHUNK_LOOP_OPS[1], (query,) + args[1:])
        expected = torch.ops.laplace.chunked_gla_backward(query, *args[1:])
        for g, e in zip(got, expected):
            assert g.stride() == e.stride() and g.shape == e.shape  # contiguous, as the op's fake kernel says
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert len(compiles) == 2 and len(bodies) == 2


def test_the_twins_take_the_ops_arguments_and_give_their_values():
    q, k, v, gk, h0 = make_inputs(B, T, H, K, V, seed=11)
    args = (q, k, v, gk, h0, 0.3, 64, 8, False)
    got = compiled_bodies.TWINS[CHUNK_LOOP_OPS[0]](*args)
    for g, e in zip(got, chunked_gla_op(*args)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_the_chunk_loop_ops_fake_kernels_give_the_strides_their_bodies_return():
    """The host graph is traced with the fake kernels' strides, which the twins' compiled bodies then produce:
    they must be what the ops return eagerly, for transposed inputs too (all contiguous)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, gk, h0 = make_inputs(B, T, H, K, V, seed=13)
    transposed = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, gk)]
    grad_o = torch.randn(B, T, H, V)
    calls = {CHUNK_LOOP_OPS[0]: lambda *x: (*x, h0, 0.3, 64, 8, True),
             CHUNK_LOOP_OPS[1]: lambda *x: (*x, h0, grad_o, None, None, None, 0.3, 64, 8)}
    for op, arguments in calls.items():
        eager = op(*arguments(*transposed))
        mode = FakeTensorMode()
        with mode:
            fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in arguments(*transposed)])
        assert [o.stride() for o in fake] == [o.stride() for o in eager], op


def test_each_body_is_compiled_with_its_graph_or_in_the_helper_not_at_a_first_call(compiled_two_layers):
    """NOTE [kernel builds beside the codegen]: the forward graph's compile compiled the forward body, from the
    twin's fake arguments; the backward's compile the backward body, unless the helper process compiled it
    (then loaded at the backward's first call, after the backward graph's codegen, not before it)."""
    _, _, _, new_signatures, compiled_ahead, _ = compiled_two_layers
    in_helper = os.environ.get(body_helper.SWITCH) != "0"
    assert compiled_ahead == [1, 0 if in_helper else 1] and len(new_signatures) == 2, (compiled_ahead, new_signatures)


@pytest.mark.skipif(os.environ.get(body_helper.SWITCH) == "0",
                    reason="the helper process is switched off (LAPLACE_PASSES_BODY_HELPER=0)")
def test_the_backward_body_was_compiled_in_the_helper_from_the_forward_graph(compiled_two_layers):
    """NOTE [bodies compiled in a helper process]: the backward signature predicted from the forward graph's
    twins is the one the backward graph's twins have; its body was loaded, not compiled, in this process."""
    _, _, _, new_signatures, *_ = compiled_two_layers
    backward = [key for key in new_signatures if key[0] is CHUNK_LOOP_OPS[1]]
    assert len(backward) == 1 and backward[0] in BODIES.from_helper and backward[0] not in BODIES.graphs
    forward = [key for key in new_signatures if key[0] is CHUNK_LOOP_OPS[0]]
    assert forward[0] in BODIES.graphs and forward[0] not in BODIES.from_helper


def test_a_body_compiled_with_its_graph_is_the_body_compiled_at_a_first_call_bit_for_bit(compiled_two_layers):
    """Compiled inside the backend's compile (from fakes, in AOT Autograd's context) or from the real arguments
    at a first call, outside every compile: the same values, bit for bit."""
    *_, forward_args = compiled_two_layers
    at_first_call = CompiledBodies().run(CHUNK_LOOP_OPS[0], forward_args)
    for got, expected in zip(BODIES.run(CHUNK_LOOP_OPS[0], forward_args), at_first_call):
        assert torch.equal(got, expected)
