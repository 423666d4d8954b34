"""The reference op itself: `laplace::gla` against autograd of a plain recurrence in float64."""

import pytest
import torch

from laplace_passes import gla
from tests.gla_cases import make_inputs


def plain_recurrence(q, k, v, gk, h0, scale):
    """S_t = diag(exp(gk_t)) S_{t-1} + k_t^T v_t ; o_t = scale q_t S_t, written out."""
    h = h0.clone()
    outputs = []
    for t in range(q.shape[1]):
        h = h * gk[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    return torch.stack(outputs, 1), h


@pytest.mark.parametrize("with_initial_state", [True, False])
def test_reference_op_matches_autograd_of_plain_recurrence(with_initial_state):
    B, T, H, K, V = 2, 37, 2, 6, 5
    q, k, v, gk, h0 = make_inputs(B, T, H, K, V, gate_divisor=0.5)
    h0 = h0 if with_initial_state else torch.zeros(B, H, K, V)
    leaves = [x.double().requires_grad_() for x in (q, k, v, gk, h0)]
    expected_o, expected_h = plain_recurrence(*leaves, K**-0.5)

    inputs = [x.detach().float().requires_grad_() for x in leaves]
    o, h = gla(*inputs[:4], initial_state=inputs[4] if with_initial_state else None, output_final_state=True)
    torch.testing.assert_close(o.double(), expected_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.double(), expected_h, rtol=1e-5, atol=1e-5)

    do, dh = torch.randn_like(expected_o), torch.randn_like(expected_h)
    expected = torch.autograd.grad((expected_o * do).sum() + (expected_h * dh).sum(), leaves)
    n = 5 if with_initial_state else 4
    got = torch.autograd.grad((o * do.float()).sum() + (h * dh.float()).sum(), inputs[:n])
    for name, g, e in zip("q k v gk initial_state".split(), got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


def test_reference_op_defaults_match_fla_layout():
    q, k, v, gk, _ = make_inputs(1, 5, 3, 4, 7)
    o, final = gla(q, k, v, gk)
    assert o.shape == (1, 5, 3, 7) and o.dtype == q.dtype
    assert final is None
    _, final = gla(q.half(), k.half(), v.half(), gk, output_final_state=True)
    assert final.shape == (1, 3, 4, 7) and final.dtype == torch.float32
