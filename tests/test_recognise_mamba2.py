"""A chunked GLA written with no loop over its chunks, found whole: transformers' Mamba-2 and a spelling of ours.

transformers' `mamba2_chunk_scan` (Mamba-2, and the copies Bamba, Zamba2, FalconH1, NemotronH and
GraniteMoeHybrid carry) computes every chunk at once: an intra-chunk quadratic form whose decay matrix is
`exp(segment_sum(A))` (NOTE [a segment sum] in laplace_passes/fx/quadratic.py), plus the states passed between
chunks, added. The sum must become one GLA site over all the tokens, re-tiled at the target's chunk whatever chunk
the user chose (NOTE [a chunked form without a loop] in laplace_passes/fx/chunked_quadratic.py), with outputs and
input gradients equal to the function run eagerly; near misses stay as written, bit for bit, with a reason.
"""

import pytest
import torch
import torch.nn.functional as F

import laplace_passes
from tests.test_recognise import assert_close, outputs_and_grads

pytest.importorskip("transformers")
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan  # noqa: E402

B, H, P, N, GROUPS = 2, 4, 8, 16, 2
TARGET_CHUNK = 16


def inputs(T: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, P, generator=gen)
    dt = torch.randn(B, T, H, generator=gen)
    A = -torch.rand(H, generator=gen) - 0.1  # Mamba-2's A = -exp(A_log) < 0
    b, c = (torch.randn(B, T, GROUPS, N, generator=gen) for _ in range(2))
    D = torch.randn(H, generator=gen)
    return [t.requires_grad_() for t in (x, dt, A, b, c, D)]


def scan(chunk: int, **kwargs):
    def call(x, dt, A, b, c, D):
        return mamba2_chunk_scan(x, dt, A, b, c, chunk, D=D, dt_softplus=True, **kwargs)
    return call


def compiled_like_eager(fn, args, rtol=1e-4, atol=1e-4):
    expected_out, expected_grads = outputs_and_grads(fn, args)
    torch._dynamo.reset()
    model = laplace_passes.compile(fn, target="cpu", chunk_size=TARGET_CHUNK)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out, rtol=rtol, atol=atol)
    assert_close(grads, expected_grads, rtol=rtol, atol=atol)
    return model.laplace_report


@pytest.mark.parametrize("chunk, T", [(16, 64), (32, 72)])  # 72 tokens pad to 3 chunks of 32
def test_transformers_mamba2_chunk_scan_is_one_gla_site_over_all_its_tokens(chunk, T):
    report = compiled_like_eager(scan(chunk), inputs(T))
    chunks = -(-T // chunk)
    (row,) = report.recurrences
    assert row.status == "GLA site", row
    assert row.form.startswith(f"chunked form with no loop over its {chunks} chunks of {chunk} tokens"), row.form
    assert "per-head gates summed cumulatively" in row.form and row.steps == chunks * chunk
    (site,) = report.sites
    assert site.status == "retiled" and site.plan["n_chunks"] == chunks * chunk // TARGET_CHUNK, site.plan


def test_on_trn2_sixteen_chunks_of_the_model_s_16_tokens_become_two_of_128():
    args = inputs(256)
    expected_out, expected_grads = outputs_and_grads(scan(16), args)
    torch._dynamo.reset()
    model = laplace_passes.compile(scan(16), target="trn2", inner="eager")
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out, rtol=1e-4, atol=1e-4)
    assert_close(grads, expected_grads, rtol=1e-4, atol=1e-4)
    (row,) = model.laplace_report.recurrences
    assert row.form.startswith("chunked form with no loop over its 16 chunks of 16 tokens"), row
    (site,) = model.laplace_report.sites
    assert site.status == "retiled" and (site.plan["chunk_size"], site.plan["n_chunks"]) == (128, 2), site.plan


def test_the_final_state_a_caller_reads_stays_equal_to_eager():
    def with_final_state(*args):
        return scan(16, return_final_states=True)(*args)

    report = compiled_like_eager(with_final_state, inputs(48))
    assert [r.status for r in report.recurrences] == ["GLA site"]
    assert report.recurrences[0].steps == 48


@pytest.mark.parametrize("value_size", [P, N], ids=["P=8,N=16", "P=N=16"])  # P = N: two layouts fit the sizes
def test_a_given_initial_state_is_read_into_the_site_with_its_gradient(value_size):
    gen = torch.Generator().manual_seed(1)
    x, *rest = inputs(48)
    x = torch.randn(B, 48, H, value_size, generator=gen).requires_grad_()
    initial = torch.randn(B, H, value_size, N, generator=gen).requires_grad_()

    def from_a_state(x, dt, A, b, c, D, initial):
        return scan(16, initial_states=initial)(x, dt, A, b, c, D)

    report = compiled_like_eager(from_a_state, [x, *rest, initial])
    (row,) = report.recurrences
    assert row.status == "GLA site" and row.form.startswith("chunked form with no loop over its 3 chunks"), row


@pytest.mark.parametrize("given", ["detached", "bf16"])
def test_an_initial_state_detached_or_kept_in_bf16_is_still_read_whole(given):
    """Truncated backpropagation passes `h0.detach()`; a bf16 model's cache holds its state in bf16, which the
    scan casts to float32. Neither is an op between the form's inputs and the sum: the scan is taken whole."""
    gen = torch.Generator().manual_seed(1)
    initial = torch.randn(B, H, P, N, generator=gen).requires_grad_()

    def from_a_state(x, dt, A, b, c, D, initial):
        state = initial.detach() if given == "detached" else initial.bfloat16()
        return scan(16, initial_states=state)(x, dt, A, b, c, D)

    (row,) = compiled_like_eager(from_a_state, [*inputs(48), initial]).recurrences
    assert row.status == "GLA site" and row.form.startswith("chunked form with no loop over its 3 chunks"), row


# -- a spelling of our own: [B, H, T, D], matmuls, the decay matrices from differences of cumulative sums ---------


def own_parts(q, k, v, g, chunk=8, inner_mask_diagonal=-1, segment_sum=True, detach=False, lookback_only=False):
    """GLA with a gate per head, all chunks at once: the intra-chunk form and the states' term, [B, H, n, C, V].

    `inner_mask_diagonal` is the diagonal the segment sum's inner mask keeps below (-1: the segment sum);
    without `segment_sum`, the decay matrix is exp(G_i - G_j) instead. Near misses: `detach`, the chunks'
    own states detached (truncated backpropagation); `lookback_only`, only the previous chunk's state enters."""
    Bq, Hq, T, _ = q.shape
    n = T // chunk
    q, k, v = (t.reshape(Bq, Hq, n, chunk, t.shape[-1]) for t in (q, k, v))
    g = g.reshape(Bq, Hq, n, chunk)
    G = g.cumsum(-1)
    kept = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool), diagonal=inner_mask_diagonal)
    segsum = torch.where(kept, g[..., :, None].expand(*g.shape, chunk), 0).cumsum(-2)
    if not segment_sum:
        segsum = G[..., :, None] - G[..., None, :]
    D = torch.exp(segsum.masked_fill(~torch.tril(torch.ones(chunk, chunk, dtype=torch.bool)), float("-inf")))
    intra = ((q @ k.transpose(-1, -2)) * D) @ v
    own = (k * torch.exp(G[..., -1:] - G)[..., None]).transpose(-1, -2) @ v  # [B, H, n, K, V]
    own = own.detach() if detach else own
    last = F.pad(G[..., -1], (1, 0)).cumsum(-1)  # decay up to each chunk's start, [B, H, n + 1]
    across = torch.exp(last[..., :-1, None] - last[..., None, 1:]).tril(-1)  # chunk z's own state entering c > z
    across = across - across.tril(-2) if lookback_only else across
    entering = torch.einsum("bhcz,bhzkv->bhckv", across, own)
    return intra, (q * torch.exp(G)[..., None]) @ entering


def own_chunked(q, k, v, g, off_diagonal=1.0, **kwargs):
    """The sum of `own_parts` as [B, H, T, V] (GLA when `off_diagonal` is 1)."""
    intra, inter = own_parts(q, k, v, g, **kwargs)
    return (intra + off_diagonal * inter).flatten(2, 3)


def own_inputs(T=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, 2, T, 4, generator=gen) for _ in range(2))
    v = torch.randn(1, 2, T, 6, generator=gen)
    g = F.logsigmoid(torch.randn(1, 2, T, generator=gen) + 1)
    return [t.requires_grad_() for t in (q, k, v, g)]


@pytest.mark.parametrize("segment_sum", [True, False], ids=["segment_sum", "differences"])
def test_our_own_loop_free_chunked_spelling_is_one_gla_site(segment_sum):
    report = compiled_like_eager(lambda *a: own_chunked(*a, segment_sum=segment_sum), own_inputs())
    (row,) = report.recurrences
    assert row.status == "GLA site" and row.form.startswith("chunked form with no loop over its 4 chunks of 8"), row


def test_an_off_diagonal_term_that_is_not_gla_leaves_the_intra_chunk_forms_as_sites():
    report = compiled_like_eager(lambda *a: own_chunked(*a, off_diagonal=0.5), own_inputs())
    (row,) = report.recurrences
    assert row.status == "GLA site" and row.form.startswith("quadratic form (q k^T (.) D) v, 8 tokens"), row


def test_a_segment_sum_with_the_wrong_inner_mask_is_declined_and_left_as_written():
    def near_miss(*a):
        return own_chunked(*a, inner_mask_diagonal=0)

    args = own_inputs()
    expected_out, expected_grads = outputs_and_grads(near_miss, args)
    torch._dynamo.reset()
    model = laplace_passes.compile(near_miss, target="cpu", chunk_size=TARGET_CHUNK)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out, rtol=0, atol=0)
    assert_close(grads, expected_grads, rtol=1e-6, atol=1e-6)
    (row,) = model.laplace_report.recurrences
    assert row.status == "declined" and "segment sum" in row.reason, row


def own_compiled_equal(fn, args, **tolerance):
    """`fn` compiled for the cpu target, outputs and input gradients equal to eager; its recurrence rows."""
    return compiled_like_eager(fn, args, **tolerance).recurrences


def test_a_detached_states_term_is_not_taken_whole_and_keeps_its_gradients():
    (row,) = own_compiled_equal(lambda *a: own_chunked(*a, detach=True), own_inputs())
    assert row.status == "GLA site" and row.form.startswith("quadratic form (q k^T (.) D) v, 8 tokens"), row
    assert "through detach" in row.form and "passes no gradient" in row.form, row.form


def test_a_one_chunk_lookback_is_seen_by_the_check_with_weak_gates_at_chunks_of_32():
    args = own_inputs(T=128)
    with torch.no_grad():
        args[3].mul_(0.01)  # decays near 1, as Mamba-2's dt * A often are
    (row,) = own_compiled_equal(lambda *a: own_chunked(*a, chunk=32, lookback_only=True), args)
    assert row.status == "GLA site" and row.form.startswith("quadratic form (q k^T (.) D) v, 32 tokens"), row
    assert "not taken whole" in row.form and "differs" in row.form, row.form


def test_a_bf16_chunked_form_is_not_taken_whole():
    args = [t.detach().bfloat16().requires_grad_() for t in own_inputs()]
    (row,) = own_compiled_equal(own_chunked, args, rtol=5e-2, atol=1e-1)  # bf16's rounding, eagerly
    assert row.status == "GLA site" and "computes in torch.bfloat16" in row.form, row


def test_an_in_place_sum_another_name_still_reads_is_left_to_the_intra_chunk_form():
    def aliased(*args):
        intra, inter = own_parts(*args)
        total = intra
        total += inter  # intra is the sum too
        return total.flatten(2, 3), intra.flatten(2, 3)

    (row,) = own_compiled_equal(aliased, own_inputs())
    assert row.status == "GLA site" and row.form.startswith("quadratic form (q k^T (.) D) v, 8 tokens"), row


def test_a_one_chunk_lookback_with_decays_near_one_is_not_taken_whole():
    """The same near miss written with decays (ratios of cumulative products): the second check draws weak
    decays too, so the chunk a state skips shows."""

    def decays_lookback(q, k, v, a, chunk=16):
        Bq, Hq, T, _ = q.shape
        n = T // chunk
        q, k, v = (t.reshape(Bq, Hq, n, chunk, t.shape[-1]) for t in (q, k, v))
        P = a.reshape(Bq, Hq, n, chunk).cumprod(-1)
        intra = ((q @ k.transpose(-1, -2)) * (P[..., :, None] / P[..., None, :]).tril()) @ v
        own = (k * (P[..., -1:] / P)[..., None]).transpose(-1, -2) @ v
        total = F.pad(P[..., -1], (1, 0), value=1.0).cumprod(-1)  # the decay up to each chunk's start
        across = (total[..., :-1, None] / total[..., None, 1:]).tril(-1)
        entering = torch.einsum("bhcz,bhzkv->bhckv", across - across.tril(-2), own)  # the previous chunk's only
        return (intra + (q * P[..., None]) @ entering).flatten(2, 3)

    q, k, v, _ = own_inputs(T=64)
    a = (1 - 0.02 * torch.rand(1, 2, 64, generator=torch.Generator().manual_seed(2))).requires_grad_()
    (row,) = own_compiled_equal(decays_lookback, [q, k, v, a])
    assert row.status == "GLA site" and row.form.startswith("quadratic form (q k^T (.) D) v, 16 tokens"), row
    assert "not taken whole" in row.form, row.form


@pytest.mark.parametrize("segment_sum", [True, False], ids=["segment_sum", "differences"])
def test_a_window_of_recent_keys_is_declined_and_left_as_written(segment_sum):
    def windowed(q, k, v, g):
        T = g.shape[-1]
        ones = torch.ones(T, T, dtype=torch.bool)
        if segment_sum:
            x = g[..., :, None].expand(*g.shape, T).masked_fill(~ones.tril(-1), 0).cumsum(-2)
        else:
            G = g.cumsum(-1)
            x = G[..., :, None] - G[..., None, :]
        D = torch.exp(x.masked_fill(~(ones.tril() & ~ones.tril(-32)), float("-inf")))  # the 32 latest keys
        return ((q @ k.transpose(-1, -2)) * D) @ v

    args = own_inputs(T=64)
    expected_out, expected_grads = outputs_and_grads(windowed, args)
    torch._dynamo.reset()
    model = laplace_passes.compile(windowed, target="cpu", chunk_size=TARGET_CHUNK)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out, rtol=0, atol=0)
    assert_close(grads, expected_grads, rtol=0, atol=0)
    (row,) = model.laplace_report.recurrences
    assert row.status == "declined" and "drops keys at or before the query" in row.reason, row


# -- whole models ------------------------------------------------------------------------------------------------


def _mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM
    return Mamba2ForCausalLM(Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                                          state_size=16, n_groups=1, chunk_size=16, expand=2))


def _bamba():
    from transformers import BambaConfig, BambaForCausalLM
    return BambaForCausalLM(BambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=32, mamba_n_heads=4,
                                        mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16,
                                        attn_layer_indices=[1], mamba_expand=2))


@pytest.mark.parametrize("build", [_mamba2, _bamba], ids=["mamba2", "bamba"])
def test_a_training_step_of_a_transformers_model_equals_eager_with_every_mamba_layer_a_site(build):
    torch.manual_seed(0)
    model = build().float()
    ids = torch.randint(0, 64, (2, 48))
    expected = model(input_ids=ids, labels=ids).loss
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    torch._dynamo.reset()
    loss = torch.compile(model, backend="laplace")(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for name, grad in expected_grads.items():
        # A_log's gradient sums every token's gate gradient: 1.5e-5 relative here against float64, eager 6e-7
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-3, atol=1e-5, msg=name)
    rows = laplace_passes.last_report().recurrences
    mamba_layers = sum(1 for m in model.modules() if type(m).__name__.endswith("Mixer"))
    assert [r.status for r in rows] == ["GLA site"] * mamba_layers, rows
    assert all(r.form.startswith("chunked form with no loop over its 3 chunks of 16 tokens") for r in rows), rows


def test_greedy_generate_with_the_cache_gives_eager_s_tokens_with_each_prefill_layer_a_site():
    torch.manual_seed(0)
    model = _mamba2().eval()
    prompt = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, backend="laplace")
        rows = []

        def forward(*args, **kwargs):
            out = compiled(*args, **kwargs)
            rows.extend(laplace_passes.last_report().recurrences)
            return out

        model.forward = forward
        tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, expected)
    prefill = [r for r in rows if r.steps == 48]  # 40 prompt tokens in 3 chunks of 16; decode steps have no row
    assert len(prefill) == 2 and all(r.status == "GLA site" and r.form.startswith("chunked form") for r in prefill)
