"""chunked_gla against the token-by-token recurrence, with fla's stress cases.

Criterion: relative RMSE <= 0.005 (fla's own), on the output, the final state
and the gradient of every input, initial_state included. Three backward paths
are checked on the same inputs:
  * "explicit": `chunked_gla`, whose backward is the reverse recurrence over
    chunks (`laplace::chunked_gla_backward`), given the forward's residuals;
  * "explicit-recomputing": the same with `save_residuals=False`, recomputing them;
  * "autograd": autograd through the forward's standard ops
    (`chunked_forward`), an independent derivation of the same gradients.
"""

import functools
import itertools

import math

import pytest
import torch

import laplace_passes
from laplace_passes import chunked_gla, gla
from laplace_passes.ops.chunked import chunked_gla_saved_bytes
from laplace_passes.ops.chunked_forward import FLUSH_BELOW, chunked_forward
from tests.gla_cases import make_inputs, output_cotangents, relative_rmse

TOLERANCE = 0.005


def autograd_chunked_gla(q, k, v, gk, *, chunk_size=128, sub_chunk_size=16, scale=None,
                         initial_state=None, output_final_state=False):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, state, _, _ = chunked_forward(q, k, v, gk, initial_state, scale, chunk_size, sub_chunk_size)
    return o, (state if output_final_state else None)


BACKWARDS = {
    "explicit": chunked_gla,  # the residuals saved
    "explicit-recomputing": functools.partial(chunked_gla, save_residuals=False),
    "autograd": autograd_chunked_gla,
}


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


@functools.lru_cache(maxsize=1)  # the cases run path after path: one reference per case
def recurrence_reference(T, D, gate_divisor):
    inputs = make_inputs(1, T, 2, D, D + 4, gate_divisor=gate_divisor)
    return inputs, forward_backward(gla, *inputs)


@pytest.mark.parametrize("T,D,gate_divisor,backward", [(*case, b) for case in STRESS for b in BACKWARDS])
def test_chunked_matches_recurrence_fp32(T, D, gate_divisor, backward):
    # V differs from K so a transposed state cannot pass.
    inputs, expected = recurrence_reference(T, D, gate_divisor)
    actual = forward_backward(BACKWARDS[backward], *inputs, chunk_size=128)
    assert_all_close(actual, expected, f"{backward} T={T} D={D} n={gate_divisor}")


def plain_recurrence(q, k, v, gk, h0, scale):
    """S_t = diag(exp(gk_t)) S_{t-1} + k_t^T v_t ; o_t = scale q_t S_t, written out (differentiable)."""
    h = h0
    outputs = []
    for t in range(q.shape[1]):
        h = h * gk[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    return torch.stack(outputs, 1), h


@pytest.mark.parametrize("initial_state", [True, False])
@pytest.mark.parametrize("final_state_grad", [True, False])
def test_explicit_backward_matches_autograd_of_the_recurrence(initial_state, final_state_grad):
    """Every gradient, against autograd of the written-out recurrence in float64.

    Several chunks, padded T, chunks halved down to 4-row leaves, strong gates; with and without an
    initial state and a gradient reaching the final state.
    """
    B, T, H, K, V = 2, 45, 2, 6, 5
    q, k, v, gk, h0 = make_inputs(B, T, H, K, V, gate_divisor=0.3, initial_state=initial_state)
    h0 = h0 if initial_state else torch.zeros(B, H, K, V)
    leaves = [x.double().requires_grad_() for x in (q, k, v, gk, h0)]
    expected_o, expected_h = plain_recurrence(*leaves, K**-0.5)
    do, dh = output_cotangents(B, T, H, K, V)
    dh = dh if final_state_grad else torch.zeros_like(dh)
    expected = torch.autograd.grad((expected_o * do).sum() + (expected_h * dh).sum(), leaves)

    inputs = [x.detach().float().requires_grad_() for x in leaves]
    o, h = chunked_gla(*inputs[:4], initial_state=inputs[4] if initial_state else None,
                       output_final_state=True, chunk_size=16, sub_chunk_size=4)
    torch.testing.assert_close(o.double(), expected_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.double(), expected_h, rtol=1e-5, atol=1e-5)
    loss = (o * do).sum() + ((h * dh).sum() if final_state_grad else 0)
    n = 5 if initial_state else 4
    got = torch.autograd.grad(loss, inputs[:n])
    for name, g, e in zip("q k v gk initial_state".split(), got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


@pytest.mark.parametrize("reset", [-math.inf, -1e7, -31.0])
def test_reset_gates_match_the_recurrence(reset):
    """A gate of -inf (log 0, fp16 overflow) or far below the flush threshold: a hard reset of those channels."""
    B, T, H, K, V = 1, 40, 2, 6, 5
    q, k, v, gk, h0 = make_inputs(B, T, H, K, V, gate_divisor=10.0)
    gk[:, [3, 17, 18], :, ::2] = reset  # in the first chunk and across a chunk boundary, half the channels
    leaves = [x.double().requires_grad_() for x in (q, k, v, gk, h0)]
    expected_o, expected_h = plain_recurrence(*leaves, K**-0.5)
    do, dh = output_cotangents(B, T, H, K, V)
    expected = torch.autograd.grad((expected_o * do).sum() + (expected_h * dh).sum(), leaves)

    inputs = [x.detach().float().requires_grad_() for x in leaves]
    o, h = chunked_gla(*inputs[:4], initial_state=inputs[4], output_final_state=True, chunk_size=16, sub_chunk_size=4)
    torch.testing.assert_close(o.double(), expected_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.double(), expected_h, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad((o * do).sum() + (h * dh).sum(), inputs)
    for name, g, e in zip("q k v gk initial_state".split(), got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-4, msg=f"gradient of {name}")


@pytest.mark.parametrize("backward", BACKWARDS)
def test_a_gate_at_the_flush_threshold_gets_the_gradients_of_one_just_below_it(backward):
    """NOTE [flushing tiny decays]: a gate of exactly -FLUSH_BELOW is flushed as one just below it is.

    The two runs agree bit for bit, outputs and every gradient (a flushed gate's own gradient is 0 in
    both), and both equal autograd of the recurrence, where a decay of exp(-30) ~ 1e-13 leaves nothing
    fp32 can show.
    """
    B, T, H, K, V = 1, 40, 2, 6, 5
    q, k, v, gk, h0 = make_inputs(B, T, H, K, V, gate_divisor=1.0)
    threshold = torch.tensor(-FLUSH_BELOW)
    results = {}
    for name, gate in (("at", threshold), ("just below", torch.nextafter(threshold, torch.tensor(-math.inf)))):
        gates = gk.clone()
        gates[:, [3, 17, 18], :, ::2] = gate  # in the first chunk and across a chunk boundary, half the channels
        results[name] = (gates, forward_backward(BACKWARDS[backward], q, k, v, gates, h0, chunk_size=16,
                                                 sub_chunk_size=4))
    (gates, at), (_, below) = results["at"], results["just below"]
    names = ["o", "final_state", "dq", "dk", "dv", "dgk", "dh0"]
    for name, a, b in zip(names, at, below):
        assert torch.equal(a, b), f"{name} differs between a gate at the flush threshold and one just below it"

    leaves = [x.double().requires_grad_() for x in (q, k, v, gates, h0)]
    expected_o, expected_h = plain_recurrence(*leaves, K**-0.5)
    do, dh = output_cotangents(B, T, H, K, V)
    expected = [expected_o, expected_h,
                *torch.autograd.grad((expected_o * do).sum() + (expected_h * dh).sum(), leaves)]
    for name, a, e in zip(names, at, expected):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-4, msg=name)


EMPTY = {"B=0": (0, 20, 2), "H=0": (2, 20, 0), "T=0": (2, 0, 2), "B=0, T=0": (0, 0, 2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("empty", EMPTY)
def test_an_empty_batch_heads_or_sequence_gives_the_references_result(empty, backward, dtype):
    """What the reference gives: empty outputs and gradients of the inputs' shapes and dtypes (T = 0: the
    initial state as the final state, the final state's gradient as the initial state's)."""
    B, T, H = EMPTY[empty]
    inputs = make_inputs(B, T, H, 6, 5, dtype=dtype)
    expected = forward_backward(gla, *inputs)
    actual = forward_backward(BACKWARDS[backward], *inputs, chunk_size=16, sub_chunk_size=4)
    for name, a, e in zip(["o", "final_state", "dq", "dk", "dv", "dgk", "dh0"], actual, expected):
        assert (a.shape, a.dtype) == (e.shape, e.dtype), name
        assert torch.equal(a, e), name


class ProjectedSite(torch.nn.Module):
    """A model with one GLA site, its queries projected: a weight's gradient comes back too."""

    def __init__(self, K):
        super().__init__()
        self.proj = torch.nn.Linear(K, K)

    def forward(self, q, k, v, gk, h0):
        return gla(self.proj(q), k, v, gk, initial_state=h0, output_final_state=True)


def model_outputs_and_gradients(model, inputs, grad):
    """(o, final state), and with `grad` the gradients of every input and of the projection's weight."""
    leaves = [x.detach().clone().requires_grad_(grad) for x in inputs]
    with torch.set_grad_enabled(grad):
        o, state = model(*leaves)
    if not grad:
        return [o, state]
    do, dh = output_cotangents(*o.shape[:3], inputs[0].shape[-1], o.shape[-1])
    grads = torch.autograd.grad((o * do).sum() + (state * dh).sum(), [*leaves, model.proj.weight])
    return [o, state, *grads]


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("T", [5, 70])  # the cpu target: without gradient, the recurrent form, then chunked
@pytest.mark.parametrize("empty", ["B=0", "H=0"])
def test_a_compiled_site_with_an_empty_batch_or_heads_gives_the_eager_result(empty, T, grad):
    B, _, H = EMPTY[empty]
    torch.manual_seed(0)
    model = ProjectedSite(6)
    compiled = torch.compile(model, backend="laplace", dynamic=False, options={"target": "cpu"})
    inputs = make_inputs(B, T, H, 6, 5)
    expected = model_outputs_and_gradients(model, inputs, grad)
    actual = model_outputs_and_gradients(compiled, inputs, grad)
    (site,) = laplace_passes.last_report().sites
    assert site.status == "retiled" and site.form.startswith("recurrent" if T == 5 and not grad else "chunked")
    for a, e in zip(actual, expected):
        assert (a.shape, a.dtype) == (e.shape, e.dtype) and torch.equal(a, e)


@pytest.mark.parametrize("save_residuals", [False, True])
def test_backward_keeps_the_inputs_and_at_most_the_two_residuals(save_residuals):
    """Saved for backward: q, k, v, gk, the initial state and, with save_residuals, the chunk states and tril(A).

    Nothing of size T x Cs x K either way (autograd through the forward keeps the halving's decays).
    """
    B, T, H, K, V, C = 1, 512, 2, 32, 48, 128
    q, k, v, gk, h0 = (x.requires_grad_() for x in make_inputs(B, T, H, K, V))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, _ = chunked_gla(q, k, v, gk, initial_state=h0, chunk_size=C, save_residuals=save_residuals)
    # check_gates hands the op a copy of gk: it is the only tensor saved besides the inputs and residuals.
    inputs = (q, k, v, gk, h0)
    assert [t.shape for t in saved[:5]] == [x.shape for x in inputs]
    residuals = [(B, H, T // C, K, V), (B, H, T // C, C, C)] if save_residuals else []
    assert [tuple(t.shape) for t in saved[5:]] == residuals
    kept = sum(t.numel() * t.element_size() for t in saved)
    assert kept == chunked_gla_saved_bytes(*inputs, saved[5:] if save_residuals else None)


def test_a_backward_with_or_without_the_residuals_gives_the_same_gradients():
    """The residuals are the forward's own values: the gradients match the recomputing backward bit for bit."""
    q, k, v, gk, h0 = make_inputs(2, 200, 2, 16, 8, gate_divisor=0.5)
    do = torch.randn(2, 200, 2, 8, generator=torch.Generator().manual_seed(3))
    grads = []
    for save in (False, True):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, gk, h0)]
        o, _ = chunked_gla(*leaves[:4], initial_state=leaves[4], chunk_size=64, save_residuals=save)
        grads.append(torch.autograd.grad(o, leaves, do))
    for recomputed, kept in zip(*grads):
        assert torch.equal(recomputed, kept)


def test_gradient_when_only_the_output_is_used():
    q, k, v, gk, _ = make_inputs(1, 200, 2, 16, 8, gate_divisor=0.5, initial_state=False)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, gk)]
    expected = torch.autograd.grad(gla(*leaves)[0].square().sum(), leaves)
    got = torch.autograd.grad(chunked_gla(*leaves, chunk_size=64)[0].square().sum(), leaves)
    for g, e in zip(got, expected):
        assert relative_rmse(g, e) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate_divisor", [0.1, 1.0])
def test_chunked_matches_recurrence_low_precision(dtype, gate_divisor):
    inputs = make_inputs(2, 300, 2, 64, 32, gate_divisor=gate_divisor, dtype=dtype)
    expected = forward_backward(gla, *inputs)
    actual = forward_backward(chunked_gla, *inputs, chunk_size=128)
    assert actual[0].dtype == dtype and actual[1].dtype == torch.float32
    assert all(g.dtype == dtype for g in actual[2:6])
    assert_all_close(actual, expected, f"{dtype} n={gate_divisor}")


@pytest.mark.parametrize("chunk_size,sub_chunk_size", [(1, 16), (7, 3), (100, 16), (128, 128), (64, 32)])
def test_any_chunk_and_sub_chunk_size(chunk_size, sub_chunk_size):
    inputs = make_inputs(1, 150, 1, 8, 12, gate_divisor=0.5)
    expected = forward_backward(gla, *inputs)
    actual = forward_backward(chunked_gla, *inputs, chunk_size=chunk_size, sub_chunk_size=sub_chunk_size)
    assert_all_close(actual, expected, f"C={chunk_size} Cs={sub_chunk_size}")


@pytest.mark.parametrize("sub_chunk_size", [4, 8, 16, 128])
def test_strong_gates_that_overflow_one_anchor_per_chunk_stay_exact(sub_chunk_size):
    """The strong-gate case passes fp32's range inside one 128-token chunk, and chunked_gla stays exact there.

    First the data: with a single exponential anchor per chunk, exp(a - G)
    reaches exp(>88) = inf. Then chunked_gla on exactly these data, halving
    down to 4-row leaves (eager's), 8-row (the cpu target's), 16-row leaves (trn2's) and not at
    all (one 128-row leaf): output, state and gradients match the recurrence.
    """
    inputs = make_inputs(1, 128, 2, 64, 64, gate_divisor=0.1)
    G = inputs[3].cumsum(1)
    assert (G[:, 0] - G[:, -1]).max() > 88
    assert not torch.isfinite(torch.exp(G[:, 0:1] - G)).all()
    actual = forward_backward(chunked_gla, *inputs, chunk_size=128, sub_chunk_size=sub_chunk_size)
    assert_all_close(actual, forward_backward(gla, *inputs), f"one chunk, leaves of {sub_chunk_size}")


def test_intra_chunk_scores_are_halved_without_a_copy_of_the_keys_per_block():
    """The traced forward and backward (C = 128, 4-row leaves, K = 256): one [h, K] @ [K, h] matmul per halving level,
    and no intermediate larger than max(C x C, C x K) per chunk and head.

    Anchoring each query sub-chunk on its own would need a copy of the keys
    per sub-chunk (C / Cs x C x K); computing the leaves as [Cs, Cs, K]
    blocks rather than diagonal by diagonal, Cs x C x K: both over the bound.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    from laplace_passes.ops.chunked_backward import chunked_backward

    B, T, H, K, V, C, leaf = 1, 256, 1, 256, 8, 128, 4
    q, k, v, gk, _ = make_inputs(B, T, H, K, V, initial_state=False)
    forward = make_fx(lambda q, k, v, gk: chunked_forward(q, k, v, gk, None, 0.5, C, leaf))(q, k, v, gk)
    backward = make_fx(lambda q, k, v, gk, do: chunked_backward(q, k, v, gk, None, do, None, None, None, 0.5, C, leaf))(
        q, k, v, gk, torch.randn(B, T, H, V))
    bound = B * H * (T // C) * max(C * C, C * K)
    for name, gm in (("forward", forward), ("backward", backward)):
        values = [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        assert max(v.numel() for v in values) <= bound, name
        squares = {n.meta["val"].shape[-1] for n in gm.graph.nodes if n.target == torch.ops.aten.bmm.default
                   and n.meta["val"].shape[-1] == n.meta["val"].shape[-2] < C}
        assert squares == {64, 32, 16, 8, 4}, (name, squares)  # halves of 128 down to the leaves


@pytest.mark.parametrize("sub_chunk_size", [4, 16])
def test_decays_after_a_long_strong_decay_keep_fp32_precision(sub_chunk_size):
    """Half a chunk of gates -15 (G reaches -960), then gates -0.001: output and gradients within 2e-6 (relative RMSE) of fp64.

    A decay taken as exp(G_q - G_k) would inherit G's rounding at -960
    (6e-5 per ulp): about 2.4e-5 relative error here. Products of token
    decays do not carry G at all (NOTE [decays as products]).
    """
    from laplace_passes.ops.chunked_backward import chunked_backward

    B, T, H, K, V, scale = 1, 128, 2, 16, 16, 0.25
    q, k, v, _, _ = make_inputs(B, T, H, K, V, initial_state=False)
    gk = torch.full((B, T, H, K), -0.001)
    gk[:, : T // 2] = -15.0
    fp64 = [x.double().requires_grad_() for x in (q, k, v, gk)]
    expected_o, _ = plain_recurrence(*fp64, torch.zeros(B, H, K, V, dtype=torch.float64), scale)
    grad_o = torch.randn(expected_o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected_grads = torch.autograd.grad(expected_o, fp64, grad_o)

    o = chunked_forward(q, k, v, gk, None, scale, 128, sub_chunk_size)[0]
    grads = chunked_backward(q, k, v, gk, None, grad_o.float(), None, None, None, scale, 128, sub_chunk_size)[:4]
    for name, actual, expected in zip(("o", "dq", "dk", "dv", "dgk"), (o, *grads), (expected_o, *expected_grads)):
        assert relative_rmse(actual, expected) < 2e-6, (name, relative_rmse(actual, expected))


def test_strong_gates_leave_the_gate_gradient_within_fp32_rounding_of_fp64():
    """Gates logsigmoid(x - 2) at chunks of 16: dgk within 8e-7 (relative RMSE) of fp64, and the sum of every
    token's dgk (what a per-head decay parameter's gradient adds up) within 4e-6.

    With the diagonal of tril(A) inside dG, where it cancels only in rounding, these were 1.9e-6 and 2.1e-5
    (NOTE [the diagonal apart] in laplace_passes/ops/chunked_backward.py); the recurrence itself, 3e-8 and 4e-7.
    """
    B, T, H, K, V = 1, 64, 2, 16, 8
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    gk = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, generator=gen) - 2)
    weights = torch.linspace(-1, 1, B * T * H * V).view(B, T, H, V)

    def gate_gradient(fn, dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v, gk)]
        return torch.autograd.grad((fn(*leaves)[0] * weights.to(dtype)).sum(), leaves[3])[0]

    expected = gate_gradient(lambda *x: plain_recurrence(*x, torch.zeros(B, H, K, V, dtype=x[0].dtype), K**-0.5),
                             torch.float64)
    actual = gate_gradient(lambda *x: chunked_gla(*x, chunk_size=16), torch.float32)
    assert relative_rmse(actual, expected) < 8e-7, relative_rmse(actual, expected)
    assert abs(actual.double().sum() / expected.sum() - 1) < 4e-6, (actual.double().sum(), expected.sum())


def test_one_exp_per_token_and_channel_builds_every_decay():
    """The traced forward and backward each take exp once, of gk itself: every decay is a product of those."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from laplace_passes.ops.chunked_backward import chunked_backward

    B, T, H, K, V, C = 1, 256, 2, 8, 4, 64
    q, k, v, gk, _ = make_inputs(B, T, H, K, V, initial_state=False)
    forward = make_fx(lambda q, k, v, gk: chunked_forward(q, k, v, gk, None, 0.5, C, 4))(q, k, v, gk)
    backward = make_fx(lambda q, k, v, gk, do: chunked_backward(q, k, v, gk, None, do, None, None, None, 0.5, C, 4))(
        q, k, v, gk, torch.randn(B, T, H, V))
    for name, gm in (("forward", forward), ("backward", backward)):
        exps = [n for n in gm.graph.nodes if n.target == torch.ops.aten.exp.default]
        assert len(exps) == 1 and exps[0].meta["val"].numel() == B * H * T * K, (name, len(exps))
        # No running sum at all (Inductor's C++ backend runs a scan as an eager kernel): not of the gates,
        # not to mark non-finite values, not to sum dG back into dgk.
        cumsums = [n for n in gm.graph.nodes if n.target == torch.ops.aten.cumsum.default]
        assert cumsums == [], (name, cumsums)


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


@pytest.mark.parametrize("where", ["v", "k"])
def test_a_non_finite_token_never_reaches_earlier_outputs(where):
    """An inf in v (or k) at token 3 leaves outputs 0-2 as the recurrence has them: finite, unchanged.

    Later outputs are non-finite in the same channels as the recurrence's
    (v: only the channel holding the inf). Chunks of 16 rows, 4-row leaves:
    token 3 sits in the first leaf, token 20 in the second chunk.
    """
    q, k, v, gk, h0 = make_inputs(1, 40, 2, 6, 5, gate_divisor=1.0)
    for token in (3, 20):
        (v if where == "v" else k)[0, token, 1, 2] = math.inf
    expected, _ = gla(q, k, v, gk, initial_state=h0)
    got, _ = chunked_gla(q, k, v, gk, initial_state=h0, chunk_size=16, sub_chunk_size=4)
    assert torch.isfinite(expected[:, :3]).all()
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), finite)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_a_non_finite_output_gradient_never_reaches_later_inputs():
    """The backward runs backwards in time: an inf in grad_o at token 3 leaves the gradients of tokens 4.. finite."""
    q, k, v, gk, h0 = make_inputs(1, 40, 2, 6, 5, gate_divisor=1.0)
    do, _ = output_cotangents(1, 40, 2, 6, 5)
    do[0, 3, 1, 2] = math.inf
    grads = {}
    for name, fn in (("recurrence", gla), ("chunked", functools.partial(chunked_gla, chunk_size=16, sub_chunk_size=4))):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, gk)]
        o, _ = fn(*leaves, initial_state=h0)
        grads[name] = torch.autograd.grad(o, leaves, do)
    for label, got, expected in zip("q k v gk".split(), grads["chunked"], grads["recurrence"]):
        assert torch.isfinite(expected[:, 4:]).all()
        torch.testing.assert_close(got[:, 4:], expected[:, 4:], rtol=1e-4, atol=1e-5, msg=f"d{label}")


@pytest.mark.parametrize("rows", [1, 5, 8, 12, 16, 24, 64, 128, 200])
def test_reverse_cumsum_rows_is_the_running_sum_from_each_row_to_the_last(rows):
    """Blocked adds (8-row blocks, recursively; a running sum where rows are not a multiple of 8) against
    flip-cumsum-flip in float64, and a NaN and an inf at row j reach rows <= j of their channel only."""
    from laplace_passes.ops.chunked_backward import reverse_cumsum_rows

    x = torch.randn(2, 3, rows, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(reverse_cumsum_rows(x), x.flip(-2).cumsum(-2).flip(-2), rtol=1e-12, atol=1e-12)
    j = rows // 2
    x[1, 2, j, 0], x[0, 1, j, 3] = math.nan, math.inf
    got = reverse_cumsum_rows(x)
    assert got[1, 2, : j + 1, 0].isnan().all() and got[0, 1, : j + 1, 3].isinf().all()
    others = torch.ones_like(got, dtype=torch.bool)
    others[1, 2, : j + 1, 0] = others[0, 1, : j + 1, 3] = False
    assert got[others].isfinite().all()


def test_non_finite_values_take_the_same_rows_through_inductor_as_eagerly():
    """An inf and a NaN in v and an inf in grad_o: Inductor's code marks exactly the entries eager marks.

    The marks are reductions and `where`s (no running sum, no isfinite),
    which Inductor generates itself; eager runs the same ops through ATen.
    """
    from laplace_passes.infra.targets import CPU

    q, k, v, gk, _ = make_inputs(1, 40, 2, 6, 5, gate_divisor=1.0)
    v[0, 3, 1, 2], v[0, 21, 0, 1] = math.inf, math.nan
    do, _ = output_cotangents(1, 40, 2, 6, 5)
    do[0, 30, 1, 3] = math.inf

    def chunked(q, k, v, gk):
        return chunked_gla(q, k, v, gk, chunk_size=16, sub_chunk_size=4)

    compiled = laplace_passes.compile(chunked, target=CPU, chunk_size=16, inner="inductor")
    results = {}
    for name, fn in (("eager", chunked), ("inductor", compiled)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, gk)]
        o, _ = fn(*leaves)
        results[name] = (o, *torch.autograd.grad(o, leaves, do))
    for label, got, expected in zip("o dq dk dv dgk".split(), results["inductor"], results["eager"]):
        finite = torch.isfinite(expected)
        assert not finite.all() and finite.any(), label  # the case marks some entries and not others
        assert torch.equal(torch.isfinite(got), finite), label
        assert torch.equal(torch.isnan(got), torch.isnan(expected)), label
        torch.testing.assert_close(got[finite], expected[finite], rtol=1e-4, atol=1e-5, msg=label)


@pytest.mark.parametrize("T, C, sub, save", [(0, 16, 4, True), (37, 16, 4, False), (100, 48, 16, True)])
def test_the_chunk_loop_ops_pass_torch_opcheck(T, C, sub, save):
    """Schema, autograd registration, fake shapes (the residuals' N and padded C' included) and AOT at dynamic T."""
    B, H, K, V = 1, 2, 8, 6
    gen = torch.Generator().manual_seed(T)
    q, k = (torch.randn(B, T, H, K, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, requires_grad=True)
    gk = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, generator=gen)).requires_grad_()
    h0 = torch.randn(B, H, K, V, generator=gen, requires_grad=True)
    forward = torch.ops.laplace.chunked_gla.default
    torch.library.opcheck(forward, (q, k, v, gk, h0, 0.3, C, sub, save))
    _, _, states, scores = forward(q, k, v, gk, h0, 0.3, C, sub, save)
    grads = (torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen))
    for residuals in ((states, scores), (None, None)):
        args = (q.detach(), k.detach(), v.detach(), gk.detach(), h0.detach(), *grads, *residuals, 0.3, C, sub)
        torch.library.opcheck(torch.ops.laplace.chunked_gla_backward.default, args)
