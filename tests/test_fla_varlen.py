"""Packed variable-length batches (`cu_seqlens`): one static-shape computation equals each sequence alone."""

import math

import pytest
import torch
import torch.nn.functional as F

import laplace_passes
from laplace_passes.fla.packing import PackedSequences
from laplace_passes.fla.varlen import segmented_cumsum
from tests import fla_reference as reference
from tests.gla_cases import relative_rmse

fla_gla = pytest.importorskip("fla.ops.gla")
from fla.modules.causal_conv1d import causal_conv1d  # noqa: E402

LENGTHS = [1, 127, 128, 129, 500]
H, K, V = 2, 16, 8


def packed_inputs(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen)) / 2
    h0 = torch.randn(len(lengths), H, V, K, generator=gen)  # state_v_first, as fla's layer passes it
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return (q, k, v, g, h0), cu_seqlens


def run(fn, inputs):
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, final = fn(*leaves)
    gen = torch.Generator().manual_seed(1)
    total = (o * torch.randn(o.shape, generator=gen)).sum() + (final * torch.randn(final.shape, generator=gen)).sum()
    return [o, final, *torch.autograd.grad(total, leaves)]


def test_packed_chunk_gla_equals_each_sequence_alone():
    inputs, cu_seqlens = packed_inputs(LENGTHS)

    def packed(q, k, v, g, h0):
        return fla_gla.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, state_v_first=True,
                                 cu_seqlens=cu_seqlens)

    def one_by_one(q, k, v, g, h0):
        outputs, finals = [], []
        for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            o, final = reference.gla(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                                     h0[n:n + 1].transpose(-1, -2))
            outputs.append(o)
            finals.append(final.transpose(-1, -2))
        return torch.cat(outputs, dim=1), torch.cat(finals)

    compiled = laplace_passes.compile(packed, target="cpu")
    actual, expected = run(compiled, inputs), run(one_by_one, inputs)
    for name, a, e in zip(["o", "final states", "dq", "dk", "dv", "dg", "dh0"], actual, expected):
        assert relative_rmse(a, e) <= 1e-5, name
    (site,) = compiled.laplace_report.sites
    assert site.origin == "fla.chunk_gla[cu_seqlens]" and site.status == "retiled"
    assert site.plan["T"] == sum(LENGTHS) and site.shape["B"] == 1  # one computation over the packed batch


def test_an_empty_packed_sequence_keeps_its_initial_state():
    """Two equal consecutive offsets in `cu_seqlens`: that sequence's final state is its initial state, bit for bit,
    and its gradient the final state's; empty sequences first, last and side by side. The others as alone."""
    lengths = [0, 5, 0, 0, 70, 0]
    inputs, cu_seqlens = packed_inputs(lengths, seed=4)

    def packed(q, k, v, g, h0):
        return fla_gla.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, state_v_first=True,
                                 cu_seqlens=cu_seqlens)

    compiled = laplace_passes.compile(packed, target="cpu")
    o, final, dq, dk, dv, dg, dh0 = run(compiled, inputs)
    q, k, v, g, h0 = inputs
    gen = torch.Generator().manual_seed(1)  # the cotangents `run` drew: the output's, then the final states'
    torch.randn(o.shape, generator=gen)
    d_final = torch.randn(final.shape, generator=gen)
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        if start == end:
            assert torch.equal(final[n], h0[n]), f"sequence {n}"
            assert torch.equal(dh0[n], d_final[n]), f"sequence {n}"
            continue
        alone = [x[:, start:end] for x in (q, k, v, g)] + [h0[n:n + 1].transpose(-1, -2)]
        expected_o, expected_final = reference.gla(*alone)
        assert relative_rmse(o[:, start:end], expected_o) <= 1e-5, f"sequence {n}"
        assert relative_rmse(final[n], expected_final[0].transpose(-1, -2)) <= 1e-5, f"sequence {n}"


def test_packed_causal_conv1d_equals_each_sequence_alone():
    lengths, D, W = [1, 2, 5, 9], 6, 4
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, sum(lengths), D, generator=gen)
    weight, cache = torch.randn(D, W, generator=gen), torch.randn(len(lengths), D, W, generator=gen)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def packed(x, weight, cache):
        return causal_conv1d(x, weight, None, None, cache, output_final_state=True, activation="silu",
                             cu_seqlens=cu_seqlens)

    def one_by_one(x, weight, cache):
        outputs, finals = [], []
        for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            history = torch.cat([cache[n:n + 1, :, 1:].transpose(1, 2), x[:, start:end]], dim=1)
            y = sum(history[:, w:w + end - start] * weight[:, w] for w in range(W))
            outputs.append(y * torch.sigmoid(y))
            finals.append(torch.cat([cache[n:n + 1], x[:, start:end].transpose(1, 2)], dim=-1)[..., -W:])
        return torch.cat(outputs, dim=1), torch.cat(finals)

    actual = run(torch.compile(packed, backend="aot_eager", fullgraph=True), (x, weight, cache))
    expected = run(one_by_one, (x, weight, cache))
    for name, a, e in zip(["y", "final states", "dx", "dweight", "dcache"], actual, expected):
        assert relative_rmse(a, e) <= 1e-6, name


def test_segmented_cumsum_restarts_per_sequence_and_keeps_precision():
    """Empty sequences included; a late sequence after strongly decayed ones keeps its own precision."""
    lengths = [40, 0, 3, 200, 1, 77]
    T = sum(lengths)
    gates = -torch.rand(T, 3, generator=torch.Generator().manual_seed(3)) * 30  # strong decays: large sums
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = PackedSequences.from_cu_seqlens(cu_seqlens, T)
    got = segmented_cumsum(gates, packed.sequence_id, chunk=16)
    expected = torch.cat([gates[a:b].double().cumsum(0) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])])
    # Every entry within a few fp32 roundings of its own sequence's sum, not of the global sum (about 4000).
    worst = ((got.double() - expected).abs() / expected.abs().clamp(min=1)).max().item()
    assert worst < 50 * torch.finfo(torch.float32).eps
    assert torch.equal(packed.is_start.nonzero().squeeze(1), torch.tensor([0, 40, 43, 243, 244]))
    assert math.isclose(float(packed.lengths.sum()), T)
