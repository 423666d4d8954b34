"""Bad input gets a clear error naming the argument, from every entry point."""

import pytest
import torch

import laplace_passes
from laplace_passes import chunked_gla, gla
from tests.gla_cases import make_inputs

ENTRY_POINTS = [gla, lambda *a, **kw: chunked_gla(*a, chunk_size=16, **kw)]


@pytest.fixture
def good():
    q, k, v, gk, _ = make_inputs(1, 20, 2, 8, 6, initial_state=False)
    return q, k, v, gk


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_mismatched_key_shape(fn, good):
    q, k, v, gk = good
    with pytest.raises(ValueError, match=r"k must have the shape of q"):
        fn(q, k[:, :10], v, gk)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_mismatched_value_shape(fn, good):
    q, k, v, gk = good
    with pytest.raises(ValueError, match=r"v must have shape \[B,T,H,V\]"):
        fn(q, k, v[:, :, :1], gk)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_wrong_rank(fn, good):
    q, k, v, gk = good
    with pytest.raises(ValueError, match=r"gk must have 4 dimensions"):
        fn(q, k, v, gk[0])


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_initial_state_shape(fn, good):
    q, k, v, gk = good
    with pytest.raises(ValueError, match=r"initial_state must have shape \[B,H,K,V\] = \[1, 2, 8, 6\]"):
        fn(q, k, v, gk, initial_state=torch.zeros(1, 2, 6, 8))


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_integer_dtype(fn, good):
    q, k, v, gk = good
    with pytest.raises(TypeError, match=r"q must have dtype in"):
        fn(q.long(), k, v, gk)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_mixed_dtypes(fn, good):
    q, k, v, gk = good
    with pytest.raises(TypeError, match=r"q, k and v must share one dtype"):
        fn(q, k.half(), v, gk)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_non_tensor(fn, good):
    q, k, v, gk = good
    with pytest.raises(TypeError, match=r"v must be a torch.Tensor, got list"):
        fn(q, k, [1.0], gk)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_positive_gates_are_refused(fn, good):
    q, k, v, gk = good
    with pytest.raises(ValueError, match=r"gk must be <= 0 everywhere"):
        fn(q, k, v, gk.abs() + 0.1)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_nan_gates_are_refused(fn, good):
    q, k, v, gk = good
    gk = gk.clone()
    gk[0, 3, 1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"gk must be <= 0 everywhere .* found NaN \(use F.logsigmoid"):
        fn(q, k, v, gk)


@pytest.mark.parametrize("chunk_size", [0, -128])
def test_non_positive_chunk_size(chunk_size, good):
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, got " + str(chunk_size)):
        chunked_gla(*good, chunk_size=chunk_size)


def test_non_integer_chunk_size(good):
    with pytest.raises(TypeError, match=r"chunk_size must be a positive int, got float"):
        chunked_gla(*good, chunk_size=128.0)


def test_positive_gates_are_refused_inside_compiled_graphs(good):
    q, k, v, gk = good

    def f(q, k, v, gk):
        return gla(q, k, v, gk)[0]

    compiled = laplace_passes.compile(f, target="cpu")
    compiled(q, k, v, gk)  # compiles and runs with valid gates
    with pytest.raises(ValueError, match=r"gk must be <= 0 everywhere"):
        compiled(q, k, v, gk.abs() + 0.1)


def zero_key_inputs():
    q, k, v, gk, _ = make_inputs(1, 20, 2, 8, 6, initial_state=False)
    return q[..., :0], k[..., :0], v.requires_grad_(), gk[..., :0]


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_zero_key_channels_give_the_empty_sum(fn):
    """K = 0: every score is an empty sum, as the reference computes it with an explicit scale."""
    q, k, v, gk = zero_key_inputs()
    o, state = fn(q, k, v, gk, output_final_state=True)
    reference, _ = gla(q, k, v, gk, scale=1.0)
    assert o.shape == v.shape and state.shape == (1, 2, 0, 6)
    assert torch.equal(o, reference) and torch.equal(o, torch.zeros_like(v))
    (grad_v,) = torch.autograd.grad(o.sum(), v)
    assert torch.equal(grad_v, torch.zeros_like(v))


def test_zero_key_channels_through_an_fla_call():
    from laplace_passes.fla.gla_calls import gla_site

    q, k, v, gk = zero_key_inputs()
    o, _ = gla_site(q, k, v, gk, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
                    cu_seqlens=None, origin="fla.chunk_gla")
    assert torch.equal(o, torch.zeros_like(v))


@pytest.mark.parametrize("fn,name", [(ENTRY_POINTS[0], "laplace_passes.gla"), (ENTRY_POINTS[1], "laplace_passes.chunked_gla")])
def test_double_backward_is_refused_by_name(fn, name, good):
    q, k, v, gk = good
    q = q.clone().requires_grad_()
    o, _ = fn(q, k, v, gk)
    (grad_q,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)  # a first backward works
    with pytest.raises(NotImplementedError, match=rf"double backward .* through {name} is not supported"):
        grad_q.sum().backward()


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_flag_scale_and_state_device_are_checked(fn, good):
    q, k, v, gk = good
    with pytest.raises(TypeError, match="output_final_state must be a bool, got str"):
        fn(q, k, v, gk, output_final_state="no")
    with pytest.raises(TypeError, match="scale must be a number or None, got bool"):
        fn(q, k, v, gk, scale=True)
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        fn(q, k, v, gk, scale=float("nan"))
    with pytest.raises(ValueError, match="initial_state must be on q's device cpu, got meta"):
        fn(q, k, v, gk, initial_state=torch.zeros(1, 2, 8, 6, device="meta"))


@pytest.mark.parametrize("field, value, message", [
    ("partitions", 0, "HardwareTarget.partitions must be a positive int, got 0"),
    ("sub_chunk_size", 0, "HardwareTarget.sub_chunk_size must be a positive int, got 0"),
    ("sub_chunk_size", -2, "HardwareTarget.sub_chunk_size must be a positive int, got -2"),
    ("sub_chunk_size", 4.0, "HardwareTarget.sub_chunk_size must be a positive int, got 4.0"),
    ("recurrent_max_tokens", -1, "HardwareTarget.recurrent_max_tokens must be an int >= 0, got -1"),
    ("recurrent_readout", "dot", "HardwareTarget.recurrent_readout must be one of ('matmul', 'reduce'), got 'dot'"),
    ("chunk_recurrence", "scan", "HardwareTarget.chunk_recurrence must be one of ('unrolled', 'op'), got 'scan'"),
    ("matmul_tile", (0, 512), "HardwareTarget.matmul_tile must be two positive ints (partition rows, free columns), "
                              "got (0, 512)"),
])
def test_a_target_with_an_impossible_number_is_refused_where_it_is_made(field, value, message):
    """Left to the passes, sub_chunk_size=0 would be a ZeroDivisionError and -2 a negative tensor size, each
    wrapped in Dynamo's error."""
    with pytest.raises(ValueError) as raised:
        laplace_passes.targets.CPU.with_overrides(**{field: value})
    assert str(raised.value) == message
