"""`laplace::add_scaled` (torch.add with a tensor alpha) and its StableHLO form, `ExpandScaledAdds`.

The reference is `torch.add(input, other, alpha=...)` itself: the op must give its bits wherever ATen ops run
(eagerly, in a graph run op by op, as Inductor's fallback), since ShardedMuon's compiled step is compared bit for
bit with torch.optim.Muon, whose last op it is.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

from laplace_passes.lowering.legalize import ExpandScaledAdds
from laplace_passes.lowering.stablehlo import lower_to_stablehlo
from laplace_passes.ops.scaled_add import add_scaled

ALPHAS = [-0.025819888974716113, 0.3, -1e-3]


def _inputs(other_dtype):
    torch.manual_seed(0)
    return torch.randn(37, 29), torch.randn(37, 29).to(other_dtype)  # odd sizes: vector loops and their tails


@pytest.mark.parametrize("other_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", [None, "eager", "aot_eager", "inductor"])
def test_add_scaled_is_torch_add_bit_for_bit(backend, other_dtype):
    """One rounding, as torch.add's alpha: `input + other * alpha` written out differs in the last bit."""
    x, u = _inputs(other_dtype)
    run = add_scaled if backend is None else torch.compile(add_scaled, backend=backend, fullgraph=True)
    for alpha in ALPHAS:
        expected = torch.add(x, u, alpha=alpha)
        found = run(x, u, torch.tensor(alpha))
        assert found.dtype == expected.dtype == torch.float32
        assert torch.equal(found, expected), f"{backend}, alpha {alpha}"
    assert any(not torch.equal(x + u.float() * torch.tensor(a), torch.add(x, u, alpha=a)) for a in ALPHAS), \
        "the inputs no longer tell one rounding from two"


def test_a_compiled_add_scaled_takes_alpha_as_an_input():
    """A new alpha runs the graph compiled for the first."""
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    x, u = _inputs(torch.float32)
    run = torch.compile(add_scaled, backend=counting, fullgraph=True)
    for alpha in ALPHAS:
        assert torch.equal(run(x, u, torch.tensor(alpha)), torch.add(x, u, alpha=alpha))
    assert len(compiles) == 1


@pytest.mark.parametrize("other, alpha, words", [
    (torch.zeros(3, 5), torch.tensor(0.1), r"of one shape .* got \(3, 4\), \(3, 5\)"),
    (torch.zeros(3, 4), torch.tensor([0.1]), r"0-d floating alpha, got \(3, 4\), \(3, 4\) and torch.float32 \(1,\)"),
    (torch.zeros(3, 4), torch.tensor(1), r"0-d floating alpha, got \(3, 4\), \(3, 4\) and torch.int64 \(\)"),
])
def test_add_scaled_refuses_what_torch_add_with_a_number_would_not_be(other, alpha, words):
    with pytest.raises(ValueError, match=words):
        add_scaled(torch.zeros(3, 4), other, alpha)


@pytest.mark.parametrize("other_dtype", [torch.float32, torch.bfloat16])
def test_expand_scaled_adds_writes_the_op_in_aten_and_torch_mlir_lowers_it(other_dtype):
    x, u = _inputs(other_dtype)
    alpha = torch.tensor(ALPHAS[0])
    gm = make_fx(lambda x, u, a: add_scaled(x.mul(0.5), u, a), tracing_mode="fake")(x, u, alpha)
    FileCheck().check("laplace.add_scaled.default").run(gm.code)
    outcome = ExpandScaledAdds()(gm)
    gm.graph.lint()
    gm.recompile()
    assert outcome.modified and outcome.summary == "1 add_scaled op(s) written as input + other * alpha"
    cast = "aten._to_copy.default" if other_dtype != torch.float32 else "aten.mul.Tensor"
    FileCheck().check_not("add_scaled.default").check(cast).check("aten.mul.Tensor(").check("aten.add.Tensor(") \
        .run(gm.code)
    expected = torch.add(x.mul(0.5), u, alpha=ALPHAS[0])
    torch.testing.assert_close(gm(x, u, alpha), expected, rtol=2e-7, atol=1e-7)  # rounded twice, not once
    assert lower_to_stablehlo(gm).total_ops > 0


def test_expand_scaled_adds_leaves_a_graph_without_the_op_alone():
    gm = make_fx(lambda x: x * 2, tracing_mode="fake")(torch.randn(3))
    outcome = ExpandScaledAdds()(gm)
    assert not outcome.modified and outcome.summary == "no add_scaled"
