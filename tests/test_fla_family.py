"""fla's GLA-family kernels replaced (laplace_passes/fla/shared_ops.py, family_calls.py), each on its own.

Every fla function is called inside `torch.compile(backend="laplace", fullgraph=True)`: a call that still
reached fla's Triton code would be a graph break and fail. The references are fla's own (`naive_recurrent_*`,
`token_shift_ref`, `rotary_embedding_ref`, `rms_norm_ref`) where fla has one, otherwise the recurrence
written here token by token from the paper's equations. fp32 to 1e-5 relative; gradients too.
"""


import pytest
import torch
import torch.nn.functional as F

import laplace_passes
from tests.gla_cases import relative_rmse

fla = pytest.importorskip("fla")
from fla.modules.norm.layernorm import rms_norm_linear, rms_norm_ref  # noqa: E402
from fla.modules.rotary.ops import rotary_embedding, rotary_embedding_ref  # noqa: E402
from fla.modules.token_shift import token_shift, token_shift_ref  # noqa: E402
from fla.ops.gsa import chunk_gsa, fused_recurrent_gsa  # noqa: E402
from fla.ops.gsa.gate import fused_additive_gate  # noqa: E402
from fla.ops.gsa.naive import naive_recurrent_gsa  # noqa: E402
from fla.ops.lightnet import chunk_lightnet, fused_recurrent_lightnet  # noqa: E402
from fla.ops.retention import chunk_retention, fused_recurrent_retention  # noqa: E402
from fla.ops.rwkv6 import chunk_rwkv6, fused_recurrent_rwkv6  # noqa: E402
from fla.ops.rwkv6.recurrent_naive import naive_recurrent_rwkv6  # noqa: E402
from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla  # noqa: E402
from fla.ops.simple_gla.naive import naive_recurrent_simple_gla  # noqa: E402
from fla.ops.utils.cumsum import chunk_local_cumsum  # noqa: E402

from tests.fla_family_oracle import additive_gate  # noqa: E402  (the recurrence written from the formula)

TOLERANCE = 1e-5
B, T, H, K, V = 2, 40, 2, 8, 6


@pytest.fixture(autouse=True)
def installed():
    laplace_passes.fla.install(import_fla=True)
    torch._dynamo.reset()


def compiled(fn):
    return torch.compile(fn, backend="laplace", fullgraph=True, options={"target": "cpu", "chunk_size": 16})


def randn(*shape, seed=0, grad=True):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return x.requires_grad_() if grad else x


def assert_same(found, expected, inputs, tolerance=TOLERANCE):
    """Outputs and the gradients of every input, by fla's relative RMSE."""
    found, expected = [f for f in found if f is not None], [e for e in expected if e is not None]
    for f, e in zip(found, expected):
        assert relative_rmse(f, e) < tolerance, relative_rmse(f, e)
    weights = [torch.linspace(-1, 1, e.numel()).view_as(e) for e in expected]
    grads = [torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), inputs, allow_unused=True)
             for outs in (found, expected)]
    for f, e in zip(*grads):
        if e is not None:
            assert relative_rmse(f, e) < 10 * tolerance, relative_rmse(f, e)


# -- shared kernels ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("offsets", [0, 3, "per sequence"])
def test_rotary_embedding_against_fla_s_reference(offsets):
    x = randn(B, T, H, 16)
    angles = torch.arange(64)[:, None] * (10000 ** (-torch.arange(4) / 4))[None]  # R = 4 of D = 16 rotated
    cos, sin = angles.cos(), angles.sin()
    starts = torch.tensor([2, 5]) if offsets == "per sequence" else torch.tensor([offsets] * B)
    found = compiled(lambda x: rotary_embedding(x, cos, sin, seqlen_offsets=starts if offsets == "per sequence"
                                                else offsets))(x)
    expected = torch.stack([rotary_embedding_ref(x[b:b + 1], cos[int(s):int(s) + T], sin[int(s):int(s) + T])[0]
                            for b, s in enumerate(starts)])
    assert_same([found], [expected], [x])


def test_token_shift_against_fla_s_reference_dense_packed_and_cached():
    x = randn(B, T, 12)
    assert_same([compiled(lambda x: token_shift(x))(x)], [token_shift_ref(x)], [x])
    packed = randn(1, T, 12, seed=1)
    cu_seqlens = torch.tensor([0, 7, 7, 25, T])  # an empty sequence too
    assert_same([compiled(lambda x: token_shift(x, cu_seqlens))(packed)], [token_shift_ref(packed, cu_seqlens)],
                [packed])
    cache = randn(B, 12, seed=2)
    delta, last = compiled(lambda x, c: token_shift(x, cache=c, output_cache=True))(x, cache)
    expected = torch.cat([cache[:, None], x[:, :-1]], 1) - x
    assert_same([delta, last], [expected, x[:, -1]], [x, cache])


@pytest.mark.parametrize("reverse", [False, True])
def test_chunk_local_cumsum_sums_inside_chunks_of_each_sequence(reverse):
    g = randn(1, T, H, grad=False)
    cu_seqlens = torch.tensor([0, 5, 23, T])
    found = compiled(lambda g: chunk_local_cumsum(g, 8, reverse=reverse, scale=0.5, cu_seqlens=cu_seqlens))(g)
    expected = torch.empty_like(g)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        for chunk in range(start, end, 8):
            piece = g[:, chunk:min(chunk + 8, end)]
            summed = piece.flip(1).cumsum(1).flip(1) if reverse else piece.cumsum(1)
            expected[:, chunk:min(chunk + 8, end)] = summed * 0.5
    torch.testing.assert_close(found, expected)


def test_fused_additive_gate_against_the_recurrence_dense_and_packed():
    x, z0 = randn(B, T, H, K), randn(B, 1, H, K, seed=1)
    assert_same(compiled(lambda x, z0: fused_additive_gate(x, z0))(x, z0), additive_gate(x, z0), [x, z0])
    packed, cu_seqlens = randn(1, T, H, K, seed=2), torch.tensor([0, 13, 13, T])
    found = compiled(lambda x: fused_additive_gate(x, cu_seqlens=cu_seqlens))(packed)
    pieces = [additive_gate(packed[:, a:b]) for a, b in ((0, 13), (13, T))]
    expected = [torch.cat([p[i] for p in pieces], 1) for i in range(2)]
    assert_same(found[:2], expected, [packed])
    assert torch.isneginf(found[2][1]).all()  # the empty sequence: nothing summed


def test_rms_norm_linear_against_fla_s_reference_with_its_default_eps():
    x, w, lw = randn(B, T, 16), randn(16, seed=1), randn(10, 16, seed=2)
    found = compiled(lambda x: rms_norm_linear(x, w, None, lw, None))(x)
    assert_same([found], [F.linear(rms_norm_ref(x, w, None, eps=1e-5), lw)], [x, w, lw])


# -- the family's recurrences ---------------------------------------------------------------------------


def qkv(seed=0, heads=H, keys=K, values=V):
    return randn(B, T, heads, keys, seed=seed), randn(B, T, heads, keys, seed=seed + 1), \
        randn(B, T, heads, values, seed=seed + 2)


@pytest.mark.parametrize("op", [chunk_simple_gla, fused_recurrent_simple_gla], ids=lambda f: f.__name__)
def test_simple_gla_against_fla_s_naive_recurrence(op):
    q, k, v = qkv()
    g = F.logsigmoid(randn(B, T, H, seed=3, grad=False)).requires_grad_()
    h0 = randn(B, H, K, V, seed=4)
    found = compiled(lambda *a: op(*a[:4], initial_state=a[4], output_final_state=True))(q, k, v, g, h0)
    expected = naive_recurrent_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    assert_same(found, expected, [q, k, v, g, h0])


@pytest.mark.parametrize("op", [chunk_retention, fused_recurrent_retention], ids=lambda f: f.__name__)
def test_retention_against_fla_s_naive_recurrence_with_its_fixed_decays(op):
    q, k, v = qkv()
    found = compiled(lambda q, k, v: op(q, k, v, output_final_state=True))(q, k, v)
    decays = (1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float))).log()
    expected = naive_recurrent_simple_gla(q, k, v, decays.expand(B, T, H), output_final_state=True)
    assert_same(found, expected, [q, k, v])


def lightnet_reference(q, k, v, h0, z0):
    """LightNet from its equations: keys and gates from the additive gate, then GLA, token by token."""
    keys, gates, z = additive_gate(k, z0)
    S, outs = h0, []
    for t in range(T):
        S = S * gates[:, t].exp()[..., None] + keys[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * K ** -0.5 * S).sum(-2))
    return torch.stack(outs, 1), S, z


@pytest.mark.parametrize("op", [chunk_lightnet, fused_recurrent_lightnet], ids=lambda f: f.__name__)
def test_lightnet_against_its_equations(op):
    q, k, v = qkv()
    h0, z0 = randn(B, H, K, V, seed=4), randn(B, 1, H, K, seed=5)
    o, (state, z) = compiled(lambda *a: op(*a[:3], initial_state=(a[3], a[4]), output_final_state=True))(
        q, k, v, h0, z0)
    assert_same([o, state, z], lightnet_reference(q, k, v, h0, z0), [q, k, v, h0, z0])


@pytest.mark.parametrize("op", [chunk_rwkv6, fused_recurrent_rwkv6], ids=lambda f: f.__name__)
def test_rwkv6_exclusive_readout_and_bonus_against_fla_s_naive_recurrence(op):
    r, k, v = qkv()
    w = -torch.exp(randn(B, T, H, K, seed=3, grad=False)).requires_grad_()  # fla's layer: w = -exp(...)
    u, h0 = randn(H, K, seed=4), randn(B, H, K, V, seed=5)
    found = compiled(lambda *a: op(*a[:5], scale=1.0, initial_state=a[5], output_final_state=True))(
        r, k, v, w, u, h0)
    o, ht = naive_recurrent_rwkv6(*(x.transpose(1, 2) for x in (r, k, v, w)), u, scale=1.0, initial_state=h0,
                                  output_final_state=True)
    assert_same(found, [o.transpose(1, 2), ht], [r, k, v, w, u, h0])


def test_rwkv6_bonus_is_what_separates_it_from_gla():
    """With u = 0 and the readout shifted, RWKV6 is GLA one step late: the bonus term is the whole difference."""
    r, k, v = qkv()
    w = -torch.exp(randn(B, T, H, K, seed=3, grad=False))
    zero, bonus = torch.zeros(H, K), randn(H, K, seed=4, grad=False)
    plain = compiled(lambda *a: chunk_rwkv6(*a, scale=1.0)[0])(r, k, v, w, zero)
    with_bonus = compiled(lambda *a: chunk_rwkv6(*a, scale=1.0)[0])(r, k, v, w, bonus)
    expected_bonus = (r * bonus * k).sum(-1, keepdim=True) * v
    torch.testing.assert_close(with_bonus - plain, expected_bonus, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", [chunk_gsa, fused_recurrent_gsa], ids=lambda f: f.__name__)
def test_gsa_two_passes_against_fla_s_naive_recurrence(op):
    M = 4
    q, k, v = qkv()
    s = randn(B, T, H, M, seed=3)
    g = F.logsigmoid(randn(B, T, H, M, seed=4, grad=False)).requires_grad_()
    hk0, hv0 = randn(B, H, K, M, seed=5), randn(B, H, M, V, seed=6)
    o, (hk, hv) = compiled(lambda *a: op(*a[:5], initial_state=(a[5], a[6]), output_final_state=True))(
        q, k, v, s, g, hk0, hv0)
    expected_o, (expected_hk, expected_hv) = naive_recurrent_gsa(q, k, v, s, g, initial_state=(hk0, hv0),
                                                                  output_final_state=True)
    assert_same([o, hk, hv], [expected_o, expected_hk, expected_hv], [q, k, v, s, g, hk0, hv0])


def test_each_family_call_is_one_retiled_site_in_the_report():
    q, k, v = qkv()
    report = laplace_passes.inspect(lambda q, k, v: chunk_retention(q, k, v)[0], q, k, v, target="trn2")
    (site,) = report.sites
    assert site.origin == "fla.chunk_retention" and site.status == "retiled"


# -- bf16, to the ratios fla's own tests use for it ----------------------------------------------------------

BF16_OUTPUT, BF16_GRADIENT = 0.005, 0.008  # fla's tests: 0.005 for outputs and states, 0.008 for gradients


def bf16(*tensors):
    return [t.detach().to(torch.bfloat16).requires_grad_() for t in tensors]


def family_in_bf16(name):
    """(the laplace output, fla's naive reference on the same bf16 inputs, the inputs) for one family call."""
    q, k, v = bf16(*qkv())
    if name == "simple_gla":
        (g,) = bf16(F.logsigmoid(randn(B, T, H, seed=3, grad=False)))
        found = compiled(lambda *a: chunk_simple_gla(*a)[0])(q, k, v, g)
        return found, naive_recurrent_simple_gla(q, k, v, g)[0], [q, k, v, g]
    if name == "retention":
        decays = (1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float))).log().expand(B, T, H)
        return compiled(lambda *a: chunk_retention(*a)[0])(q, k, v), \
            naive_recurrent_simple_gla(q, k, v, decays)[0], [q, k, v]
    if name == "rwkv6":
        (w, u) = bf16(-torch.exp(randn(B, T, H, K, seed=3, grad=False)), randn(H, K, seed=4, grad=False))
        found = compiled(lambda *a: chunk_rwkv6(*a, scale=1.0)[0])(q, k, v, w, u)
        expected = naive_recurrent_rwkv6(*(x.transpose(1, 2) for x in (q, k, v, w)), u, scale=1.0)[0]
        return found, expected.transpose(1, 2), [q, k, v, w, u]
    if name == "gsa":
        s, g = bf16(randn(B, T, H, 4, seed=3, grad=False), F.logsigmoid(randn(B, T, H, 4, seed=4, grad=False)))
        found = compiled(lambda *a: chunk_gsa(*a)[0])(q, k, v, s, g)
        return found, naive_recurrent_gsa(q, k, v, s, g)[0], [q, k, v, s, g]
    found = compiled(lambda *a: chunk_lightnet(*a)[0])(q, k, v)  # lightnet: fla has no naive function
    return found, lightnet_reference(q.float(), k.float(), v.float(), torch.zeros(B, H, K, V), None)[0], [q, k, v]


@pytest.mark.parametrize("name", ["simple_gla", "retention", "rwkv6", "gsa", "lightnet"])
def test_each_recurrence_in_bf16_to_fla_s_tolerance(name):
    found, expected, inputs = family_in_bf16(name)
    assert found.dtype == torch.bfloat16
    assert relative_rmse(found, expected) < BF16_OUTPUT, relative_rmse(found, expected)
    weight = torch.linspace(-1, 1, found.numel()).view_as(found)
    found_grads = torch.autograd.grad((found.float() * weight).sum(), inputs)
    expected_grads = torch.autograd.grad((expected.float() * weight).sum(), inputs)
    for found_grad, expected_grad in zip(found_grads, expected_grads):
        assert relative_rmse(found_grad, expected_grad) < BF16_GRADIENT, relative_rmse(found_grad, expected_grad)
