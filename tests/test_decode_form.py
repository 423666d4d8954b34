"""Short GLA sites without gradient (decode) get the recurrent form; others stay chunked, with the reason."""

import operator

import torch

import pytest

import laplace_passes
from laplace_passes.fx.retile import RetileGLA
from laplace_passes.infra.targets import CPU
from laplace_passes.ops.gla import gla_op, gla_recurrence
from tests.gla_cases import make_inputs, relative_rmse


def site(q, k, v, gk, h0):
    return laplace_passes.gla(q, k, v, gk, initial_state=h0, output_final_state=True)


def test_short_site_without_gradient_is_recurrent_and_exact():
    inputs = make_inputs(3, 12, 2, 8, 4)
    compiled = laplace_passes.compile(site, target="cpu")
    with torch.no_grad():
        o, state = compiled(*inputs)
        o_ref, state_ref = site(*inputs)  # eager: the token recurrence
    assert relative_rmse(o, o_ref) < 1e-6 and relative_rmse(state, state_ref) < 1e-6
    (record,) = compiled.laplace_report.sites
    assert record.plan == {"T": 12, "chunk_size": 1, "n_chunks": 12, "padding": 0}
    assert record.form.startswith("recurrent: T = 12 <= 64, no gradient")
    after = compiled.laplace_report.graph("after")
    (recurrence,) = [n for n in after.graph.nodes if n.op == "call_function" and n.target.__name__ == "gla_recurrence"]
    assert recurrence.args[-1] == "reduce"  # the cpu target's readout


def test_each_target_installs_its_readout_and_an_unknown_one_is_refused():
    inputs = make_inputs(2, 4, 2, 8, 4)
    for target, readout in (("cpu", "reduce"), ("trn2", "matmul")):
        report = laplace_passes.inspect(site, *inputs, target=target)
        (recurrence,) = [n for n in report.graph("after").graph.nodes
                         if n.op == "call_function" and n.target.__name__ == "gla_recurrence"]
        assert recurrence.args[-1] == readout, target
    with pytest.raises(ValueError, match=r"recurrent_readout must be one of \('matmul', 'reduce'\), got 'dot'"):
        RetileGLA(64, 4, 64, "dot")
    with pytest.raises(ValueError, match=r"readout must be one of \('matmul', 'reduce'\), got 'dot'"):
        gla_recurrence(*inputs, 0.5, "dot")


def test_short_site_with_gradient_stays_chunked_and_says_why():
    q, k, v, gk, h0 = make_inputs(1, 12, 2, 8, 4)
    compiled = laplace_passes.compile(site, target="cpu")
    compiled(q.requires_grad_(), k, v, gk, h0)[0].sum().backward()
    (record,) = compiled.laplace_report.sites
    assert record.plan["chunk_size"] == 64 and "gradients flow through it" in record.form


def test_decode_site_of_a_dynamic_batch_keeps_the_recurrent_form():
    """torch's default dynamic: a second batch size recompiles with a symbolic batch (generate does this)."""
    def decode_step(q, k, v, gk, h0):  # a code object of its own: Dynamo's cache for `site` holds other compiles
        return site(q, k, v, gk, h0)

    report = laplace_passes.Report()
    # cpu: the symbolic graph is compiled as it is (trn2 would compile each batch size on its own).
    compiled = torch.compile(decode_step, backend="laplace", options={"target": "cpu", "report": report})
    with torch.no_grad():
        for batch in (3, 5, 7):
            inputs = make_inputs(batch, 1, 2, 8, 4, seed=batch)
            o, state = compiled(*inputs)
            o_ref, state_ref = site(*inputs)
            assert relative_rmse(o, o_ref) < 1e-6 and relative_rmse(state, state_ref) < 1e-6
    static, dynamic = report.sites  # the third batch reuses the dynamic graph
    assert static.shape["B"] == 3 and isinstance(dynamic.shape["B"], str)
    assert all(s.status == "retiled" and s.form.startswith("recurrent") for s in (static, dynamic))


def test_the_recurrent_form_traces_to_four_ops_per_token():
    """Two products, a sum and a [1, K] @ [K, V] matmul per token (plus a fixed set of layout ops): tracing
    a 64-token eval step stays quick, and the result is the reference op's, bit for bit."""
    from torch.fx.experimental.proxy_tensor import make_fx

    counts = {}
    for T in (4, 12):
        inputs = make_inputs(2, T, 2, 8, 4)
        gm = make_fx(lambda *x: gla_recurrence(*x, 0.5))(*inputs)
        ops = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
        counts[T] = len(ops)
        assert ops.count(torch.ops.aten.bmm.default) == T
        o, state = gla_recurrence(*inputs, 0.5)
        o_ref, state_ref = gla_op(*inputs, 0.5, "test")
        assert torch.equal(o, o_ref) and torch.equal(state, state_ref)
    assert counts[12] - counts[4] == 4 * (12 - 4), counts


def test_the_reduce_readout_traces_to_five_ops_per_token_and_no_matmul():
    """The cpu target's readout: (q_t^T * S) summed over K, one more op per token than the matmul and no bmm;
    the state bit for bit the reference op's, the output within fp32 rounding (another summation order)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    counts = {}
    for T in (4, 12):
        inputs = make_inputs(2, T, 2, 32, 4)
        gm = make_fx(lambda *x: gla_recurrence(*x, 0.5, "reduce"))(*inputs)
        ops = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
        counts[T] = len(ops)
        assert torch.ops.aten.bmm.default not in ops
        o, state = gla_recurrence(*inputs, 0.5, "reduce")
        o_ref, state_ref = gla_op(*inputs, 0.5, "test")
        torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(state, state_ref)
    assert counts[12] - counts[4] == 5 * (12 - 4), counts


@pytest.mark.parametrize("T, form", [(5, "recurrent"), (6, "chunked")])
def test_a_site_of_exactly_recurrent_max_tokens_gets_the_recurrent_form(T, form):
    """NOTE [short sites]: T <= recurrent_max_tokens without gradient is recurrent, one token more is chunked."""
    target = CPU.with_overrides(recurrent_max_tokens=5)
    inputs = make_inputs(2, T, 2, 8, 4)
    compiled = laplace_passes.compile(site, target=target)
    with torch.no_grad():
        o, state = compiled(*inputs)
        o_ref, state_ref = site(*inputs)  # eager: the token recurrence
    assert relative_rmse(o, o_ref) < 1e-6 and relative_rmse(state, state_ref) < 1e-6
    (record,) = compiled.laplace_report.sites
    assert record.status == "retiled" and record.form.startswith(f"{form}: T = {T} {'<=' if T == 5 else '>'} 5")
    installed = {n.target.__name__ for n in compiled.laplace_report.graph("after").graph.nodes
                 if n.op == "call_function" and hasattr(n.target, "__name__")}
    assert ("gla_recurrence" in installed) == (form == "recurrent")
    assert ("chunked_gla.default" in installed) == (form == "chunked")


@pytest.mark.parametrize("T", [0, 1])
def test_the_recurrent_forms_final_state_never_aliases_the_initial_state(T):
    """An in-place update of a step's final state (a decode buffer) must not write the caller's initial state,
    even when no token updated it (T = 0): as the reference op, the form returns new memory."""
    inputs = make_inputs(2, T, 2, 8, 4)
    initial = inputs[-1]
    before = initial.clone()
    compiled = laplace_passes.compile(site, target="cpu")
    with torch.no_grad():
        o, state = compiled(*inputs)
        state.add_(1.0)
    (record,) = compiled.laplace_report.sites
    assert record.form.startswith("recurrent")
    assert torch.equal(initial, before)
    _, direct = gla_recurrence(*inputs, 0.5)
    direct.add_(1.0)
    assert torch.equal(initial, before)
