"""Loops that read each state out before its update, o_t = q_t . S_{t-1}, with or without RWKV's bonus term.

Such a loop is GLA on k, v and the decay one token late, and its final state one update further (NOTE
[readouts before the update] in laplace_passes/fx/readouts.py); RWKV's readout r_t . (S_{t-1} + u * k_t (x)
v_t) adds a term that does not read the state (NOTE [a readout's bonus term]), in any spelling of k_t (x)
v_t; over packed documents, the state reset before the token reads it. Each loop becomes one GLA site
whose outputs, final state and input gradients equal the loop's own, run eagerly; fla's own
`naive_recurrent_rwkv6` too, over more than one chunk; two loops whose readouts are summed, two sites. A loop whose bonus inside its readout reads another token than its update is declined
and keeps its numbers.
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
    """The bonus summed apart from the state's readout, over an index of its own, and added to it: the readout
    is the einsum, the bonus stays as written, per token."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        bonus = (r[:, :, t] * u * k[:, :, t]).sum(-1, keepdim=True) * v[:, :, t]
        outs.append(torch.einsum("bhk,bhkv->bhv", r[:, :, t], S) + bonus)
        S = S * w[:, :, t].exp()[..., None] + _outer(k[:, :, t], v[:, :, t])
    return torch.stack(outs, 2), S


def rwkv6_kv_as_a_matmul(r, k, v, w, u):
    """kv written as a matmul, used by the bonus and the update (it had been taken for a second state)."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        kv = k[:, :, t].unsqueeze(-1) @ v[:, :, t].unsqueeze(-2)
        outs.append((r[:, :, t, :, None] * (S + u[None, :, :, None] * kv)).sum(-2))
        S = S * w[:, :, t].exp()[..., None] + kv
    return torch.stack(outs, 2), S


def two_loops_read_out_together(r, k, v, w, u):
    """Two recurrences whose readouts are summed, each token: two sites (the other loop's readout is not a
    bonus term of this one's)."""
    S, P = r.new_zeros(B, H, K, V), r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * w[:, :, t].exp()[..., None] + _outer(k[:, :, t], v[:, :, t])
        P = P * 0.9 + _outer(u[None] * r[:, :, t], v[:, :, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", r[:, :, t], S) + torch.einsum("bhk,bhkv->bhv", k[:, :, t], P))
    return torch.stack(outs, 2), S, P


# Packed documents: where each sequence's documents start (a reset of the state before the token reads it).
STARTS = torch.zeros(B, T, dtype=torch.bool)
STARTS[0, 5] = STARTS[1, 0] = STARTS[1, 9] = STARTS[1, T - 1] = True


def rwkv6_reset_before_its_readout(r, k, v, w, u):
    """RWKV-6 over packed documents: the state reset at a document's first token, then read out and updated
    (the select read twice: it had been no reset, and the loop no recurrence)."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = torch.where(STARTS[:, t, None, None, None], 0.0, S)
        kv = _outer(k[:, :, t], v[:, :, t])
        outs.append((r[:, :, t, :, None] * (S + u[None, :, :, None] * kv)).sum(-2))
        S = S * w[:, :, t].exp()[..., None] + kv
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
    rwkv6_bonus_apart: "each state read out before its update, state",  # the bonus added after: as written
}


DESCRIBED[rwkv6_kv_as_a_matmul] = DESCRIBED[rwkv6_bonus_inside]
DESCRIBED[rwkv6_reset_before_its_readout] = ("states reset by a select, each state read out before its update, a "
                                             "bonus term in the readout")
DESCRIBED[two_loops_read_out_together] = "token loop, 12 steps, per-key gates, state"


@pytest.mark.parametrize("fn", list(DESCRIBED), ids=lambda f: f.__name__)
def test_each_loop_is_a_site_equal_to_eager(fn):
    args = inputs()
    expected_out, expected_grads = outputs_and_grads(fn, args)
    out, grads = outputs_and_grads(compiled(fn), args)
    report = laplace_passes.last_report()
    rows = report.recurrences
    assert [(r.status, r.steps) for r in rows] == [("GLA site", T)] * len(rows) and rows, rows
    assert DESCRIBED[fn] in rows[0].form, rows[0].form
    assert len(report.sites) == len(rows) == (2 if fn is two_loops_read_out_together else 1)
    for found, expected in zip([*out, *grads], [*expected_out, *expected_grads]):
        assert relative_error(found, expected) < 1e-5


def bonus_of_the_previous_token(r, k, v, w, u):
    """The bonus inside the readout reads k one token earlier than the update: not RWKV's readout."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(1, T):
        bonus = u[None, :, :, None] * _outer(k[:, :, t - 1], v[:, :, t])
        outs.append((r[:, :, t, :, None] * (S + bonus)).sum(-2))
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


@pytest.mark.parametrize("gates_inside", [True, False], ids=["gates_proven", "gates_given"])
def test_a_bonus_site_under_an_inner_compiler_that_lowers(gates_inside):
    """With a lowering inner compiler a recognised loop's gates must be proven <= 0 (NOTE [unproven gates of a
    recognised loop]): the proof reads the GLA call's gates, not its output, to which the bonus is added (it
    had read the output's operands and raised). Gates computed as logsigmoid in the function: a site; gates
    given as an input: kept as written, saying why."""
    pytest.importorskip("torch_mlir")

    def rwkv6(r, k, v, x, u):
        return rwkv6_bonus_inside(r, k, v, F.logsigmoid(x) if gates_inside else x, u)

    args = [a.detach() for a in inputs()]
    expected = rwkv6(*args)
    torch._dynamo.reset()
    found = torch.compile(rwkv6, backend="laplace", options={"target": "cpu", "inner": "stablehlo"})(*args)
    for f, e in zip(found, expected):
        assert relative_error(f, e) < 1e-5
    (row,) = laplace_passes.last_report().recurrences
    if gates_inside:
        assert row.status == "GLA site" and "a bonus term in the readout" in row.form, row
    else:
        assert row.status == "declined" and "are not shown to be <= 0" in row.reason, row


def skip_after_a_reset_before_the_readout(r, k, v, w, u):
    """Packed documents with right padding: a document starts where its position id is 0 (the padding's ids
    are 0 too), and a padding token's update is skipped, keeping the state from before the reset."""
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3]],
                             dtype=torch.float32)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, 9:] = False
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        R = torch.where((positions[:, t] == 0)[:, None, None, None], 0.0, S)
        kv = _outer(k[:, :, t], v[:, :, t])
        outs.append((r[:, :, t, :, None] * (R + u[None, :, :, None] * kv)).sum(-2))
        S = torch.where(valid[:, t, None, None, None], R * w[:, :, t].exp()[..., None] + kv, S)
    return torch.stack(outs, 2), S


def test_a_skip_beside_a_reset_before_the_readout_is_declined_with_its_reason_and_its_numbers():
    """A skipped token keeps the state from before the reset, which the late sequence cannot hold. The
    random-input check draws no reset from a mask computed from positions (`== 0` of random floats), so it
    had passed the rewrite, whose final state and gradients were wrong."""
    args = inputs()
    expected_out, expected_grads = outputs_and_grads(skip_after_a_reset_before_the_readout, args)
    out, grads = outputs_and_grads(compiled(skip_after_a_reset_before_the_readout), args)
    for found, expected in zip([*out, *grads], [*expected_out, *expected_grads]):
        assert relative_error(found, expected) < 1e-6
    (row,) = laplace_passes.last_report().recurrences
    assert row.status == "declined" and "a select skips some of its updates and another resets the state its " \
        "readouts read" in row.reason, row


def reset_state_also_returned_at_one_token(r, k, v, w, u):
    """An inclusive loop over packed documents whose reset state at one token is also returned."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        R = torch.where(STARTS[:, t, None, None, None], 0.0, S)
        if t == T // 2:
            middle = R
        S = R * w[:, :, t].exp()[..., None] + _outer(k[:, :, t], v[:, :, t])
        outs.append((r[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outs, 2), S, middle


def test_a_reset_state_read_by_more_than_its_update_at_one_token_cuts_the_loop_there():
    """As where a select resets the state at some tokens only: the loop is cut at that select, the steps
    after it one site (the whole loop had been declined once reset selects could have readers)."""
    args = inputs()
    expected_out, expected_grads = outputs_and_grads(reset_state_also_returned_at_one_token, args)
    out, grads = outputs_and_grads(compiled(reset_state_also_returned_at_one_token), args)
    for found, expected in zip([*out, *grads], [*expected_out, *expected_grads]):
        assert relative_error(found, expected) < 1e-5
    sites = [r for r in laplace_passes.last_report().recurrences if r.status == "GLA site"]
    assert [r.steps for r in sites] == [T - T // 2], laplace_passes.last_report().recurrences
