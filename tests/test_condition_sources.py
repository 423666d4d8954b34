"""The tensors a select's condition comes from: document ids and positions given as integers or floats, a
reset from the loop's second step on, and the conditions a step cannot be read from, with the reason.

The random-input check draws ids and positions (integer ones, and float ones a condition reads) as small
whole numbers, so that `positions == 0` resets somewhere (NOTE [random sources of a select's condition] in laplace_passes/fx/validate.py): a
rewrite that ignored the resets had passed it with float positions, and integer ones had been refused; the
draws include the numbers a condition compares with (`ids == -100`) and -1 (an additive mask's `< 0`), and a
condition no draw turns, or ids that index a table, decline the loop with the reason. A loop that resets
from its second (or third) step on (`if t > 0`) is a site from there, the steps before as written. A
condition that reads two positions (`doc[:, t] != doc[:, t - 1]`) or the step's number (`t < lengths`) is
declined with what to write instead, and that is recognised. A bool mask multiplying the decay (a reset
written as a product) is drawn at random like a select's, an int64 attention mask there too, and
`S.masked_fill(starts, 0)` is a reset select; a reset to a state of its own, and two reset selects one
after the other, are declined with the reason (they had no row). Every loop is checked against itself run
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


def rwkv6_reset_from_the_second_step(r, k, v, w, u, documents):
    """RWKV-6's order with its bonus: the readout's sum reads the reset state too (it had got a second row,
    linked through that select to the first step)."""
    starts = documents == 0
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        if t > 0:
            S = torch.where(starts[:, t, None, None, None], 0.0, S)
        kv = _outer(k[:, :, t], v[:, :, t])
        outs.append((r[:, :, t, :, None] * (S + u[None, :, :, None] * kv)).sum(-2))
        S = S * w[:, :, t].exp()[..., None] + kv
    return torch.stack(outs, 2), S


def reset_from_the_third_step(r, k, v, w, u, documents):
    """Two steps before the first reset: both stay as written, and count as the loop's."""
    starts = documents == 0
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        if t > 1:
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


def reset_where(condition, scaled_by_positions=False):
    """A reset where `condition(ids[:, t])`; k scaled by a function of the ids too, if asked."""
    def loop(r, k, v, w, u, ids):
        S = r.new_zeros(B, H, K, V)
        outs = []
        for t in range(T):
            k_t = k[:, :, t] * (ids[:, t, None, None] + 2).rsqrt() if scaled_by_positions else k[:, :, t]
            S = torch.where(condition(ids[:, t])[:, None, None, None], 0.0, S)
            S = S * w[:, :, t].exp()[..., None] + _outer(k_t, v[:, :, t])
            outs.append(_read(r, S, t))
        return torch.stack(outs, 2), S

    return loop


def skip_where(condition):
    def loop(r, k, v, w, u, ids):
        S = r.new_zeros(B, H, K, V)
        outs = []
        for t in range(T):
            S = torch.where(condition(ids[:, t])[:, None, None, None], S, _update(S, k, v, w, t))
            outs.append(_read(r, S, t))
        return torch.stack(outs, 2), S

    return loop


reset_at_position_0_with_k_scaled_by_positions = reset_where(lambda p: p == 0, scaled_by_positions=True)
reset_at_position_0_with_k_scaled_by_positions.__name__ = "reset_at_position_0_with_k_scaled_by_positions"


ATTENTION_MASK = (torch.arange(T) < LENGTHS[:, None]).long()  # as tokenizers return it: int64 ones and zeros


def kept_by_an_attention_mask(r, k, v, w, u, attention_mask):
    """An integer mask scaling the decay (drawn never negative: no comparison asks for it)."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * attention_mask[:, t, None, None, None] * w[:, :, t].exp()[..., None] + _outer(k[:, :, t], v[:, :, t])
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def reset_by_masked_fill(r, k, v, w, u, positions):
    """`S.masked_fill(starts, 0)`: the select `torch.where(starts, 0, S)` in another spelling."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = _update(S.masked_fill((positions[:, t] == 0)[:, None, None, None], 0.0), k, v, w, t)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def reset_to_an_initial_state(r, k, v, w, u, positions):
    """A document starts from a state of its own, not from 0: not GLA's reset."""
    h0 = u[None, :, :, None].expand(B, H, K, V)
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = _update(torch.where((positions[:, t] == 0)[:, None, None, None], h0, S), k, v, w, t)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def two_resets_one_after_the_other(r, k, v, w, u, positions):
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = torch.where((positions[:, t] == 0)[:, None, None, None], 0.0, S)
        S = torch.where((positions[:, t] == 3)[:, None, None, None], 0.0, S)
        S = _update(S, k, v, w, t)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def a_masked_fill_after_a_reset(r, k, v, w, u, positions):
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = torch.where((positions[:, t] == 0)[:, None, None, None], 0.0, S)
        S = _update(S.masked_fill((positions[:, t] == 3)[:, None, None, None], 0.0), k, v, w, t)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def two_resets_in_one_select(r, k, v, w, u, positions):
    """What the reason for the loop above asks for."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = _update(torch.where(((positions[:, t] == 0) | (positions[:, t] == 3))[:, None, None, None], 0.0, S),
                    k, v, w, t)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def reset_by_masked_fill_with_its_value_named(r, k, v, w, u, positions):
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = _update(torch.masked_fill(S, (positions[:, t] == 0)[:, None, None, None], value=0.0), k, v, w, t)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def a_skipped_token_that_still_resets(r, k, v, w, u, positions):
    """The skip keeps the state after the reset: GLA's skip (gate 0) would keep the one before it."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        R = torch.where((positions[:, t] == 0)[:, None, None, None], 0.0, S)
        S = torch.where((positions[:, t] != 2)[:, None, None, None], _update(R, k, v, w, t), R)
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
    rwkv6_reset_from_the_second_step: (DOCUMENTS, T - 1, "a bonus term in the readout"),
    reset_from_the_third_step: (DOCUMENTS, T - 2, "the loop's first 2 steps (up to S_2) are not part of it"),
    document_changes_computed_before: (DOCUMENTS, T, "states reset by a select"),
    valid_tokens_computed_before: (LENGTHS, T, "steps skipped by a select"),
    kept_by_a_mask_in_the_decay: (STARTS, T, "per-key gates"),
    kept_by_a_mask_in_its_own_statement: (STARTS, T, "per-key gates"),
    reset_at_position_0_with_k_scaled_by_positions: (POSITIONS, T, "states reset by a select"),
    kept_by_an_attention_mask: (ATTENTION_MASK, T, "per-key gates"),
    reset_by_masked_fill: (POSITIONS, T, "states reset by a select"),
    two_resets_in_one_select: (POSITIONS, T, "states reset by a select"),
    reset_by_masked_fill_with_its_value_named: (POSITIONS, T, "states reset by a select"),
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


ADDITIVE_MASK = torch.where(LENGTHS[:, None] > torch.arange(T), 0.0, -1e4)
IGNORED = torch.where(LENGTHS[:, None] > torch.arange(T), POSITIONS, -100)
UNCHECKED = {  # a condition, and the ids it reads: a rewrite that ignores its select must be caught
    "positions_equal_0_int64": (reset_where(lambda p: p == 0), POSITIONS),
    "positions_equal_0_float32": (reset_where(lambda p: p == 0), POSITIONS.float()),
    "positions_equal_5": (reset_where(lambda p: p == 5), POSITIONS),
    "positions_also_scale_k": (reset_where(lambda p: p == 0, scaled_by_positions=True), POSITIONS.float()),
    "ids_equal_minus_100": (skip_where(lambda i: i == -100), IGNORED),
    "an_additive_mask_below_0": (skip_where(lambda m: m < 0), ADDITIVE_MASK),
    "a_masked_fill": (reset_by_masked_fill, POSITIONS),
}


# Each condition once, and one under two more random states the compile may start in.
PLANTED = [(name, 0) for name in UNCHECKED] + [("positions_equal_0_float32", seed) for seed in (1, 2)]


@pytest.mark.parametrize("name, seed", PLANTED, ids=[f"{name}-{seed}" for name, seed in PLANTED])
def test_a_rewrite_that_ignores_the_selects_is_caught_on_random_ids(monkeypatch, name, seed):
    """A builder that leaves the resets and skips out makes a rewrite that is wrong wherever a select acts:
    the random-input check must draw ids that make each condition true and false (NOTE [random sources of a
    select's condition]), so the loop is kept as written, with the error. Uniform floats never equal 0 or 5
    nor -100, integers had been refused, and draws from 0 to 3 made no additive mask negative; the verdict
    does not depend on the random state the compile starts in."""
    monkeypatch.setattr(GlaBuilder, "reset_states", lambda self: None)
    monkeypatch.setattr(GlaBuilder, "updated_steps", lambda self: None)
    fn, ids = UNCHECKED[name]
    torch.manual_seed(seed)
    assert_as_eager(fn, ids)
    (row,) = laplace_passes.last_report().recurrences
    assert row.status == "declined" and "on random inputs its GLA form differs from the loop" in row.reason, row


def test_a_condition_no_draw_turns_and_ids_that_index_a_table_are_declined_with_the_reason():
    """A select whose condition took one value on every draw would go unchecked; ids that index a table of
    two entries fall outside it when drawn for a comparison. Both loops keep their numbers."""
    assert_as_eager(reset_where(lambda p: p.abs() < 0), POSITIONS)
    (row,) = laplace_passes.last_report().recurrences
    assert row.status == "declined" and "on 4 draws of random inputs the condition of its reset select " in \
        row.reason and "took one value only within the first 8 steps" in row.reason, row
    flags = torch.tensor([True, False])
    assert_as_eager(reset_where(lambda kind: flags[kind]), (POSITIONS > 0).long())
    (row,) = laplace_passes.last_report().recurrences
    assert row.status == "declined" and "its first steps raised on random ids (IndexError: index " in \
        row.reason and "so its rewrite could not be checked" in row.reason, row


@pytest.mark.parametrize("fn, ids, reason", [
    (reset_where_the_document_changes, DOCUMENTS, "its reset (getitem_19) reads documents at positions 1 and 2 "
     "in one step, where a step reads each input at one: the condition computed for every token before the loop "
     "(`starts = F.pad(documents[:, 1:] != documents[:, :-1], (1, 0))` for a change of document) and indexed at "
     "the step is read"),
    (skip_after_the_length, LENGTHS, "step 1's skip compares the step's number with a tensor (gt_1), which is "
     "not read as a position: the same comparison made once before the loop, with torch.arange(T) in place of "
     "the step's number (`valid = torch.arange(T) < lengths[:, None]`), and indexed at the step (`valid[:, t]`), "
     "is read"),
    (reset_to_an_initial_state, POSITIONS, "its update reads its previous state through the select where_1, which "
     "puts h0 in its place where it acts: a reset restarts GLA's state from 0, and a skip keeps it"),
    (two_resets_one_after_the_other, POSITIONS, "selects reset its state one after the other (S_4, S_5): one "
     "select on either condition (`torch.where(c1 | c2, 0, S)`) is read"),
    (a_masked_fill_after_a_reset, POSITIONS, "selects reset its state one after the other (S_3, masked_fill_1)"),
    (a_skipped_token_that_still_resets, POSITIONS, "keeps the state its reset select R leaves where it skips the "
     "update, so a skipped token still resets, which GLA's skip (the gate 0) does not"),
], ids=["two_positions", "the_step_number", "reset_to_h0", "two_resets", "a_masked_fill_after_a_reset",
        "a_skipped_token_that_still_resets"])
def test_a_condition_a_step_cannot_be_read_from_is_declined_with_what_to_write(fn, ids, reason):
    """Before, the first loop got no row at all (cut at every reset into one-step pieces), the second a
    reason that said only that step 1 differs from step 0, and the last two no row (their steps did not link
    through the selects)."""
    assert_as_eager(fn, ids)
    (row,) = laplace_passes.last_report().recurrences
    assert row.status == "declined" and reason in row.reason and row.steps == T, row


def skip_where_the_keys_are_zero(r, k, v, w, u, positions):
    """Padding told by its zero keys: k is a value the loop reads and a condition's source (drawn uniform, so
    the condition need not turn both ways, as before ids were drawn)."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        valid = k[:, :, t].abs().sum(-1) > 0
        S = torch.where(valid[..., None, None], _update(S, k, v, w, t), S)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def reset_where_positions_also_scale_k_by_rsqrt(r, k, v, w, u, positions):
    """`(pos + 1).rsqrt()`: the positions drawn for the condition are never negative (-1 made k inf)."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        k_t = k[:, :, t] * (positions[:, t, None, None] + 1).rsqrt()
        S = torch.where((positions[:, t] == 0)[:, None, None, None], 0.0, S)
        S = S * w[:, :, t].exp()[..., None] + _outer(k_t, v[:, :, t])
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def reset_at_the_last_two_steps(r, k, v, w, u, documents):
    """Ten steps before the first reset are a loop of their own, a site (not the steps before a short one)."""
    starts = documents == 0
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        if t >= T - 2:
            S = torch.where(starts[:, t, None, None, None], 0.0, S)
        S = _update(S, k, v, w, t)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


@pytest.mark.parametrize("fn, ids, steps", [
    (skip_where_the_keys_are_zero, POSITIONS, [T]),
    (reset_where_positions_also_scale_k_by_rsqrt, POSITIONS.float(), [T]),
    (reset_at_the_last_two_steps, DOCUMENTS, [T - 2]),
], ids=["keys_zero", "rsqrt_positions", "last_two"])
def test_loops_the_draws_of_ids_had_declined_stay_sites(fn, ids, steps):
    assert_as_eager(fn, ids)
    sites = [r for r in laplace_passes.last_report().recurrences if r.status == "GLA site"]
    assert [len(r.form) > 0 and int(r.form.split(" steps")[0].split()[-1]) for r in sites] == steps, sites
