"""The tensors a select's condition comes from: document ids and positions given as integers or floats, a
reset from the loop's second step on, and the conditions a step cannot be read from, with the reason.

The random-input check draws ids that only a condition reads as small whole numbers, so that `positions ==
0` resets somewhere (NOTE [random sources of a select's condition] in laplace_passes/fx/validate.py): a
rewrite that ignored the resets had passed it with float positions, and integer ones had been refused. A
loop that resets from its second step on (`if t > 0`) is a site from there, its first step as written. A
condition that reads two positions (`doc[:, t] != doc[:, t - 1]`) or the step's number (`t < lengths`) is
declined with what to write instead, and that is recognised. A bool mask multiplying the decay (a reset
written as a product) is drawn at random like a select's. Every loop is checked against itself run
eagerly: outputs, final state and the gradients of r, k, v and the gates.
"""

import pytest
import torch
import torch.nn.functional as F

import laplace_passes
from laplace_passes.fx.gla_build import GlaBuilder
from tests.test_readouts_before_update import B, H, K, T, V, _outer, compiled, inputs, relative_error

POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
DOCUMENTS = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 5], [0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]])
LENGTHS = torch.tensor([9, 12])


def _update(S, k, v, w, t):
    return S * w[:, :, t].exp()[..., None] + _outer(k[:, :, t], v[:, :, t])


def _read(r, S, t):
    return (r[:, :, t, :, None] * S).sum(-2)


def reset_at_position_0(r, k, v, w, u, positions):
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = _update(torch.where((positions[:, t] == 0)[:, None, None, None], 0.0, S), k, v, w, t)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def rwkv6_reset_at_position_0(r, k, v, w, u, positions):
    """RWKV-6's order (read out before the update, with its bonus) over packed documents."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        R = torch.where((positions[:, t] == 0)[:, None, None, None], 0.0, S)
        kv = _outer(k[:, :, t], v[:, :, t])
        outs.append((r[:, :, t, :, None] * (R + u[None, :, :, None] * kv)).sum(-2))
        S = R * w[:, :, t].exp()[..., None] + kv
    return torch.stack(outs, 2), S


def reset_from_the_second_step(r, k, v, w, u, documents):
    starts = documents == 0
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        if t > 0:
            S = torch.where(starts[:, t, None, None, None], 0.0, S)
        S = _update(S, k, v, w, t)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def reset_where_the_document_changes(r, k, v, w, u, documents):
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        if t > 0:
            S = torch.where((documents[:, t] != documents[:, t - 1])[:, None, None, None], 0.0, S)
        S = _update(S, k, v, w, t)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def document_changes_computed_before(r, k, v, w, u, documents):
    """What the reason for the loop above asks for."""
    starts = F.pad(documents[:, 1:] != documents[:, :-1], (1, 0))
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = _update(torch.where(starts[:, t, None, None, None], 0.0, S), k, v, w, t)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def skip_after_the_length(r, k, v, w, u, lengths):
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = torch.where((t < lengths)[:, None, None, None], _update(S, k, v, w, t), S)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def valid_tokens_computed_before(r, k, v, w, u, lengths):
    """What the reason for the loop above asks for."""
    valid = torch.arange(T) < lengths[:, None]
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = torch.where(valid[:, t, None, None, None], _update(S, k, v, w, t), S)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


STARTS = POSITIONS == 0


def kept_by_a_mask_in_the_decay(r, k, v, w, u, starts):
    """A reset written as a product: the decay times a bool mask, 0 where a document starts."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * (~starts[:, t])[:, None, None, None] * w[:, :, t].exp()[..., None] + _outer(k[:, :, t], v[:, :, t])
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def kept_by_a_mask_in_its_own_statement(r, k, v, w, u, starts):
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * (1 - starts[:, t, None, None, None].float())
        S = _update(S, k, v, w, t)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def outputs_and_grads(fn, ids):
    """The loop's outputs and the gradients of r, k, v and the gates (u and the ids aside)."""
    args = inputs()
    out = fn(*args, ids)
    weights = [torch.linspace(-1, 1, o.numel()).view_as(o) for o in out]
    loss = sum((o * w).sum() for o, w in zip(out, weights))
    return [o.detach() for o in out] + list(torch.autograd.grad(loss, args[:4]))


def assert_as_eager(fn, ids):
    expected = outputs_and_grads(fn, ids)
    found = outputs_and_grads(compiled(fn), ids)
    for f, e in zip(found, expected):
        assert relative_error(f, e) < 1e-5


SITES = {
    reset_at_position_0: (POSITIONS, T, "states reset by a select"),
    rwkv6_reset_at_position_0: (POSITIONS, T, "states reset by a select, each state read out before its update"),
    reset_from_the_second_step: (DOCUMENTS, T - 1, "states reset by a select"),
    document_changes_computed_before: (DOCUMENTS, T, "states reset by a select"),
    valid_tokens_computed_before: (LENGTHS, T, "steps skipped by a select"),
    kept_by_a_mask_in_the_decay: (STARTS, T, "per-key gates"),
    kept_by_a_mask_in_its_own_statement: (STARTS, T, "per-key gates"),
}


CASES = [(fn, dtype) for fn, (ids, _, _) in SITES.items()
         for dtype in ([torch.bool] if ids.dtype == torch.bool else [torch.int64, torch.float32])]


@pytest.mark.parametrize("fn, dtype", CASES, ids=[f"{fn.__name__}-{str(d)[6:]}" for fn, d in CASES])
def test_a_loop_whose_condition_reads_ids_is_one_site_equal_to_eager(fn, dtype):
    """A bool mask in the decay (a token loop reads it a token at a time, so random masks stand for it) had
    been refused as "a mask held in a buffer or passed in"."""
    ids, steps, form = SITES[fn]
    assert_as_eager(fn, ids.to(dtype))
    (row,) = laplace_passes.last_report().recurrences
    assert row.status == "GLA site" and form in row.form and f"{steps} steps" in row.form, row
    assert row.steps == T, row  # the loop's own steps, its first counted where it stays as written


def test_a_rewrite_that_ignored_the_resets_is_caught_on_random_ids(monkeypatch):
    """A builder that leaves the resets out makes a rewrite that is wrong wherever a document starts: the
    random-input check must draw positions that equal 0, so the loop is kept as written, with the error."""
    monkeypatch.setattr(GlaBuilder, "reset_states", lambda self: None)
    assert_as_eager(reset_at_position_0, POSITIONS.float())
    (row,) = laplace_passes.last_report().recurrences
    assert row.status == "declined" and "on random inputs its GLA form differs from the loop" in row.reason, row


@pytest.mark.parametrize("fn, ids, reason", [
    (reset_where_the_document_changes, DOCUMENTS, "step 1's reset (getitem_19) reads positions 1 and 2 of "
     "l_documents_, where a step reads one: computed for every token before the loop (`doc[:, 1:] != doc[:, "
     ":-1]`, padded to T) and indexed at the step, it would be read"),
    (skip_after_the_length, LENGTHS, "step 1's skip (gt_1) computes with the step's number, which is not read "
     "as a position: computed for every token before the loop (`torch.arange(T) < lengths[:, None]`) and "
     "indexed at the step, it would be read"),
], ids=["two_positions", "the_step_number"])
def test_a_condition_a_step_cannot_be_read_from_is_declined_with_what_to_write(fn, ids, reason):
    """Before, the first loop got no row at all (cut at every reset into one-step pieces) and the second a
    reason that said only that step 1 differs from step 0."""
    assert_as_eager(fn, ids)
    (row,) = laplace_passes.last_report().recurrences
    assert row.status == "declined" and reason in row.reason, row
