"""Token loops whose steps a select skips, `S = torch.where(c_t, S * a + k v, S)` (padding, documents of several
lengths in one batch): one GLA site with the gate 0 and k = v = 0 at the skipped steps (NOTE [steps a select
skips] in laplace_passes/fx/update_tops.py), checked against the loop run eagerly. And loops whose state a select
resets, `S = torch.where(r_t, 0, S) * a + k v` (documents packed into one sequence): the gate -inf there (NOTE
[states a select resets])."""

from __future__ import annotations

import pytest
import torch

import laplace_passes
from tests import recognise_cases as cases
from tests.test_recognise import assert_close, compiled, outputs_and_grads
from tests import test_recognise_spellings as spellings

B, T, H, K, V = cases.B, cases.T, cases.H, cases.K, cases.V


def valid_tokens(seed: int = 3) -> torch.Tensor:
    """[B, T] bool: random gaps, sequence 1 padded on the left and sequence 0 on the right."""
    valid = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) < 0.7
    valid[1, :3] = False
    valid[0, -4:] = False
    return valid


def per_sequence(valid):
    def loop(q, k, v, g):
        S = torch.zeros(B, H, K, V)
        outs = []
        for t in range(T):
            update = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            S = torch.where(valid[:, t, None, None, None], update, S)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        return torch.stack(outs, 1), S

    return loop


def kept_where_padded(padded):
    """The select the other way round (the state kept where `padded` is true), gates one per head."""
    def loop(q, k, v, g):
        S = torch.zeros(B, H, K, V)
        outs = []
        for t in range(T):
            update = S * g[:, t, :, None, None].exp() + k[:, t, :, :, None] * v[:, t, :, None, :]
            S = torch.where(padded[:, t, None, None, None], S, update)
            outs.append((q[:, t, :, :, None] * S).sum(-2))
        return torch.stack(outs, 1), S

    return loop


def decayed_after_the_sum(valid):
    """A select around an update whose decay comes after the sum (NOTE [a decay after the sum])."""
    def loop(q, k, v, g):
        S = torch.zeros(B, H, K, V)
        outs = []
        for t in range(T):
            update = (S + k[:, t, :, :, None] * v[:, t, :, None, :]) * g[:, t].exp()[..., None]
            S = torch.where(valid[:, t, None, None, None], update, S)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        return torch.stack(outs, 1), S

    return loop


def per_key(valid_keys):
    """A select per key channel: the token's term kept in some channels of the state and not others."""
    def loop(q, k, v, g):
        S = torch.zeros(B, H, K, V)
        outs = []
        for t in range(T):
            update = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            S = torch.where(valid_keys[:, t, None, :, None], update, S)
            outs.append((q[:, t, :, :, None] * S).sum(-2))
        return torch.stack(outs, 1), S

    return loop


def the_site():
    report = laplace_passes.last_report()
    (row,) = report.recurrences
    (site,) = report.sites
    return row, site


@pytest.mark.parametrize("spelling, gates", [(per_sequence, "key"), (kept_where_padded, "head"),
                                             (decayed_after_the_sum, "key")],
                         ids=["where(valid, update, S)", "where(padded, S, update)", "where(valid, (S + kv) a, S)"])
def test_a_loop_whose_steps_a_select_skips_is_one_gla_site_with_the_loop_s_outputs_and_gradients(spelling, gates):
    valid = valid_tokens()
    fn = spelling(~valid if spelling is kept_where_padded else valid)
    args = [a.clone().requires_grad_() for a in cases.inputs(gates=gates)]
    expected_out, expected_grads = outputs_and_grads(fn, args)
    out, grads = outputs_and_grads(compiled(fn), args)
    assert_close(out, expected_out)
    assert_close(grads, expected_grads)
    row, site = the_site()
    assert row.status == "GLA site" and row.steps == T and "steps skipped by a select" in row.form, row
    assert site.status == "retiled" and site.plan["n_chunks"] == 3
    # The skipped tokens pass no gradient to their k, v and gates, as the select passes none (q still reads).
    skipped = ~valid
    for grad in grads[1:]:
        assert grad[skipped].abs().max() == 0


def test_the_select_is_recognised_whatever_mask_the_graph_is_traced_with():
    """The mask is an input of the graph; the rewrite is checked on random masks, so another mask at the next
    call gets the loop's numbers too."""
    args = [a.clone().requires_grad_() for a in cases.inputs()]
    valid = valid_tokens()
    model = compiled(per_sequence(valid))
    model(*args)
    valid.copy_(valid_tokens(seed=11))  # the same tensor, other values: no retrace
    expected_out, expected_grads = outputs_and_grads(per_sequence(valid), args)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out)
    assert_close(grads, expected_grads)
    assert model.laplace_report.recurrences[0].status == "GLA site"


def test_a_non_finite_value_at_a_skipped_token_stays_out_of_the_state():
    """The select never reads a skipped token's update: v = inf there changes nothing in the loop, nor in its
    GLA site (v is zeroed there, not multiplied by a zero k)."""
    valid = valid_tokens()
    q, k, v, g = cases.inputs()
    v[~valid] = float("inf")
    with torch.no_grad():
        expected = per_sequence(valid)(q, k, v, g)
        found = compiled(per_sequence(valid))(q, k, v, g)
    assert all(torch.isfinite(e).all() for e in expected)
    assert_close(found, expected)
    assert the_site()[0].status == "GLA site"


def test_a_mask_built_in_the_function_is_read_as_the_constant_it_is():
    args = spellings.inputs()
    with torch.no_grad():
        expected = spellings.where_skip(*args)
        found = compiled(spellings.where_skip)(*args)
    assert_close(found, expected)
    row, _ = the_site()
    assert row.status == "GLA site" and "steps skipped by a select" in row.form


def test_a_select_per_key_channel_is_declined_with_its_reason_and_unchanged_numbers():
    valid_keys = torch.rand(B, T, K, generator=torch.Generator().manual_seed(5)) < 0.7
    fn = per_key(valid_keys)
    args = [a.clone().requires_grad_() for a in cases.inputs()]
    expected_out, expected_grads = outputs_and_grads(fn, args)
    out, grads = outputs_and_grads(compiled(fn), args)
    assert_close(out, expected_out, rtol=0, atol=0)
    assert_close(grads, expected_grads, rtol=1e-6, atol=1e-6)
    report = laplace_passes.last_report()
    (row,) = report.recurrences
    assert row.status == "declined" and not report.sites
    assert f"[{B}, 1, {K}, 1] chooses per key or value channel of the state" in row.reason, row.reason


def squashed(valid):
    """A select around an update the algebra does not read (a tanh of the GLA update)."""
    def loop(q, k, v, g):
        S = torch.zeros(B, H, K, V)
        outs = []
        for t in range(T):
            update = torch.tanh(S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :])
            S = torch.where(valid[:, t, None, None, None], update, S)
            outs.append((q[:, t, :, :, None] * S).sum(-2))
        return torch.stack(outs, 1), S

    return loop


def read_out_before_the_select(valid):
    """The update read out before the select keeps or skips it: the select is what the algebra does not read."""
    def loop(q, k, v, g):
        S = torch.zeros(B, H, K, V)
        outs = []
        for t in range(T):
            update = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append((q[:, t, :, :, None] * update).sum(-2))
            S = torch.where(valid[:, t, None, None, None], update, S)
        return torch.stack(outs, 1), S

    return loop



@pytest.mark.parametrize("spelling, named", [(squashed, "update: tanh"), (read_out_before_the_select, "S_1: where")],
                         ids=["tanh inside the select", "the update read out too"])
def test_a_declined_select_names_the_op_the_algebra_does_not_read(spelling, named):
    """The op inside the select's update when there is one (the select itself is read), else the select."""
    fn = spelling(valid_tokens())
    args = cases.inputs()
    with torch.no_grad():
        expected = fn(*args)
        found = compiled(fn)(*args)
    assert_close(found, expected, rtol=0, atol=0)
    (row,) = laplace_passes.last_report().recurrences
    assert row.status == "declined", row
    assert f"({named}, an op the algebra does not read)" in row.reason, row.reason



def reset_where_starting(starts):
    """The state reset where a document starts: `torch.where(starts_t, 0, S)` read by the update."""
    def loop(q, k, v, g):
        S = torch.zeros(B, H, K, V)
        outs = []
        for t in range(T):
            S = torch.where(starts[:, t, None, None, None], 0.0, S) * g[:, t].exp()[..., None] \
                + k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append((q[:, t, :, :, None] * S).sum(-2))
        return torch.stack(outs, 1), S

    return loop


def kept_where_continuing(continues):
    """The other way round, `torch.where(continues_t, S, torch.zeros_like(S))`, the decay per head and first."""
    def loop(q, k, v, g):
        S = torch.zeros(B, H, K, V)
        outs = []
        for t in range(T):
            kept = torch.where(continues[:, t, None, None, None], S, torch.zeros_like(S))
            S = g[:, t, :, None, None].exp() * kept + k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        return torch.stack(outs, 1), S

    return loop


def document_starts(seed: int = 4) -> torch.Tensor:
    starts = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) < 0.2
    starts[:, 0] = True
    return starts


@pytest.mark.parametrize("spelling, gates", [(reset_where_starting, "key"), (kept_where_continuing, "head")],
                         ids=["where(starts, 0, S) * a + kv", "a * where(continues, S, zeros_like(S)) + kv"])
def test_a_loop_whose_state_a_select_resets_is_one_gla_site_with_the_loop_s_outputs_and_gradients(spelling, gates):
    starts = document_starts()
    fn = spelling(~starts if spelling is kept_where_continuing else starts)
    args = [a.clone().requires_grad_() for a in cases.inputs(gates=gates)]
    expected_out, expected_grads = outputs_and_grads(fn, args)
    out, grads = outputs_and_grads(compiled(fn), args)
    assert_close(out, expected_out)
    assert_close(grads, expected_grads)
    row, site = the_site()
    assert row.status == "GLA site" and "states reset by a select" in row.form, row
    assert site.status == "retiled"
    # A token after a reset reads nothing from before it: its output is its own k v read by q.
    q, k, v, _ = (a.detach() for a in args)
    b, t = 0, int(starts[0, 1:].nonzero()[0]) + 1
    own = torch.einsum("hk,hk,hv->hv", q[b, t], k[b, t], v[b, t])
    torch.testing.assert_close(out[0][b, t], own, rtol=1e-5, atol=1e-5)


def test_a_reset_per_key_channel_is_declined_with_its_reason():
    starts = torch.rand(B, T, K, generator=torch.Generator().manual_seed(6)) < 0.2

    def loop(q, k, v, g):
        S = torch.zeros(B, H, K, V)
        outs = []
        for t in range(T):
            S = torch.where(starts[:, t, None, :, None], 0.0, S) * g[:, t].exp()[..., None] \
                + k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append((q[:, t, :, :, None] * S).sum(-2))
        return torch.stack(outs, 1), S

    args = cases.inputs()
    with torch.no_grad():
        expected = loop(*args)
        found = compiled(loop)(*args)
    assert_close(found, expected, rtol=0, atol=0)
    (row,) = laplace_passes.last_report().recurrences
    assert row.status == "declined" and "chooses per key or value channel" in row.reason, row.reason


def reset_once(q, k, v, g):
    """One reset select, at step 10 only: the loop is two loops, each from the state it starts from."""
    starts = document_starts()
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        if t == 10:
            S = torch.where(starts[:, t, None, None, None], 0.0, S)
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def filled_zero(q, k, v, g):
    """A zero fill written in place before the select reads it: no reset (it holds 0.5), so not one."""
    starts = document_starts()
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        z = torch.zeros_like(S)
        z.fill_(0.5)
        S = torch.where(starts[:, t, None, None, None], z, S) * g[:, t].exp()[..., None] \
            + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def test_a_reset_at_some_steps_only_cuts_the_loop_there():
    args = [a.clone().requires_grad_() for a in cases.inputs()]
    expected_out, expected_grads = outputs_and_grads(reset_once, args)
    out, grads = outputs_and_grads(compiled(reset_once), args)
    assert_close(out, expected_out)
    assert_close(grads, expected_grads)
    rows = laplace_passes.last_report().recurrences
    assert [(r.status, r.steps) for r in rows] == [("GLA site", 10), ("GLA site", 10)], rows


def test_a_zero_fill_written_in_place_is_no_reset():
    args = [a.clone().requires_grad_() for a in cases.inputs()]
    expected_out, expected_grads = outputs_and_grads(filled_zero, args)
    out, grads = outputs_and_grads(compiled(filled_zero), args)
    assert_close(out, expected_out, rtol=0, atol=0)
    assert_close(grads, expected_grads, rtol=1e-6, atol=1e-6)
    assert all(r.status == "declined" for r in laplace_passes.last_report().recurrences)
