"""Each fla kernel the GLA model reaches, replaced, on its own: forward and backward against formulas.

Every call is compiled with `fullgraph=True`: a call that still reached fla's
Triton code would be a graph break, and fail the test. The references are
written here from the maths, in fp32; bf16 inputs are compared with a bf16
tolerance.
"""

import pytest
import torch
import torch.nn.functional as F

import laplace_passes
from tests.gla_cases import relative_rmse

fla_modules = pytest.importorskip("fla.modules")
activations = pytest.importorskip("fla.modules.activations")
from fla.modules.causal_conv1d import causal_conv1d  # noqa: E402
from fla.modules.fused_cross_entropy import cross_entropy_loss  # noqa: E402
from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = list(TOLERANCE)


@pytest.fixture(autouse=True, scope="module")
def replacements():
    assert laplace_passes.fla.install(import_fla=True)
    assert laplace_passes.fla.not_installed() == {}


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def outputs_and_grads(fn, inputs, seed=0):
    """fn's outputs and the gradients of a random projection of them w.r.t. every input."""
    inputs = leaves(*inputs)
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    gen = torch.Generator().manual_seed(seed)
    total = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outputs)
    grads = torch.autograd.grad(total, inputs, allow_unused=True)
    return [o.detach() for o in outputs], grads


def assert_same(fn, reference, inputs, dtype):
    actual, actual_grads = outputs_and_grads(compiled(fn), inputs)
    expected, expected_grads = outputs_and_grads(reference, inputs)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert relative_rmse(a, e) <= TOLERANCE[dtype]
    for i, (a, e) in enumerate(zip(actual_grads, expected_grads)):
        assert (a is None) == (e is None), i
        if a is not None:
            assert relative_rmse(a, e) <= TOLERANCE[dtype], f"gradient {i}"


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- norms -------------------------------------------------------------------------------------------

def rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def centred(x, eps):
    x = x - x.mean(-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# fla's default eps, and one that dominates the mean square of inputs ~1e-4 (an eps dropped or replaced shows).
EPS_CASES = {"eps=1e-6": (1e-6, 1.0), "eps=1e-2, inputs ~1e-4": (1e-2, 1e-4)}


@pytest.mark.parametrize("eps_case", EPS_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_with_residual_prenorm_groups_and_gates(dtype, eps_case):
    D, (eps, magnitude) = 32, EPS_CASES[eps_case]
    rms_norm, layer_norm = fla_modules.RMSNorm(D, eps=eps), fla_modules.LayerNorm(D, bias=True, eps=eps)
    group_norm = fla_modules.GroupNorm(4, D, bias=True, eps=eps)
    gated = fla_modules.FusedRMSNormGated(D, eps=eps)
    sigmoid_gated = fla_modules.FusedRMSNormGated(D, eps=eps, activation="sigmoid")
    with torch.no_grad():
        for module in (rms_norm, layer_norm, group_norm, gated, sigmoid_gated):
            module.weight.copy_(1 + 0.1 * randn(D, seed=1))
        for module in (layer_norm, group_norm):
            module.bias.copy_(0.1 * randn(D, seed=2))
    x, residual = ((magnitude * randn(3, 5, D, seed=s)).to(dtype) for s in (3, 4))
    g = randn(3, 5, D, dtype=dtype, seed=5)

    def fla_calls(x, residual, g):
        y1, new_residual = rms_norm(x, residual, prenorm=True, residual_in_fp32=True)
        return (y1, new_residual, layer_norm(x), group_norm(x, residual),
                gated(x, g), sigmoid_gated(x, g, residual, prenorm=True)[0])

    def formulas(x, residual, g):
        w = [m.weight.float() for m in (rms_norm, layer_norm, group_norm, gated, sigmoid_gated)]
        xf, rf, gf = x.float(), residual.float(), g.float()
        s = xf + rf
        grouped = centred(s.unflatten(-1, (4, D // 4)), eps).flatten(-2) * w[2] + group_norm.bias.float()
        # With a residual given, the new residual keeps its dtype (residual_in_fp32 applies without one).
        return ((rms(s, eps) * w[0]).to(dtype), s.to(dtype), (centred(xf, eps) * w[1] + layer_norm.bias.float()).to(dtype),
                grouped.to(dtype), (rms(xf, eps) * w[3] * gf * torch.sigmoid(gf)).to(dtype),
                (rms(s, eps) * w[4] * torch.sigmoid(gf)).to(dtype))

    assert_same(fla_calls, formulas, (x, residual, g), dtype)


@pytest.mark.parametrize("eps_case", EPS_CASES)
def test_norms_then_linear_with_their_eps(eps_case):
    """The norm-then-linear forms (HGRN2's, LightNet's and GSA's output projections) normalise with their eps."""
    D, E, (eps, magnitude) = 32, 12, EPS_CASES[eps_case]
    rms_linear, layer_linear = fla_modules.RMSNormLinear(D, eps=eps), fla_modules.LayerNormLinear(D, eps=eps)
    gated_linear = fla_modules.FusedRMSNormSwishGateLinear(D, eps=eps)
    with torch.no_grad():
        for i, module in enumerate((rms_linear, layer_linear, gated_linear)):
            module.weight.copy_(1 + 0.1 * randn(D, seed=10 + i))
    x = magnitude * randn(3, 5, D, seed=3)
    g, linear_weight, linear_bias = randn(3, 5, D, seed=5), randn(E, D, seed=6), randn(E, seed=7)

    def fla_calls(x, g, linear_weight, linear_bias):
        return (rms_linear(x, linear_weight, linear_bias), layer_linear(x, linear_weight, linear_bias),
                gated_linear(x, g, linear_weight, linear_bias))

    def formulas(x, g, linear_weight, linear_bias):
        return (F.linear(rms(x, eps) * rms_linear.weight, linear_weight, linear_bias),
                F.linear(centred(x, eps) * layer_linear.weight, linear_weight, linear_bias),
                F.linear(rms(x, eps) * gated_linear.weight * g * torch.sigmoid(g), linear_weight, linear_bias))

    assert_same(fla_calls, formulas, (x, g, linear_weight, linear_bias), torch.float32)


# --- activations -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_activations(dtype):
    x, y = randn(4, 6, 16, dtype=dtype, seed=6), randn(4, 6, 16, dtype=dtype, seed=7)
    weight, bias = randn(8, 16, seed=8).to(dtype) * 0.2, randn(8, seed=9).to(dtype)
    act = activations.ACT2FN

    def fla_calls(x, y, weight, bias):
        return (act["swish"](x), act["sigmoid"](x), activations.logsigmoid(x, 4.0), activations.swiglu(x, y),
                activations.swiglu_linear(x, y, weight, bias), activations.powglu(x, y, 3.0))

    def formulas(x, y, weight, bias):
        xf, yf = x.float(), y.float()
        s = torch.sigmoid(xf)
        swiglu = (xf * s * yf).to(dtype)
        power = torch.where(xf > 0, xf.clamp(min=1e-30) ** (3.0 / (xf.clamp(min=0).sqrt() + 1)), xf)
        return ((xf * s).to(dtype), s.to(dtype), (torch.log(s) / 4.0).to(dtype), swiglu,
                F.linear(swiglu, weight, bias), (power * s * yf).to(dtype))

    assert_same(fla_calls, formulas, (x, y, weight, bias), dtype)


# --- short convolution -------------------------------------------------------------------------------

def conv_formula(x, weight, bias, residual, cache):
    """Causal depthwise convolution reading the cache (last W inputs, newest last) before the first token."""
    B, T, D = x.shape
    W = weight.shape[1]
    history = torch.cat([cache[..., 1:].transpose(1, 2).float(), x.float()], dim=1)  # [B, W-1+T, D]
    y = sum(history[:, w:w + T] * weight[:, w].float() for w in range(W)) + bias.float()
    y = y * torch.sigmoid(y) + residual.float()
    final = torch.cat([cache.float(), x.float().transpose(1, 2)], dim=-1)[..., -W:]
    return y.to(x.dtype), final.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d_with_cache_bias_residual_and_final_state(dtype):
    B, T, D, W = 2, 7, 12, 4
    x, residual, cache = randn(B, T, D, dtype=dtype, seed=10), randn(B, T, D, dtype=dtype, seed=11), randn(B, D, W, seed=12)
    weight, bias = randn(D, W, seed=13), randn(D, seed=14)

    def fla_call(x, residual, cache, weight, bias):
        return causal_conv1d(x, weight, bias, residual, cache, output_final_state=True, activation="silu")

    def formula(x, residual, cache, weight, bias):
        return conv_formula(x, weight, bias, residual, cache)

    assert_same(fla_call, formula, (x, residual, cache, weight, bias), dtype)


def test_short_convolution_decode_steps_update_the_cache_in_place_and_equal_the_whole_sequence():
    B, T, D, W = 3, 6, 8, 4
    conv = fla_modules.ShortConvolution(D, W, bias=True)
    x = randn(B, T, D, seed=15)
    with torch.no_grad():
        expected, expected_cache = conv_formula(x, conv.weight[:, 0], conv.bias, torch.zeros_like(x),
                                                torch.zeros(B, D, W))
        step = compiled(lambda token, cache: conv(token, cache=cache, output_final_state=True))
        cache = torch.zeros(B, D, W)
        outputs = []
        for t in range(T):
            y, returned = step(x[:, t:t + 1], cache)
            assert returned.data_ptr() == cache.data_ptr()  # fla updates its cache in place
            outputs.append(y)
    assert relative_rmse(torch.cat(outputs, dim=1), expected) <= 1e-6
    assert relative_rmse(cache, expected_cache) <= 1e-6


# --- losses ------------------------------------------------------------------------------------------

SMOOTHING, SCALE, SOFTCAP, Z_SCALE = 0.1, 0.7, 20.0, 1e-3


def loss_rows(logits, target, z_scale=Z_SCALE):
    """Cross entropy rows with fla's options, in fp32; ignored rows are 0."""
    z = SOFTCAP * torch.tanh(logits.float() * SCALE / SOFTCAP)
    lse = torch.logsumexp(z, -1)
    valid = target != -100
    picked = z.gather(-1, target.clamp(min=0)[:, None]).squeeze(-1)
    loss = lse - (1 - SMOOTHING) * picked - SMOOTHING * z.mean(-1) + z_scale * lse ** 2
    return loss * valid, z_scale * lse ** 2 * valid


def targets(N, V, seed):
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(seed))
    target[::5] = -100
    return target


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_rows_and_reductions(dtype):
    N, V = 20, 50
    logits, target = randn(N, V, dtype=dtype, seed=16) * 3, targets(N, V, 17)
    options = dict(label_smoothing=SMOOTHING, logit_scale=SCALE, lse_square_scale=Z_SCALE,
                   logit_softcapping=SOFTCAP, ignore_index=-100)
    reductions = {r: fla_modules.FusedCrossEntropyLoss(reduction=r, **options) for r in ("mean", "sum", "none")}

    def fla_calls(logits):  # z is reported for logging: fla gives it no gradient
        loss, z = cross_entropy_loss(logits, target, **options)
        return loss, z, *(module(logits, target) for module in reductions.values())

    def formulas(logits):
        rows, z = loss_rows(logits, target)
        return rows, z.detach(), rows.sum() / (target != -100).sum(), rows.sum(), rows

    assert_same(fla_calls, formulas, (logits,), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction,l2warp", [("mean", False), ("sum", True)])
def test_fused_linear_cross_entropy(dtype, reduction, l2warp):
    N, H, V = 24, 16, 40
    x, target = randn(N, H, dtype=dtype, seed=18), targets(N, V, 19)
    weight, bias = randn(V, H, dtype=dtype, seed=20) * 0.5, randn(V, dtype=dtype, seed=21)
    options = dict(label_smoothing=SMOOTHING, logit_scale=SCALE, logit_softcapping=SOFTCAP, num_chunks=3,
                   reduction=reduction, use_l2warp=l2warp, l2_penalty_factor=0.5)

    def fla_call(x, weight, bias):
        return fused_linear_cross_entropy_loss(x, target, weight, bias, **options)

    def formula(x, weight, bias):
        logits = F.linear(x, weight, bias)
        rows, _ = loss_rows(logits, target, z_scale=0.0)
        loss = rows.sum() / (target != -100).sum() if reduction == "mean" else rows.sum()
        if l2warp:  # adds 0.5 / N * max to the gradient of each row's largest logit; the value is unchanged
            largest = logits.max(-1).values
            loss = loss + (0.5 / N) * 0.5 * (largest ** 2 - largest.detach() ** 2).sum().float()
        return loss

    assert_same(fla_call, formula, (x, weight, bias), dtype)


# --- GLA ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_gla_calls_with_state_v_first_initial_and_final_states(dtype):
    """chunk_gla and fused_recurrent_gla as fla's layer calls them, through the laplace backend."""
    from fla.ops.gla import chunk_gla, fused_recurrent_gla

    from tests.fla_reference import gla
    from tests.gla_cases import make_inputs

    q, k, v, g, h0 = make_inputs(2, 100, 2, 16, 8, gate_divisor=0.5, dtype=dtype)
    h0 = h0.transpose(-1, -2).contiguous()  # [B, H, V, K]: state_v_first

    def fla_calls(q, k, v, g, h0):
        o1, s1 = chunk_gla(q, k, v, g, scale=0.3, initial_state=h0, output_final_state=True, state_v_first=True)
        o2, s2 = fused_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True, state_v_first=True)
        return o1, s1, o2, s2

    def formulas(q, k, v, g, h0):
        o1, s1 = gla(q * (0.3 * 16 ** 0.5), k, v, g, h0.transpose(-1, -2))  # the reference scales by K ** -0.5
        o2, s2 = gla(q, k, v, g, h0.transpose(-1, -2))
        return o1, s1.transpose(-1, -2), o2, s2.transpose(-1, -2)

    actual, actual_grads = outputs_and_grads(laplace_passes.compile(fla_calls, target="cpu"), (q, k, v, g, h0))
    expected, expected_grads = outputs_and_grads(formulas, (q, k, v, g, h0))
    for a, e in zip([*actual, *actual_grads], [*expected, *expected_grads]):
        assert a.dtype == e.dtype and relative_rmse(a, e) <= TOLERANCE[dtype]
