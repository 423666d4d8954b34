"""GLA token loops in more spellings of their update: fused multiply-adds and einsum with an ellipsis.

`torch.addcmul(S * a, k, v)`, `torch.baddbmm(S * a, k, v)` with heads merged into the batch, and
`torch.einsum("...k,...v->...kv", k, v)` compute the same update as `S * a + k (x) v`: each becomes one GLA
site whose outputs and input gradients equal eager's. A spelling the canonical algebra still does not
read keeps its eager numbers and gets a row in the report's recurrences table that says why, counting
the steps the user wrote.
"""

import pytest
import torch
import torch.nn.functional as F

import laplace_passes

B, T, H, K, V = 2, 12, 2, 8, 16


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2)
    return [x.requires_grad_() for x in (q, k, v, g)]


def _readout(q_t, S):
    return torch.einsum("bhk,bhkv->bhv", q_t, S)


def addcmul(q, k, v, g):
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = torch.addcmul(S * g[:, t].exp()[..., None], k[:, t][..., None], v[:, t][..., None, :], value=0.5)
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def addcmul_method(q, k, v, g):
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = (g[:, t].exp()[..., None] * S).addcmul(k[:, t].unsqueeze(-1), v[:, t].unsqueeze(-2))
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def baddbmm_merged_heads(q, k, v, g):
    """The state [B * H, K, V]: heads merged into the batch, baddbmm with a beta and an alpha."""
    q, k, v, g = (x.transpose(1, 2).reshape(B * H, T, -1) for x in (q, k, v, g))
    S = torch.zeros(B * H, K, V)
    outs = []
    for t in range(T):
        S = torch.baddbmm(S * g[:, t].exp()[..., None], k[:, t].unsqueeze(-1), v[:, t].unsqueeze(-2),
                          beta=0.9, alpha=2.0)
        outs.append(torch.bmm(q[:, t].unsqueeze(1), S).squeeze(1))
    return torch.stack(outs, 1), S


def einsum_ellipsis(q, k, v, g):
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + torch.einsum("...k,...v->...kv", k[:, t], v[:, t])
        outs.append(torch.einsum("...k,...kv", q[:, t], S))  # an implicit output: "...v"
    return torch.stack(outs, 1), S


def addcmul_in_place(q, k, v, g):
    """`S.addcmul_(k, v)` as a statement on the product just computed (NOTE [reads after an in-place
    statement])."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        S.addcmul_(k[:, t][..., None], v[:, t][..., None, :])
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def in_place_sums_final_state_unreturned(q, k, v, g):
    """`S.add_(k v)` and `S.addcmul_(k, v)` as statements, the final state not returned: the last step's
    state is read once, by its readout, and is still the loop's last step."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        if t % 2:
            S.add_(k[:, t][..., None] * v[:, t][..., None, :])
        else:
            S.addcmul_(k[:, t][..., None], v[:, t][..., None, :])
        outs.append(_readout(q[:, t], S))
    return (torch.stack(outs, 1),)


def decay_expanded_as_the_state(q, k, v, g):
    """The decay broadcast to the state's shape first: `a.expand_as(S)` at odd steps, `a.expand(B, H, K, V)` at
    even ones (S lends expand_as its shape, not its values)."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        a = g[:, t].exp()[..., None]
        a = a.expand_as(S) if t % 2 else a.expand(B, H, K, V)
        S = a * S + k[:, t][..., None] * v[:, t][..., None, :]
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def clone_then_update_in_place(q, k, v, g):
    """`S = S.clone(); S.mul_(a).add_(k v)` (autograd-safe in-place statements, their result unused): the
    chain of statements on the clone is the update; the final state not returned."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S.clone()
        S.mul_(g[:, t].exp()[..., None]).add_(k[:, t][..., None] * v[:, t][..., None, :])
        outs.append(_readout(q[:, t], S))
    return (torch.stack(outs, 1),)


RECOGNISED = [addcmul, addcmul_method, baddbmm_merged_heads, einsum_ellipsis, addcmul_in_place,
              in_place_sums_final_state_unreturned, decay_expanded_as_the_state, clone_then_update_in_place]


def outputs_and_grads(fn, args):
    out = fn(*args)
    weights = [torch.linspace(-1, 1, o.numel()).view_as(o) for o in out]
    loss = sum((o * w).sum() for o, w in zip(out, weights))
    return [o.detach() for o in out], torch.autograd.grad(loss, args)


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="laplace", options={"target": "cpu", "inner": "eager"})


def relative_error(found, expected) -> float:
    return float((found - expected).norm() / expected.norm())


@pytest.mark.parametrize("fn", RECOGNISED, ids=lambda f: f.__name__)
def test_a_fused_or_ellipsis_update_becomes_one_gla_site_equal_to_eager(fn):
    args = inputs()
    expected_out, expected_grads = outputs_and_grads(fn, args)
    out, grads = outputs_and_grads(compiled(fn), args)
    report = laplace_passes.last_report()
    (row,) = report.recurrences
    assert row.status == "GLA site" and row.steps == T, row
    assert len(report.sites) == 1
    for found, expected in zip([*out, *grads], [*expected_out, *expected_grads]):
        assert relative_error(found, expected) < 1e-4


def einsum_diagonal(q, k, v, g):
    """k (x) v through a diagonal einsum: the algebra does not read repeated letters."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + torch.einsum("bhkk,bhv->bhkv", torch.diag_embed(k[:, t]), v[:, t])
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def baddbmm_round_trip(q, k, v, g):
    """Heads merged into the batch and split again at every step: a reshape the algebra does not read (at
    batch 1 the reshapes only drop and add the batch)."""
    b = q.shape[0]
    S = torch.zeros(b, H, K, V)
    outs = []
    for t in range(T):
        S = torch.baddbmm((S * g[:, t].exp()[..., None]).reshape(b * H, K, V), k[:, t].reshape(b * H, K, 1),
                          v[:, t].reshape(b * H, 1, V)).reshape(b, H, K, V)
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def lerp(q, k, v, g):
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = torch.lerp(S, k[:, t][..., None] * v[:, t][..., None, :], 0.1)
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def where_skip(q, k, v, g):
    """Padding tokens skipped by a select: S_t = where(valid_t, a_t S + k v, S). The row names `where`, not
    the zeros the loop starts from (the reason its first "step" gave)."""
    valid = torch.arange(T) < T - 3
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = torch.where(valid[t], S * g[:, t].exp()[..., None] + k[:, t][..., None] * v[:, t][..., None, :], S)
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def read_before_the_statement(q, k, v, g):
    """Read out between the decay and an in-place sum: q . (a S), not GLA's q . S_t (NOTE [reads after an
    in-place statement]: the readout reads the product before the write)."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        outs.append(_readout(q[:, t], S))
        S.add_(k[:, t][..., None] * v[:, t][..., None, :])
    return torch.stack(outs, 1), S


def last_state_halved_in_place(q, k, v, g):
    """The last state halved in place before its readout: the readout reads what the write leaves, which no
    update says."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        S.add_(k[:, t][..., None] * v[:, t][..., None, :])
        if t == T - 1:
            S.mul_(0.5)
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def last_sum_halved_in_place(q, k, v, g):
    """The same write after the usual `S = S * a + k v`."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t][..., None] * v[:, t][..., None, :]
        if t == T - 1:
            S.mul_(0.5)
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def decay_over_keys_and_values(q, k, v, g):
    """A decay of the state's full shape, [K, V] per head: not GLA's per-key decay."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        a = torch.sigmoid(g[:, t][..., None] + v[:, t][..., None, :])
        S = a * S + k[:, t][..., None] * v[:, t][..., None, :]
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def update_plus_a_number(q, k, v, g):
    """An affine update, S * a + k v + 0.5 (it had no row: the update read as a leaf, its own previous state)."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t][..., None] * v[:, t][..., None, :] + 0.5
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def decay_over_the_values(q, k, v, g):
    """S_t = S_{t-1} diag(b_t) + k v, read out over the keys: the decay is over the dimension the readout keeps
    (the reason had been "the state S_1 is also used by" its readout)."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * v[:, t].sigmoid().unsqueeze(-2) + k[:, t][..., None] * v[:, t][..., None, :]
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


def decay_broadcast_before_its_exp(q, k, v, g):
    """The gate broadcast to the state's shape, then exp: one value per key, read as one per (key, value)."""
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t, ..., None].expand_as(S).exp() + k[:, t][..., None] * v[:, t][..., None, :]
        outs.append(_readout(q[:, t], S))
    return torch.stack(outs, 1), S


NOT_READ = {
    decay_over_keys_and_values: "its decay reads the value dimension (GLA's decay is per key",
    update_plus_a_number: "(S_1: adding a number (0.5): an affine term, not a sum of products)",
    decay_over_the_values: "its decay reads dimension 3 of the state, which its readout keeps (the readout sums "
                           "over dimension 2)",
    decay_broadcast_before_its_exp: "is computed on a value broadcast to the state's shape",
    einsum_diagonal: "which the algebra does not read as a product: einsum with a repeated index (a diagonal)",
    baddbmm_round_trip: "not a sum of products the algebra reads (S_1: a reshape that merges or splits dimensions)",
    lerp: "not a sum of products the algebra reads (S_1: lerp, an op the algebra does not read)",
    read_before_the_statement: "its state S_1 is written in place by add_, which the algebra does not read",
    last_state_halved_in_place: "after its update (what the loop reads out or returns is what that write leaves)",
    last_sum_halved_in_place: "is written in place by mul_ after its update",
}


@pytest.mark.parametrize("fn", list(NOT_READ), ids=lambda f: f.__name__)
def test_an_update_the_algebra_does_not_read_is_a_declined_row_with_its_reason(fn):
    args = inputs()
    with torch.no_grad():
        expected = fn(*args)
        found = compiled(fn)(*args)
    for f, e in zip(found, expected):
        torch.testing.assert_close(f, e, rtol=0, atol=0)
    report = laplace_passes.last_report()
    (row,) = report.recurrences
    assert row.status == "declined" and not report.sites
    assert row.reason.startswith(f"a {T}-step loop carrying a [2, 2, 8, 16] state, but "), row.reason
    assert NOT_READ[fn] in row.reason, row.reason


def test_a_round_trip_through_merged_heads_at_batch_1_is_one_site_and_one_row():
    """The states' [B, H, K, V] views of the [B H, K, V] updates are the loop's, not a second loop: one row
    (a 2-step "loop" of those views had been listed beside the site, declined)."""
    args = tuple(x[:1] for x in inputs())
    expected_out, expected_grads = outputs_and_grads(baddbmm_round_trip, args)
    out, grads = outputs_and_grads(compiled(baddbmm_round_trip), args)
    report = laplace_passes.last_report()
    assert [(r.status, r.steps) for r in report.recurrences] == [("GLA site", T)], report.recurrences
    for found, expected in zip([*out, *grads], [*expected_out, *expected_grads]):
        assert relative_error(found, expected) < 1e-4
