"""A step's position read by a slice of one token, `x[:, t:t + 1]` or `x.narrow(1, t, 1)`, which keeps the
token's dimension (of size 1), as well as by an index, `x[:, t]` or `x.select(1, t)`.

Such a read is the step's input at position t (`laplace_passes.fx.per_step.step_index`), and built for all
steps at once as the tensor with its tokens first and a dimension of size 1 where the step's value keeps
it, after any Nones and Ellipsis before it. Before, every step read so was "not computed like step 0's" and
the loop was declined. Each loop is checked against itself run eagerly: outputs, final state and the
gradients of r, k, v and the gates, with a mask of padding given as int64 where a select reads one.
"""

import pytest
import torch

import laplace_passes
from tests.test_condition_sources import ATTENTION_MASK, _read, _update, assert_as_eager
from tests.test_readouts_before_update import B, H, K, T, V


def skip_read_by_a_slice(r, k, v, w, u, mask):
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = torch.where(mask[:, t:t + 1, None, None].bool(), _update(S, k, v, w, t), S)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def skip_read_by_narrow(r, k, v, w, u, mask):
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = torch.where(mask.narrow(1, t, 1)[:, :, None, None].bool(), _update(S, k, v, w, t), S)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def skip_read_after_a_none(r, k, v, w, u, mask):
    """A None before the slice: the token's dimension kept after it."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        kept = mask[None, :, t:t + 1]  # [1, B, 1]
        S = torch.where(kept[0, :, :, None, None].bool(), _update(S, k, v, w, t), S)
        outs.append(_read(r, S, t))
    return torch.stack(outs, 2), S


def everything_read_by_slices(r, k, v, w, u, mask):
    """q, k, v and the gates as [B, H, 1, d] slices (one with an Ellipsis), the readout a matmul."""
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * w[:, :, t:t + 1].exp().transpose(-1, -2) + k[:, :, t:t + 1].transpose(-1, -2) * v[..., t:t + 1, :]
        outs.append(r[:, :, t:t + 1] @ S)
    return torch.cat(outs, 2), S


def everything_read_by_narrow(r, k, v, w, u, mask):
    S = r.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * w.narrow(2, t, 1).exp().transpose(-1, -2) + k.narrow(2, t, 1).transpose(-1, -2) * \
            torch.narrow(v, 2, t, 1)
        outs.append(r.narrow(2, t, 1) @ S)
    return torch.cat(outs, 2), S


FORMS = {
    skip_read_by_a_slice: "steps skipped by a select",
    skip_read_by_narrow: "steps skipped by a select",
    skip_read_after_a_none: "steps skipped by a select",
    everything_read_by_slices: "per-key gates, state",
    everything_read_by_narrow: "per-key gates, state",
}


@pytest.mark.parametrize("fn", list(FORMS), ids=lambda f: f.__name__)
def test_a_loop_reading_its_steps_by_slices_of_one_token_is_one_site_equal_to_eager(fn):
    assert_as_eager(fn, ATTENTION_MASK)
    (row,) = laplace_passes.last_report().recurrences
    assert row.status == "GLA site" and FORMS[fn] in row.form and f"{T} steps" in row.form, row
