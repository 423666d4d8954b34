"""Gates <= 0 by construction go to the GLA op unchecked; any other gate keeps its run-time check.

NOTE [gates proven <= 0] in `laplace_passes.fx.gate_bounds`. Each case below
compiles a GLA call whose gates are built from an input x, and checks what
the re-tiling pass decided (the report's "gates" column and the graph), and
what that decision means at run time: a proven gate gives the eager op's
results without a check, an unproven one still refuses a positive gate.
"""

import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import laplace_passes
import model_zoo
from laplace_passes.driver.compile_fx import fresh_code
from laplace_passes.fx.in_place_writes import written_operands
from laplace_passes.fx.gate_bounds import NONNEGATIVE, NONPOSITIVE, gate_bound
from tests.gla_cases import relative_rmse

B, H, K, V = 1, 2, 4, 8

def _write_before_the_source(x):
    doubled = x.clone()
    doubled.mul_(2.0)
    return F.logsigmoid(doubled) / 16


# name -> gates from x; each is <= 0 for every x (the pass must prove it).
PROVEN = {
    "logsigmoid / 16": (lambda x: F.logsigmoid(x) / 16, "logsigmoid / 16"),
    "logsigmoid * 0.5": (lambda x: F.logsigmoid(x) * 0.5, "logsigmoid"),
    "-softplus": (lambda x: -F.softplus(x), "-(softplus)"),
    "-softplus(beta=2)": (lambda x: -F.softplus(x, beta=2.0), "-(softplus)"),
    "-relu": (lambda x: -F.relu(x), "-(relu)"),
    "-exp, a method": (lambda x: -(x.exp()), "-(exp)"),
    "logsigmoid * sigmoid": (lambda x: F.logsigmoid(x) * torch.sigmoid(x), "(logsigmoid) * (sigmoid)"),
    "-2 * abs": (lambda x: -2.0 * x.abs(), "(-2.0) * (abs)"),
    "clamp(max=0)": (lambda x: x.clamp(max=0.0), "clamp(max=0.0)"),
    "clamp_min(logsigmoid / 16, -5), as fla's clamp_min": (
        lambda x: torch.clamp_min(F.logsigmoid(x) / 16, -5.0), "clamp(logsigmoid / 16, min=-5.0)"),
    "torch.mul(other=0.5)": (lambda x: torch.mul(F.logsigmoid(x), other=0.5), "logsigmoid"),
    "torch.div(other=16.0)": (lambda x: torch.div(F.logsigmoid(x), other=16.0), "logsigmoid / 16.0"),
    "torch.neg(input=softplus)": (lambda x: torch.neg(input=F.softplus(x)), "-(softplus)"),
    "shifted one token, RWKV6's -exp": (lambda x: F.pad(-x.exp(), (0, 0, 0, 0, 1, -1)), "pad(-(exp), 0.0)"),
    # An in-place write the gates do not read from leaves the proof standing.
    "logsigmoid of a tensor written in place": (_write_before_the_source, "logsigmoid / 16"),
    "views and casts": (lambda x: F.logsigmoid(x.double()).transpose(1, 2).contiguous().transpose(1, 2).float(),
                        "logsigmoid"),
    # A skipped step's gate 0 (NOTE [steps a select skips]), and a select between two bounded gates.
    "where(x > 0, logsigmoid / 16, 0)": (lambda x: torch.where(x > 0, F.logsigmoid(x) / 16, 0.0),
                                         "where(c, logsigmoid / 16, 0)"),
    "where(x > 0, -softplus, logsigmoid)": (lambda x: torch.where(x > 0, -F.softplus(x), F.logsigmoid(x)),
                                            "where(c, -(softplus), logsigmoid)"),
    # A sum of nonpositive terms: log(decay) + log(c) where a loop's coefficient c <= 1 multiplies the state.
    "logsigmoid + log(0.5)": (lambda x: F.logsigmoid(x) + math.log(0.5), "(logsigmoid) + (-0.693"),
    "-softplus + logsigmoid": (lambda x: -F.softplus(x) + F.logsigmoid(x), "(-(softplus)) + (logsigmoid)"),
}

def _add_in_place(x):
    gates = F.logsigmoid(x)
    gates.add_(1.0)
    return gates


def _set_an_item(x):
    gates = F.logsigmoid(x)
    gates[..., 0] = 1.0
    return gates


def _add_through_a_view(x):
    gates = F.logsigmoid(x) / 16
    gates.view(-1).add_(5.0)
    return gates


def _add_through_data(x):
    gates = F.logsigmoid(x) / 16
    gates.data.add_(5.0)
    return gates


def _add_through_unbind(x):
    gates = -F.softplus(x)
    gates.unbind(1)[3].add_(50.0)
    return gates


def _copy_in(x):
    gates = F.logsigmoid(x) / 16
    gates.copy_(x)
    return gates


def _add_in_place_operator(x):
    gates = F.logsigmoid(x) / 16
    flat = gates.view(-1)
    flat += 3.0  # `gates += 3.0` would rebind gates to the sum, which the pass does not bound anyway
    return gates


def _hardtanh_in_place(x):
    gates = F.logsigmoid(x) / 16
    F.hardtanh(gates, 1.0, 2.0, True)  # inplace given by position
    return gates


def _write_out(x):
    gates = F.logsigmoid(x) / 16
    torch.add(x, 1.0, out=gates)
    return gates


def _foreach_add(x):
    gates, other = F.logsigmoid(x) / 16, F.logsigmoid(x)
    torch._foreach_add_([other, gates], 5.0)  # the gates are the second tensor of the list
    return gates


def _foreach_mul_a_tuple(x):
    gates = F.logsigmoid(x) / 16
    torch._foreach_mul_((gates,), -1.0)  # a tuple, not a list
    return gates


def _foreach_copy(x):
    gates = F.logsigmoid(x) / 16
    torch._foreach_copy_([gates], [x])
    return gates


def _foreach_addcmul(x):
    gates = F.logsigmoid(x) / 16
    torch._foreach_addcmul_([gates], [x], [x], 1.0)
    return gates


def _amp_unscale(x):
    # Writes its tensor list (scaled by 1 / inv_scale) and found_inf: here the gates are found_inf's memory.
    gates = F.logsigmoid(x[:1, :1, :1, :1]).reshape(1) / 16
    torch._amp_foreach_non_finite_check_and_unscale_([x.clone()], gates, torch.ones(1))
    return gates.expand(x.shape) + 0 * x


# name -> (gates from x, x making some gate positive, why the pass keeps the check)
CHECKED = {
    "an input": (lambda x: x, "is an input of the graph"),
    "logsigmoid / -16": (lambda x: F.logsigmoid(x) / -16, "checked at run time: (sign >= 0)"),
    "logsigmoid + 0.01": (lambda x: F.logsigmoid(x) + 0.01, "a sum of terms of opposite signs"),
    "softplus": (lambda x: F.softplus(x), "(sign >= 0)"),
    "logsigmoid padded with 0.5": (lambda x: F.pad(F.logsigmoid(x), (0, 0, 0, 0, 1, -1), value=0.5),
                                   "pad with mode 'constant' and value 0.5"),
    "-softplus(beta=-1)": (lambda x: -F.softplus(x, beta=-1.0), "softplus with beta -1.0"),
    "clamp(max=0.5)": (lambda x: x.clamp(max=0.5), "clamp(min=None, max=0.5)"),
    "clamp_min(logsigmoid, 0.1)": (lambda x: torch.clamp_min(F.logsigmoid(x), 0.1), "clamp(min=0.1, max=None)"),
    "logsigmoid / a tensor": (lambda x: F.logsigmoid(x) / (x - 10), "not a finite non-zero number"),
    # Casts that do not keep the sign: a negative gate becomes True (1.0), or wraps around in uint8.
    "logsigmoid cast to bool": (lambda x: F.logsigmoid(x).to(torch.bool).float() * 0.5,
                                "is torch.bool, not a signed floating-point dtype"),
    "-softplus cast to uint8": (lambda x: (-F.softplus(x)).to(torch.uint8).float() * 0.01, "is torch.uint8"),
    # The low half of a negative float32, read as float16, can be positive.
    "-softplus viewed as float16": (lambda x: (-F.softplus(x)).view(torch.float16)[..., ::2].float(),
                                    "reads torch.float32 as torch.float16"),
    # softplus returns x itself above its threshold: with a negative one, x in (threshold, 0) comes back negative.
    "-softplus(threshold=-5)": (lambda x: -F.softplus(x, threshold=-5.0), "threshold -5.0"),
    "where(x < 0, logsigmoid, 0.5)": (lambda x: torch.where(x < 0, F.logsigmoid(x), 0.5),
                                      "a select between values of opposite signs"),
    "where(x < 0, logsigmoid, x)": (lambda x: torch.where(x < 0, F.logsigmoid(x), x), "is an input of the graph"),
    # float8_e8m0fnu is floating point without a sign bit: -0.5 comes back as 0.5.
    "logsigmoid through float8_e8m0fnu": (lambda x: F.logsigmoid(x).to(torch.float8_e8m0fnu).float(),
                                          "is torch.float8_e8m0fnu, not a signed floating-point dtype"),
    # The op reads what an in-place write leaves in the gates' memory, not the value the derivation bounds.
    "logsigmoid, then add_": (_add_in_place, "add_ writes in place to gates, which shares memory with gates"),
    "logsigmoid, then an item set": (_set_an_item, "setitem writes in place to gates"),
    "logsigmoid / 16, then add_ through a view": (_add_through_a_view, "add_ writes in place to view"),
    "logsigmoid / 16, then add_ through .data": (_add_through_data, "add_ writes in place to _get_data_attr"),
    "-softplus, then add_ to one of its unbind": (_add_through_unbind, "add_ writes in place to getitem"),
    "logsigmoid / 16, then copy_": (_copy_in, "copy_ writes in place to gates"),
    "logsigmoid / 16, then +=": (_add_in_place_operator,
                                 "iadd (flat_1) writes in place to flat, which shares memory with gates"),
    "logsigmoid / 16, then out=": (_write_out, "add writes in place to gates"),
    "logsigmoid / 16, then hardtanh(inplace)": (_hardtanh_in_place, "writes in place to gates"),
    # Ops that write each tensor of a list or tuple argument.
    "logsigmoid / 16, then _foreach_add_ of a list": (_foreach_add, "_foreach_add_ writes in place to"),
    "logsigmoid / 16, then _foreach_mul_ of a tuple": (_foreach_mul_a_tuple, "_foreach_mul_ writes in place to"),
    "logsigmoid / 16, then _foreach_copy_": (_foreach_copy, "_foreach_copy_ writes in place to"),
    "logsigmoid / 16, then _foreach_addcmul_": (_foreach_addcmul, "_foreach_addcmul_ writes in place to"),
}


def _inputs(T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    x = torch.randn(B, T, H, K, generator=gen) * 3
    return q, k, v, x


def _layer(gates):
    def layer(q, k, v, x):
        return laplace_passes.gla(q, k, v, gates(x), scale=0.5)[0]
    return layer


def _compile(gates, **options):
    # A code object per case: Dynamo caches (and counts its 8 recompiles) per code object.
    return laplace_passes.compile(fresh_code(_layer(gates)), target="cpu", **options)


def _check_nodes(compiled) -> int:
    graph = compiled.laplace_report.graph("after").graph
    return sum(n.target is torch.ops.laplace.check_gates.default for n in graph.nodes)


@pytest.mark.parametrize("T", [8, 100])  # the recurrent form (T <= 64 without gradient) and the chunked one
@pytest.mark.parametrize("name", PROVEN)
def test_gates_proven_nonpositive_are_not_checked_and_give_the_eager_results(name, T):
    gates, how = PROVEN[name]
    compiled = _compile(gates)
    inputs = _inputs(T)
    with torch.no_grad():
        actual = compiled(*inputs)
    expected = _layer(gates)(*inputs)  # eager: the token recurrence, gates checked
    assert relative_rmse(actual, expected) < 1e-5
    (site,) = compiled.laplace_report.sites
    assert site.gates.startswith("<= 0 by construction: ") and how in site.gates, site.gates
    assert _check_nodes(compiled) == 0
    assert site.form.startswith("recurrent" if T == 8 else "chunked")
    (retile,) = [p for p in compiled.laplace_report.passes if p.name == "retile_gla"]
    assert retile.summary.endswith("; gates <= 0 by construction at 1, not checked at run time")


@pytest.mark.parametrize("name", CHECKED)
def test_gates_the_pass_cannot_bound_keep_the_run_time_check(name):
    gates, why = CHECKED[name]
    compiled = _compile(gates)
    q, k, v, x = _inputs(100)
    x = x.abs() + 1 if name != "logsigmoid / -16" else x  # every construction here then has a positive gate
    x = -x if name in ("-softplus(beta=-1)", "-softplus(threshold=-5)") else x
    with torch.no_grad():
        with pytest.raises(ValueError, match="gk must be <= 0 everywhere"):
            compiled(q, k, v, x)
    (site,) = compiled.laplace_report.sites
    assert site.gates.startswith("checked at run time: ") and why.replace("(sign >= 0)", "") in site.gates, site.gates
    assert _check_nodes(compiled) == 1
    assert site.gates in str(compiled.laplace_report)  # the report's "gates" column
    assert "by construction" not in compiled.laplace_report.passes[0].summary


def test_gate_checks_always_keeps_the_check_of_proven_gates_and_nan_raises():
    gates, _ = PROVEN["logsigmoid / 16"]
    compiled = _compile(gates, gate_checks="always")
    q, k, v, x = _inputs(100)
    x[0, 30, 1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"gk must be <= 0 everywhere .* found NaN"):
        with torch.no_grad():
            compiled(q, k, v, x)
    assert compiled.laplace_report.sites[0].gates == "checked at run time: gate_checks='always'"
    assert _check_nodes(compiled) == 1
    with pytest.raises(ValueError, match=r"gate_checks must be one of \('auto', 'always'\), got 'never'"):
        laplace_passes.compile(_layer(gates), target="cpu", gate_checks="never")


def _token_recurrence(q, k, v, gk, scale):
    """o_t = scale q_t S_t, S_t = diag(exp(gk_t)) S_{t-1} + k_t^T v_t: no check, NaN flows as it will."""
    state = torch.zeros(B, H, K, V, dtype=torch.float64)
    outputs = []
    for t in range(q.shape[1]):
        state = state * gk[:, t].double().exp()[..., None] + k[:, t, :, :, None].double() * v[:, t, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].double() * scale, state))
    return torch.stack(outputs, 1)


@pytest.mark.parametrize("T", [8, 100])
def test_a_nan_gate_past_a_proof_gives_nan_where_the_recurrence_has_it(T):
    """What leaving the check out gives up: a NaN upstream is not refused, and stays causal."""
    gates, _ = PROVEN["logsigmoid / 16"]
    compiled = _compile(gates)
    q, k, v, x = _inputs(T)
    x[0, T // 2, 1, 2] = float("nan")
    with torch.no_grad():
        actual = compiled(q, k, v, x)
    expected = _token_recurrence(q, k, v, gates(x), 0.5)
    assert torch.equal(actual.isnan(), expected.isnan())
    assert actual.isnan().any() and not actual[:, : T // 2].isnan().any()  # from the NaN's token on only
    finite = ~expected.isnan()
    torch.testing.assert_close(actual[finite], expected[finite].float(), rtol=1e-4, atol=1e-5)


def test_bounds_are_read_off_aten_graphs_too():
    def bound_of_output(fn):
        gm = make_fx(fn, tracing_mode="fake")(torch.randn(3, 4))
        (output,) = [n for n in gm.graph.nodes if n.op == "output"]
        return gate_bound(output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0])

    assert bound_of_output(lambda x: F.logsigmoid(x).view(12) / 16).sign == NONPOSITIVE  # log_sigmoid_forward
    assert bound_of_output(lambda x: torch.ops.aten.log_sigmoid_forward(x)[1]).sign is None  # its buffer
    assert bound_of_output(lambda x: -F.softplus(x).t()).sign == NONPOSITIVE
    assert bound_of_output(lambda x: torch.sigmoid(x) * x.exp()).sign == NONNEGATIVE
    unbounded = bound_of_output(lambda x: F.logsigmoid(x) - x)
    assert unbounded.sign is None and "comes from sub" in unbounded.how
    # float -> int8 wraps out-of-range values (-1000 may come back positive): no cast to an integer keeps the sign.
    wrapped = bound_of_output(lambda x: (F.logsigmoid(x) * 1000).to(torch.int8).float())
    assert wrapped.sign is None and "is torch.int8, not a signed floating-point dtype" in wrapped.how


def _traced(fn):
    """`fn` as symbolic_trace records it (keywords as written), with fake values on every node."""
    gm = torch.fx.symbolic_trace(fn)
    FakeTensorProp(gm).propagate(torch.randn(3, 4))
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    return output.args[0]


def test_operands_given_by_keyword_are_read_and_missing_ones_decline():
    assert gate_bound(_traced(lambda x: torch.mul(input=F.logsigmoid(x), other=0.5))).sign == NONPOSITIVE
    assert gate_bound(_traced(lambda x: torch.div(F.logsigmoid(x), other=-4.0))).sign == NONNEGATIVE
    assert gate_bound(_traced(lambda x: torch.neg(input=torch.exp(x)))).sign == NONPOSITIVE
    assert gate_bound(_traced(lambda x: torch.clamp(input=F.logsigmoid(x), min=-3.0))).sign == NONPOSITIVE
    half = _traced(lambda x: torch.mul(F.logsigmoid(x), 0.5))
    half.args = (half.args[0],)  # the factor gone: nothing to bound it by
    assert gate_bound(half).sign is None and gate_bound(half).how == "the constant None"
    scaled = _traced(lambda x: F.logsigmoid(x) / 16.0)
    scaled.args = (scaled.args[0],)
    assert gate_bound(scaled).sign is None and "division by None" in gate_bound(scaled).how


def test_a_scale_past_the_float_range_declines_instead_of_raising():
    scaled = _traced(lambda x: F.logsigmoid(x) / 16.0)
    scaled.args = (scaled.args[0], 10**400)  # math.isfinite raises OverflowError on this int
    assert gate_bound(scaled).sign is None and "not a finite non-zero number" in gate_bound(scaled).how
    product = _traced(lambda x: F.logsigmoid(x) * 2)
    product.args = (product.args[0], -(10**400))
    assert gate_bound(product).sign is None and gate_bound(product).how.startswith("the constant -1000")


def test_operator_functions_named_like_in_place_ops_write_nothing():
    """operator.not_ / and_ / or_ end in "_" for being keywords; only augmented assignments and setitem write."""
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    for target in (operator.not_, operator.and_, operator.or_, operator.is_):
        assert written_operands(graph.call_function(target, (x, y) if target is not operator.not_ else (x,))) == []
    assert written_operands(graph.call_function(operator.iadd, (x, y))) == [x]
    assert written_operands(graph.call_function(operator.setitem, (x, 0, y))) == [x]
    assert written_operands(graph.call_method("add_", (x, y))) == [x]


def test_ops_writing_through_lists_tuples_and_a_second_argument_are_seen():
    graph = torch.fx.Graph()
    a, b, found_inf, scale = (graph.placeholder(name) for name in ("a", "b", "found_inf", "scale"))
    assert written_operands(graph.call_function(torch._foreach_add_, ([a, b], 1.0))) == [a, b]
    assert written_operands(graph.call_function(torch._foreach_mul_, ((a, b), scale))) == [a, b]
    assert written_operands(graph.call_method("_foreach_copy_", ([a], [b]))) == [a]
    unscale = graph.call_function(torch._amp_foreach_non_finite_check_and_unscale_, ([a, b], found_inf, scale))
    assert written_operands(unscale) == [a, b, found_inf]
    assert written_operands(graph.call_function(torch.ops.aten._foreach_add_.Scalar, ([a, b], 1.0))) == [a, b]
    assert written_operands(graph.call_function(torch.add, (a, 1.0), {"out": [b]})) == [b]


def test_a_model_recompiled_with_a_dynamic_length_keeps_its_proof():
    """Dynamo's second length makes T symbolic; the graph then holds `not_(s0 == 2048)`-style guards on sizes."""
    model = model_zoo.build("tiny")
    report = laplace_passes.Report()
    compiled = torch.compile(model, backend="laplace", options={"target": "cpu", "report": report})
    with torch.no_grad():
        for T in (20, 30):
            compiled(torch.randint(0, 128, (1, T)))
    dynamic_graph = report.graph("before", "dynamo_1").graph
    assert any(n.target is operator.not_ for n in dynamic_graph.nodes)  # the case this test is about
    assert len(report.sites) == 4
    assert all(site.gates == "<= 0 by construction: logsigmoid / 16.0" for site in report.sites), report.sites


def _decay_loop(q, k, v, a):
    """GLA written from the equations with its decay given directly: recognised, its gates log(a), unproven."""
    state = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outputs = []
    for t in range(q.shape[1]):
        state = state * a[:, t][..., None] + k[:, t][..., None] * v[:, t][..., None, :]
        outputs.append((q[:, t][..., None] * state).sum(-2))
    return torch.stack(outputs, 1)


@pytest.mark.parametrize("bad, message", [
    (1.5, r"met a decay of 1\.5 \(log 0\.405465\) at run time"),
    (float("nan"), r"met a negative or NaN decay \(its log, the gate, is NaN\) at run time"),
    (-0.25, r"met a negative or NaN decay \(its log, the gate, is NaN\) at run time"),
])
def test_a_recognised_loop_s_gate_check_speaks_of_the_loop_and_how_to_keep_it(bad, message):
    """The user never wrote a gk: the refusal names their loop, its decay, and the option that keeps the loop."""
    torch.manual_seed(0)
    T = 20
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v, a = torch.randn(B, T, H, V), torch.rand(B, T, H, K)
    compiled = torch.compile(_decay_loop, backend="laplace", options={"target": "cpu", "inner": "eager"})
    torch.testing.assert_close(compiled(q, k, v, a), _decay_loop(q, k, v, a), rtol=1e-4, atol=1e-5)
    a[0, 3, 1, 2] = bad
    with pytest.raises(ValueError, match=r"^a recognised GLA loop \(token loop, 20 steps, per-key gates, .*\) "
                                         + message + r".*options=\{'recognise_gla': False\} to run the loop as "
                                         r"written"):
        compiled(q, k, v, a)
    plain = torch.compile(_decay_loop, backend="laplace",
                          options={"target": "cpu", "inner": "eager", "recognise_gla": False})
    torch.testing.assert_close(plain(q, k, v, a), _decay_loop(q, k, v, a), rtol=0, atol=0, equal_nan=True)


def _scalar_gate_loop(q, k, v, x):
    """A GLA with one gate per head, from logsigmoid, written as a token loop."""
    g = F.logsigmoid(x)
    S, outs = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3]), []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1)


def test_a_recognised_loop_s_per_head_gate_is_proven_through_the_pass_s_own_layout():
    """The re-tiling pass lays a per-head gate out per key with `torch.Tensor.expand` (a method called as a
    function); the proof reads it as the view it is, so the site runs unchecked, as the same gate given to the op
    does."""
    torch.manual_seed(0)
    q, k, v, x = torch.randn(B, 32, H, K), torch.randn(B, 32, H, K), torch.randn(B, 32, H, V), torch.randn(B, 32, H)
    compiled = laplace_passes.compile(_scalar_gate_loop, target="trn2")
    torch.testing.assert_close(compiled(q, k, v, x), _scalar_gate_loop(q, k, v, x), rtol=1e-4, atol=1e-5)
    (site,) = compiled.laplace_report.sites
    assert site.status == "retiled" and site.gates == "<= 0 by construction: logsigmoid", site.gates


def _propagate_fake_values(graph: torch.fx.Graph, example: torch.Tensor, output=None) -> None:
    """A hand-built graph of one input given its fake values, as Dynamo's graphs have them; its output is
    `output`, or its last node."""
    graph.output(output if output is not None else list(graph.nodes)[-1])
    FakeTensorProp(torch.fx.GraphModule(torch.nn.Module(), graph)).propagate(example)


@pytest.mark.parametrize("method, args, sign", [
    (torch.Tensor.expand, ((2, 4),), NONPOSITIVE), (torch.Tensor.to, (torch.float64,), NONPOSITIVE),
    (torch.Tensor.narrow, (1, 0, 2), NONPOSITIVE), (torch.Tensor.select, (1, 0), NONPOSITIVE),
    (torch.Tensor.view, (torch.int32,), None), (torch.Tensor.cumsum, (1,), None),
])
def test_a_tensor_method_called_as_a_function_is_read_as_the_method(method, args, sign):
    """``torch.Tensor.expand(g, ...)`` is ``g.expand(...)``: a view keeps the sign, a reinterpreting view or a sum
    does not, and the reason names the op once."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    gates = graph.call_function(F.logsigmoid, (x,))
    out = graph.call_function(method, (gates, *args))
    _propagate_fake_values(graph, torch.randn(1, 4))
    bound = gate_bound(out)
    assert bound.sign == sign, bound
    if method is torch.Tensor.cumsum:
        assert bound.how == "cumsum, whose sign the pass does not bound", bound.how


@pytest.mark.parametrize("target, args, sign", [
    (torch.full, ((2, 4), 0.0), NONPOSITIVE), (torch.full, ((2, 4), -0.5), NONPOSITIVE),
    (torch.full, ((2, 4), 0.5), NONNEGATIVE), (torch.full, ((2, 4), float("nan")), None),
    (torch.zeros, ((2, 4),), NONPOSITIVE), ("new_full", ((2, 4), -2.0), NONPOSITIVE),
    ("new_full", ((2, 4), 3.0), NONNEGATIVE), ("new_zeros", ((2, 4),), NONPOSITIVE),
])
def test_a_tensor_filled_with_one_number_has_its_sign(target, args, sign):
    """The zero gates the re-tiling pass gives a site without gates (torch.full(shape, 0.0)) need no check."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    if isinstance(target, str):  # x.new_full(size, value): the value is argument 2
        out = graph.call_method(target, (x, *args))
    else:
        out = graph.call_function(target, args)
    _propagate_fake_values(graph, torch.randn(2, 4))
    assert gate_bound(out).sign == sign, gate_bound(out)


def _linear_attention(q, k, v):
    """Linear attention without a gate, as fla's naive_chunk_linear_attn masks its scores: [B, H, T, K]."""
    T = q.shape[2]
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    return (q @ k.transpose(-1, -2)).masked_fill(mask, 0) @ v


def test_a_site_without_gates_runs_unchecked():
    """Its gates are zeros the pass builds itself: proven <= 0, so no run-time check (it had one per call)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(B, H, 24, K), torch.randn(B, H, 24, K), torch.randn(B, H, 24, V)
    compiled = laplace_passes.compile(_linear_attention, target="trn2")
    torch.testing.assert_close(compiled(q, k, v), _linear_attention(q, k, v), rtol=1e-4, atol=1e-4)
    (site,) = compiled.laplace_report.sites
    assert site.status == "retiled" and site.gates == "<= 0 by construction: filled with 0.0", site.gates


@pytest.mark.parametrize("write, args", [
    (torch.Tensor.__iadd__, (5.0,)), (torch.Tensor.__setitem__, (0, 5.0)), (torch.Tensor.__imul__, (-1.0,)),
])
@pytest.mark.parametrize("source", ["logsigmoid", "zeros_like"])
def test_an_in_place_dunder_called_as_a_function_is_a_write(write, args, source):
    """``torch.Tensor.__iadd__(g, 5.0)``, as a pass may insert it, writes g as ``g += 5.0`` does: no proof."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    gates = graph.call_function(F.logsigmoid if source == "logsigmoid" else torch.zeros_like, (x,))
    graph.call_function(write, (gates, *args))
    _propagate_fake_values(graph, torch.randn(2, 4), output=gates)
    bound = gate_bound(gates)
    assert bound.sign is None and f"{write.__name__} writes in place to" in bound.how, bound


@pytest.mark.parametrize("op, name", [(torch.expm1, "expm1"), (torch.log2, "log2"), (torch.cumsum, "cumsum")])
def test_a_reason_names_an_op_once(op, name):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    out = graph.call_function(op, (x, 1) if op is torch.cumsum else (x,))
    _propagate_fake_values(graph, torch.randn(2, 4))
    assert out.name == name and gate_bound(out).how == f"{name}, whose sign the pass does not bound"


@pytest.mark.parametrize("decay, proven", [
    (torch.sigmoid, True),
    (lambda x: torch.exp(-F.softplus(x)), True),
    (lambda x: 0.9 * torch.sigmoid(x), True),
    (lambda x: 1 - torch.sigmoid(x), True),
    (lambda x: torch.sigmoid(x) / 2, True),
    (lambda x: torch.clamp(x, 0, 1), True),
    (lambda x: torch.sigmoid(x) * torch.sigmoid(-x), True),
    (lambda x: 1.5 * torch.sigmoid(x), False),  # up to 1.5: its log is positive past x = ln 2
    (lambda x: torch.sigmoid(x) / 0.5, False),
    (lambda x: 2 - torch.sigmoid(x), False),
    (lambda x: 1 - x.exp(), False),  # exp(x) may pass 1, so 1 - exp(x) may be negative
    (lambda x: x.abs(), False),
    (lambda x: torch.exp(x), False),
    (lambda x: torch.clamp(x, 0, 2), False),
])
def test_the_log_of_a_decay_within_0_and_1_is_nonpositive(decay, proven):
    """A recognised loop's gates are log(decay): <= 0 where the decay lies in [0, 1], in torch-level graphs (what
    the re-tiling pass reads) and ATen ones."""
    bound = gate_bound(_traced(lambda x: torch.log(decay(x))))
    assert (bound.sign == NONPOSITIVE) == proven, bound
    assert bound.how.startswith("log(") if proven else "log of a value not shown to lie in [0, 1]" in bound.how
    gm = make_fx(lambda x: torch.log(decay(x)), tracing_mode="fake")(torch.randn(3, 4))
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    assert (gate_bound(result).sign == NONPOSITIVE) == proven


def test_a_reset_of_a_recognised_loop_s_decay_keeps_the_proof():
    """What the recognition pass builds: log of the decay with its zeros replaced by 1, -inf put back there."""
    def gates(x):
        decay = torch.sigmoid(x)
        reset = decay == 0
        return torch.where(reset, -math.inf, torch.log(torch.where(reset, 1.0, decay)))

    bound = gate_bound(_traced(gates))
    assert bound.sign == NONPOSITIVE and bound.how == "where(c, -inf, log(where(c, 1.0, sigmoid)))", bound


def _sigmoid_decay_loop(q, k, v, x):
    return _decay_loop(q, k, v, torch.sigmoid(x))


def _coefficient_on_the_state_loop(q, k, v, x):
    """The decay 0.5 * sigmoid(x) with its 0.5 written on the state: the gates log(sigmoid) + log(0.5)."""
    d, state, outputs = torch.sigmoid(x), torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3]), []
    for t in range(q.shape[1]):
        state = 0.5 * (d[:, t][..., None] * state) + k[:, t][..., None] * v[:, t][..., None, :]
        outputs.append((q[:, t][..., None] * state).sum(-2))
    return torch.stack(outputs, 1)


@pytest.mark.parametrize("loop, gates", [
    (_sigmoid_decay_loop, "where(c, -inf, log(where(c, 1.0, sigmoid)))"),
    # A sum of two nonpositive logs is nonpositive (and the loop is re-tiled where lowered).
    (_coefficient_on_the_state_loop, "(where(c, -inf, log(where(c, 1.0, sigmoid)))) + (-0.693"),
])
def test_a_recognised_loop_with_a_decay_in_0_1_runs_unchecked_with_the_eager_results(loop, gates):
    torch.manual_seed(0)
    q, k, x = torch.randn(B, 20, H, K), torch.randn(B, 20, H, K), torch.randn(B, 20, H, K)
    v = torch.randn(B, 20, H, V)
    compiled = laplace_passes.compile(loop, target="cpu", inner="eager")
    torch.testing.assert_close(compiled(q, k, v, x), loop(q, k, v, x), rtol=1e-4, atol=1e-5)
    (site,) = compiled.laplace_report.sites
    assert site.gates.startswith(f"<= 0 by construction: {gates}"), site.gates
    assert _check_nodes(compiled) == 0
