"""Gates <= 0 by construction go to the GLA op unchecked; any other gate keeps its run-time check.

NOTE [gates proven <= 0] in `laplace_passes.fx.gate_bounds`. Each case below
compiles a GLA call whose gates are built from an input x, and checks what
the re-tiling pass decided (the report's "gates" column and the graph), and
what that decision means at run time: a proven gate gives the eager op's
results without a check, an unproven one still refuses a positive gate.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import laplace_passes
from laplace_passes.compile_fx import fresh_code
from laplace_passes.fx.gate_bounds import NONNEGATIVE, NONPOSITIVE, gate_bound
from tests.gla_cases import relative_rmse

B, H, K, V = 1, 2, 4, 8

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
    "views and casts": (lambda x: F.logsigmoid(x.double()).transpose(1, 2).contiguous().transpose(1, 2).float(),
                        "logsigmoid"),
}

# name -> (gates from x, x making some gate positive, why the pass keeps the check)
CHECKED = {
    "an input": (lambda x: x, "is an input of the graph"),
    "logsigmoid / -16": (lambda x: F.logsigmoid(x) / -16, "checked at run time: (sign >= 0)"),
    "logsigmoid + 0.01": (lambda x: F.logsigmoid(x) + 0.01, "comes from add"),
    "softplus": (lambda x: F.softplus(x), "(sign >= 0)"),
    "-softplus(beta=-1)": (lambda x: -F.softplus(x, beta=-1.0), "softplus with beta -1.0"),
    "clamp(max=0.5)": (lambda x: x.clamp(max=0.5), "clamp(min=None, max=0.5)"),
    "clamp_min(logsigmoid, 0.1)": (lambda x: torch.clamp_min(F.logsigmoid(x), 0.1), "clamp(min=0.1, max=None)"),
    "logsigmoid / a tensor": (lambda x: F.logsigmoid(x) / (x - 10), "not a finite non-zero number"),
    # Casts that do not keep the sign: a negative gate becomes True (1.0), or wraps around in uint8.
    "logsigmoid cast to bool": (lambda x: F.logsigmoid(x).to(torch.bool).float() * 0.5,
                                "is torch.bool, not floating point"),
    "-softplus cast to uint8": (lambda x: (-F.softplus(x)).to(torch.uint8).float() * 0.01, "is torch.uint8"),
    # The low half of a negative float32, read as float16, can be positive.
    "-softplus viewed as float16": (lambda x: (-F.softplus(x)).view(torch.float16)[..., ::2].float(),
                                    "reads torch.float32 as torch.float16"),
    # softplus returns x itself above its threshold: with a negative one, x in (threshold, 0) comes back negative.
    "-softplus(threshold=-5)": (lambda x: -F.softplus(x, threshold=-5.0), "threshold -5.0"),
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
    assert wrapped.sign is None and "is torch.int8, not floating point" in wrapped.how
