"""Loops that read each state out before its update, o_t = q_t . S_{t-1}, with or without RWKV's bonus term.

Such a loop is GLA on k, v and the decay one token late, and its final state one update further (NOTE
[readouts before the update] in laplace_passes/fx/readouts.py); RWKV's readout r_t . (S_{t-1} + u * k_t (x)
v_t) adds a term that does not read the state (NOTE [a readout's bonus term]). Each loop becomes one GLA
site whose outputs, final state and input gradients equal the loop's own, run eagerly; fla's own
`naive_recurrent_rwkv6` too, over more than one chunk. A loop that adds the bonus of another token than it
reads is declined and keeps its numbers.
"""

import pytest
import torch
import torch.nn.functional as F

import laplace_passes

B, H, T, K, V = 2, 2, 12, 8, 16


def inputs(seed: int = 0, tokens: int = T):
    gen = torch.Generator().manual_seed(seed)
    r, k = (torch.randn(B, H, tokens, K, generator=gen) for _ in range(2))
    v = torch.randn(B, H, tokens, V, generator=gen)
    w = F.logsigmoid(torch.randn(B, H, tokens, K, generator=gen) + 1)
    u = torch.randn(H, K, generator=gen)
    return [x.requires_grad_() for x in (r, k, v, w, u)]


def _outer(k_t, v_t):
    return k_t[..., None] * v_t[..., None, :]


def read_before_the_update(r, k, v, w, u):
    """A causal linear attention that leaves out the current token: no bonus (u unused)."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        outs.append((r[:, :, t, :, None] * S).sum(-2))
        S = S * w[:, :, t].exp()[..., None] + _outer(k[:, :, t], v[:, :, t])
    return torch.stack(outs, 2), S


def rwkv6_bonus_inside(r, k, v, w, u):
    """RWKV-6 as its equations write it: the bonus added to the state before the readout, kv used twice."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        kv = _outer(k[:, :, t], v[:, :, t])
        outs.append((r[:, :, t, :, None] * (S + u[None, :, :, None] * kv)).sum(-2))
        S = S * w[:, :, t].exp()[..., None] + kv
    return torch.stack(outs, 2), S


def rwkv6_bonus_apart(r, k, v, w, u):
    """The bonus summed apart from the state's readout, over an index of its own."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        bonus = (r[:, :, t] * u * k[:, :, t]).sum(-1, keepdim=True) * v[:, :, t]
        outs.append(torch.einsum("bhk,bhkv->bhv", r[:, :, t], S) + bonus)
        S = S * w[:, :, t].exp()[..., None] + _outer(k[:, :, t], v[:, :, t])
    return torch.stack(outs, 2), S


def outputs_and_grads(fn, args):
    out = fn(*args)
    weights = [torch.linspace(-1, 1, o.numel()).view_as(o) for o in out]
    loss = sum((o * w).sum() for o, w in zip(out, weights))
    return [o.detach() for o in out], torch.autograd.grad(loss, args, allow_unused=True, materialize_grads=True)


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="laplace", options={"target": "cpu", "inner": "eager"})


def relative_error(found, expected) -> float:
    return float((found - expected).norm() / expected.norm().clamp_min(1e-30))


DESCRIBED = {
    read_before_the_update: "each state read out before its update, state",
    rwkv6_bonus_inside: "each state read out before its update, a bonus term in the readout",
    rwkv6_bonus_apart: "each state read out before its update, a bonus term in the readout",
}


@pytest.mark.parametrize("fn", list(DESCRIBED), ids=lambda f: f.__name__)
def test_a_loop_reading_each_state_before_its_update_is_one_site_equal_to_eager(fn):
    args = inputs()
    expected_out, expected_grads = outputs_and_grads(fn, args)
    out, grads = outputs_and_grads(compiled(fn), args)
    report = laplace_passes.last_report()
    (row,) = report.recurrences
    assert row.status == "GLA site" and row.steps == T, row
    assert DESCRIBED[fn] in row.form, row.form
    assert len(report.sites) == 1
    for found, expected in zip([*out, *grads], [*expected_out, *expected_grads]):
        assert relative_error(found, expected) < 1e-5


def bonus_of_the_previous_token(r, k, v, w, u):
    """The bonus reads k one token earlier than the update: not RWKV's readout."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(1, T):
        bonus = (r[:, :, t] * u * k[:, :, t - 1]).sum(-1, keepdim=True) * v[:, :, t]
        outs.append(torch.einsum("bhk,bhkv->bhv", r[:, :, t], S) + bonus)
        S = S * w[:, :, t].exp()[..., None] + _outer(k[:, :, t], v[:, :, t])
    return torch.stack(outs, 2), S


def test_a_bonus_of_another_token_is_declined_with_its_reason_and_its_numbers():
    args = inputs()
    with torch.no_grad():
        expected = bonus_of_the_previous_token(*args)
        found = compiled(bonus_of_the_previous_token)(*args)
    for f, e in zip(found, expected):
        torch.testing.assert_close(f, e, rtol=0, atol=0)
    report = laplace_passes.last_report()
    (row,) = report.recurrences
    assert row.status == "declined" and not report.sites
    assert "positions that do not advance with the step" in row.reason, row.reason


def test_fla_s_naive_rwkv6_over_three_chunks_is_one_site_equal_to_fla_s_own():
    """fla's reference RWKV-6 (its initial state, its final state, its scale, its output written into a
    buffer token by token), over three chunks of 32 tokens."""
    naive = pytest.importorskip("fla.ops.rwkv6.recurrent_naive").naive_recurrent_rwkv6
    tokens = 70
    r, k, v, w, u = inputs(1, tokens)
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(2)).requires_grad_()
    args = [r, k, v, w, u, h0]

    def rwkv6(r, k, v, w, u, h0):
        return naive(r, k, v, w, u, initial_state=h0, output_final_state=True)

    expected_out, expected_grads = outputs_and_grads(rwkv6, args)
    torch._dynamo.reset()
    step = torch.compile(rwkv6, backend="laplace", options={"target": "cpu", "inner": "eager", "chunk_size": 32})
    out, grads = outputs_and_grads(step, args)
    report = laplace_passes.last_report()
    (row,) = report.recurrences
    assert row.status == "GLA site" and row.steps == tokens, row
    (site,) = report.sites
    assert site.status == "retiled" and (site.plan["chunk_size"], site.plan["n_chunks"]) == (32, 3), site
    for found, expected in zip([*out, *grads], [*expected_out, *expected_grads]):
        assert relative_error(found, expected) < 1e-5
