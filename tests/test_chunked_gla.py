"""chunked_gla against the token-by-token recurrence, with fla's stress cases.

Criterion: relative RMSE <= 0.005 (fla's own), on the output, the final state
and the gradient of every input, initial_state included.
"""

import itertools

import pytest
import torch

from laplace_passes import chunked_gla, gla
from tests.gla_cases import make_inputs, output_cotangents, relative_rmse

TOLERANCE = 0.005


def forward_backward(fn, q, k, v, gk, h0, **kwargs):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, gk, h0)]
    o, ht = fn(*leaves[:4], initial_state=leaves[4], output_final_state=True, **kwargs)
    do, dht = output_cotangents(*q.shape[:3], q.shape[3], v.shape[3])
    grads = torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), leaves)
    return [o, ht, *grads]


def assert_all_close(actual, expected, label):
    names = ["o", "final_state", "dq", "dk", "dv", "dgk", "dh0"]
    for name, a, e in zip(names, actual, expected):
        assert torch.isfinite(a).all(), f"{label}: {name} has inf/NaN"
        err = relative_rmse(a, e)
        assert err <= TOLERANCE, f"{label}: {name} relative RMSE {err:.2e} > {TOLERANCE}"


STRESS = list(itertools.product([63, 1024, 2048], [60, 64, 128], [0.1, 1.0, 10.0]))


@pytest.mark.parametrize("T,D,gate_divisor", STRESS)
def test_chunked_matches_recurrence_fp32(T, D, gate_divisor):
    # V differs from K so a transposed state cannot pass.
    inputs = make_inputs(1, T, 2, D, D + 4, gate_divisor=gate_divisor)
    expected = forward_backward(gla, *inputs)
    actual = forward_backward(chunked_gla, *inputs, chunk_size=128)
    assert_all_close(actual, expected, f"T={T} D={D} n={gate_divisor}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate_divisor", [0.1, 1.0])
def test_chunked_matches_recurrence_low_precision(dtype, gate_divisor):
    inputs = make_inputs(2, 300, 2, 64, 32, gate_divisor=gate_divisor, dtype=dtype)
    expected = forward_backward(gla, *inputs)
    actual = forward_backward(chunked_gla, *inputs, chunk_size=128)
    assert actual[0].dtype == dtype and actual[1].dtype == torch.float32
    assert_all_close(actual, expected, f"{dtype} n={gate_divisor}")


@pytest.mark.parametrize("chunk_size,sub_chunk_size", [(1, 16), (7, 3), (100, 16), (128, 128), (64, 32)])
def test_any_chunk_and_sub_chunk_size(chunk_size, sub_chunk_size):
    inputs = make_inputs(1, 150, 1, 8, 12, gate_divisor=0.5)
    expected = forward_backward(gla, *inputs)
    actual = forward_backward(chunked_gla, *inputs, chunk_size=chunk_size, sub_chunk_size=sub_chunk_size)
    assert_all_close(actual, expected, f"C={chunk_size} Cs={sub_chunk_size}")


def test_one_anchor_per_chunk_would_overflow_here():
    """The strong-gate case really passes fp32's range inside one 128-token chunk.

    It shows the stress case tests what it claims: with a single anchor per
    chunk, exp(a - G) reaches exp(>88) = inf. The sub-chunk anchors keep it
    finite (checked by the fp32 stress tests above).
    """
    _, _, _, gk, _ = make_inputs(1, 128, 2, 64, 64, gate_divisor=0.1)
    G = gk.cumsum(1)
    assert (G[:, 0] - G[:, -1]).max() > 88
    assert not torch.isfinite(torch.exp(G[:, 0:1] - G)).all()


def test_matches_fla_naive_recurrent_gla():
    """An independent oracle: flash-linear-attention's own reference."""
    naive = pytest.importorskip("fla.ops.gla.naive").naive_recurrent_gla
    q, k, v, gk, h0 = make_inputs(2, 200, 2, 32, 48, gate_divisor=0.1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, gk, h0)]
    o_fla, h_fla = naive(*leaves[:4], initial_state=leaves[4], output_final_state=True)
    do, dh = output_cotangents(2, 200, 2, 32, 48)
    expected = [o_fla, h_fla, *torch.autograd.grad((o_fla * do).sum() + (h_fla * dh).sum(), leaves)]
    actual = forward_backward(chunked_gla, q, k, v, gk, h0, chunk_size=64)
    assert_all_close(actual, expected, "vs fla naive_recurrent_gla")


def test_without_initial_state_and_final_state():
    q, k, v, gk, _ = make_inputs(1, 70, 2, 8, 8, initial_state=False)
    o, final = chunked_gla(q, k, v, gk, chunk_size=32)
    assert final is None
    expected, _ = gla(q, k, v, gk)
    assert relative_rmse(o, expected) < 1e-5


def test_explicit_scale_is_used():
    q, k, v, gk, _ = make_inputs(1, 40, 1, 8, 8, initial_state=False)
    o, _ = chunked_gla(q, k, v, gk, chunk_size=16, scale=0.5)
    expected, _ = gla(q, k, v, gk, scale=0.5)
    default, _ = gla(q, k, v, gk)
    assert relative_rmse(o, expected) < 1e-5
    assert relative_rmse(o, default) > 0.1
