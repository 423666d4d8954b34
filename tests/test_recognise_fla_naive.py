"""fla's own plain-PyTorch references (its `naive_*` functions), compiled through the laplace backend unchanged.

These are GLA-family computations written by someone else, in four of the spellings recognition reads: a token
loop (linear attention, simple GLA), the quadratic form with the decay matrix built from a cumulative sum
(`naive_parallel_simple_gla`: `(G_i - G_j).tril().exp().tril()`) or from ranges alone (`naive_retention`: a
constant D whose values are gamma ** (i - j), NOTE [a constant decay matrix] in laplace_passes/fx/quadratic.py),
and a loop over chunks of fla's own size (`naive_chunk_simple_gla`). Each must become one GLA site re-tiled at
the target's chunk, with outputs and input gradients equal to the function run eagerly.
"""

import pytest
import torch
import torch.nn.functional as F

import laplace_passes
from tests.test_recognise import assert_close, outputs_and_grads

pytest.importorskip("fla")
from fla.ops.linear_attn.naive import naive_chunk_linear_attn, naive_recurrent_linear_attn  # noqa: E402
from fla.ops.retention.naive import naive_retention  # noqa: E402
from fla.ops.simple_gla.naive import naive_chunk_simple_gla, naive_parallel_simple_gla  # noqa: E402

B, T, H, K, V = 2, 32, 2, 8, 16
CHUNK = 16  # the target's chunk here: each site is re-tiled into T / CHUNK chunks


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2)  # one gate per head: simple GLA's
    return q, k, v, g


def linear_attn(q, k, v, g):
    return naive_recurrent_linear_attn(q, k, v, output_final_state=True)


def parallel_simple_gla(q, k, v, g):
    return naive_parallel_simple_gla(q, k, v, g)[0]


def chunk_simple_gla(q, k, v, g):
    return naive_chunk_simple_gla(q, k, v, g, chunk_size=8)[0]


def retention(q, k, v, g):
    # fla's retention reference reads [B, H, T, D]; its decays come from the head count alone (no g).
    return naive_retention(*(x.transpose(1, 2) for x in (q, k, v)))


CASES = {
    linear_attn: ("token loop, 32 steps, no gate", (0, 1, 2)),
    parallel_simple_gla: ("quadratic form (q k^T (.) D) v, 32 tokens, per-head gates summed cumulatively", (0, 1, 2, 3)),
    chunk_simple_gla: ("token loop over chunks: 4 chunks of 8 tokens (32 tokens), per-head gates", (0, 1, 2, 3)),
    retention: ("quadratic form (q k^T (.) D) v, 32 tokens, a fixed decay per head raised to i - j", (0, 1, 2)),
}


def compiled_like_eager(fn, args):
    """`fn` compiled for the cpu target at chunks of CHUNK: outputs and input gradients as eager's; its report."""
    expected_out, expected_grads = outputs_and_grads(fn, args)
    torch._dynamo.reset()
    model = laplace_passes.compile(fn, target="cpu", chunk_size=CHUNK)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out, rtol=1e-4, atol=1e-4)
    assert_close(grads, expected_grads, rtol=1e-4, atol=1e-4)
    return model.laplace_report


@pytest.mark.parametrize("fn", list(CASES), ids=lambda fn: fn.__name__)
def test_fla_s_naive_function_is_one_gla_site_with_its_outputs_and_gradients(fn):
    form, read = CASES[fn]
    args = [x.clone().requires_grad_(i in read) for i, x in enumerate(inputs())]
    differentiable = [args[i] for i in read]

    def call(*leaves):
        full = list(args)
        for i, leaf in zip(read, leaves):
            full[i] = leaf
        out = fn(*full)
        return tuple(o for o in out if o is not None) if isinstance(out, tuple) else out

    report = compiled_like_eager(call, differentiable)
    (row,) = report.recurrences
    assert row.status == "GLA site" and row.form.startswith(form), row
    (site,) = report.sites
    assert site.status == "retiled" and site.plan["n_chunks"] == T // CHUNK, site.plan


@pytest.mark.parametrize("normalize", [False, True])
def test_fla_s_chunked_linear_attention_with_no_loop_over_chunks_is_one_gla_site(normalize):
    """`naive_chunk_linear_attn` masks its scores as a whole, `(q @ k^T).masked_fill_(triu(ones, 1), 0) @ v`
    (NOTE [a product masked as a whole]), and passes the states between its 64-token chunks by a cumulative
    sum with no loop (NOTE [a chunked form without a loop]); with `normalize`, the sum is then divided."""
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(B, 128, H, K, generator=gen).requires_grad_() for _ in range(3)]

    def chunk_linear_attn(q, k, v):
        return naive_chunk_linear_attn(q, k, v, normalize=normalize)

    report = compiled_like_eager(chunk_linear_attn, args)
    (row,) = report.recurrences
    assert row.status == "GLA site", row
    assert row.form.startswith("chunked form with no loop over its 2 chunks of 64 tokens") and "no gate" in row.form
    (site,) = report.sites
    assert site.status == "retiled" and site.plan["n_chunks"] == 128 // CHUNK, site.plan
