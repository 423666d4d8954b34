"""The side-by-side check of a recognised loop (`laplace_passes.fx.validate`) in the precision the loop runs in.

A GLA loop under the caller's `torch.autocast` is still GLA (the check's GLA form runs with autocast off,
and its tolerance is that of the lowest precision the loop itself computes in), while a loop that differs
from GLA by more than float32's rounding is still declined under autocast. HGRN2's decay, selected twice
per step from a whole-sequence tensor (its key is 1 - the decay), is drawn as a decay on random inputs.
A float64 loop is kept as written, with the reason that the GLA ops compute in float32.
"""

import pytest
import torch
import torch.nn.functional as F

import laplace_passes
from laplace_passes.fx.gla_build import GlaBuilder
from model_zoo.plain_gla import scanned_gla

B, T, H, K, V = 1, 24, 2, 8, 16
BF16_TOLERANCE = 2e-2  # relative (Frobenius): the loop and its GLA site each round some products to bf16


def compiled(fn):
    torch._dynamo.reset()
    return laplace_passes.compile(fn, target="cpu", inner="eager", chunk_size=8)


def outputs_and_grads(fn, args, params=()):
    out = fn(*args)
    out = out if isinstance(out, tuple) else (out,)
    weights = [torch.linspace(-1, 1, o.numel()).view_as(o) for o in out]
    loss = sum((o.float() * w).sum() for o, w in zip(out, weights))
    grads = torch.autograd.grad(loss, [*args, *params])
    return [o.detach().float() for o in out], [g.float() for g in grads]


def assert_relative(found, expected, tolerance):
    for f, e in zip(found, expected):
        error = float((f.double() - e.double()).norm() / e.double().norm())
        assert error <= tolerance, f"relative error {error:.2g} > {tolerance}"


# -- autocast ----------------------------------------------------------------------------------------


def projections(lin, x):
    q, k, g, v = lin(x).split([H * K, H * K, H * K, H * V], -1)
    return q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V), F.logsigmoid(g.view(B, T, H, K))


def elementwise_loop(q, k, v, g):
    q, k, v, g = (z.float() for z in (q, k, v, g))
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t][..., None] * v[:, t][..., None, :]
        outs.append((q[:, t][..., None] * S).sum(-2))
    return torch.stack(outs, 1)


def einsum_loop(q, k, v, g):
    """Autocast computes these einsums in bf16 (the loop's own rounding), its sums in float32."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1)


def scanned(q, k, v, g):
    return scanned_gla(q, k, v, g)[0]


def projected(recurrence):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, H * (3 * K + V))
    return (lambda x: recurrence(*projections(lin, x))), list(lin.parameters())


@pytest.mark.parametrize("recurrence", [elementwise_loop, einsum_loop, scanned], ids=lambda f: f.__name__)
def test_a_loop_under_autocast_is_recognised_with_autocast_eager_outputs_and_gradients(recurrence):
    fn, params = projected(recurrence)
    x = torch.randn(B, T, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_out, expected_grads = outputs_and_grads(fn, [x], params)
        model = compiled(fn)
        out, grads = outputs_and_grads(model, [x], params)
    (row,) = model.laplace_report.recurrences
    assert row.status == "GLA site", row.reason
    assert_relative(out, expected_out, BF16_TOLERANCE)
    assert_relative(grads, expected_grads, BF16_TOLERANCE)


def test_a_loop_under_an_autocast_inside_the_function_is_checked_under_that_autocast():
    """Dynamo's graph enters and leaves the autocast itself: the loop's copy for the check must too, or its
    einsum of a bf16 key and a float32 state fails (mixed dtypes) and the loop is left alone."""
    fn, params = projected(einsum_loop)

    def autocast_inside(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(x)

    x = torch.randn(B, T, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    expected_out, expected_grads = outputs_and_grads(autocast_inside, [x], params)
    model = compiled(autocast_inside)
    out, grads = outputs_and_grads(model, [x], params)
    (row,) = model.laplace_report.recurrences
    assert row.status == "GLA site", row.reason
    assert_relative(out, expected_out, BF16_TOLERANCE)
    assert_relative(grads, expected_grads, BF16_TOLERANCE)


def test_a_loop_off_gla_by_more_than_float32_rounding_is_declined_under_autocast(monkeypatch):
    """The loop's products are float32 under autocast, so float32's tolerance holds: gates read 2% off (an
    error well inside bf16's tolerance) are caught, and the loop runs as written."""
    original = GlaBuilder.gates

    def off(self):
        gates, width = original(self)
        return self.call(torch.mul, gates, 1.02), width

    monkeypatch.setattr(GlaBuilder, "gates", off)
    fn, params = projected(elementwise_loop)
    x = torch.randn(B, T, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_out, _ = outputs_and_grads(fn, [x], params)
        model = compiled(fn)
        out, _ = outputs_and_grads(model, [x], params)
    (row,) = model.laplace_report.recurrences
    assert row.status == "declined" and "on random inputs its GLA form differs from the loop" in row.reason
    assert "for a loop computing in torch.float32" in row.reason, row.reason
    assert not model.laplace_report.sites
    assert_relative(out, expected_out, 1e-6)


# -- HGRN2: the key tied to a decay selected twice per step ---------------------------------------------


def hgrn2_over(decays):
    def hgrn2(q, v, x):
        A = decays(x)
        S = torch.zeros(B, H, K, V)
        outs = []
        for t in range(T):
            S = S * A[:, t][..., None] + (1 - A[:, t])[..., None] * v[:, t][..., None, :]
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        return torch.stack(outs, 1), S
    return hgrn2


HGRN2_DECAYS = {
    "sigmoid": torch.sigmoid,
    "exp_logsigmoid": lambda x: F.logsigmoid(x).exp(),
    "input": lambda a: a,  # the decay is the graph input itself
}


@pytest.mark.parametrize("decay", sorted(HGRN2_DECAYS))
def test_hgrn2_with_its_decay_selected_twice_per_step_is_recognised(decay):
    fn = hgrn2_over(HGRN2_DECAYS[decay])
    gen = torch.Generator().manual_seed(2)
    q, v, x = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen), \
        torch.randn(B, T, H, K, generator=gen)
    if decay == "input":
        x = torch.sigmoid(x + 2)
    args = [a.requires_grad_() for a in (q, v, x)]
    expected_out, expected_grads = outputs_and_grads(fn, args)
    model = compiled(fn)
    out, grads = outputs_and_grads(model, args)
    (row,) = model.laplace_report.recurrences
    assert row.status == "GLA site", row.reason
    assert_relative(out, expected_out, 1e-5)
    assert_relative(grads, expected_grads, 1e-5)


# -- float64 ------------------------------------------------------------------------------------------


def float64_loop(q, k, v, g):
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1)


def test_a_float64_loop_is_kept_as_written_because_the_gla_ops_compute_in_float32():
    gen = torch.Generator().manual_seed(3)
    q, k, x = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    args = [a.requires_grad_() for a in (q, k, v, F.logsigmoid(x))]
    expected_out, expected_grads = outputs_and_grads(float64_loop, args)
    model = compiled(float64_loop)
    out, grads = outputs_and_grads(model, args)
    (row,) = model.laplace_report.recurrences
    assert row.status == "declined"
    assert row.reason == (f"a {T}-step loop carrying a [{B}, {H}, {K}, {V}] state, but it computes in torch.float64 "
                          "(einsum_1) and the GLA ops compute in float32 (they take no float64), so a float64 loop is "
                          "kept as written")
    assert_relative(out, expected_out, 1e-12)
    assert_relative(grads, expected_grads, 1e-12)
