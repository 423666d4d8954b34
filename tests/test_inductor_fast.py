"""Inductor's stride analysis with polynomial indices expanded (laplace_passes.infra.inductor_fast): same kernels.

NOTE [index strides without sympy.simplify]: the patch may only make
Inductor faster, never change what it writes; checked by compiling the
chunked GLA forward (pads, chunk reshapes, transposes, concatenations:
indices with FloorDiv and ModularIndexing as well as plain polynomials)
with and without it and comparing the generated code.
"""

import functools

import sympy
import torch
import torch._dynamo
from torch._inductor import sizevars
from torch._inductor.utils import run_and_get_code
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from laplace_passes.infra import inductor_fast
from laplace_passes.ops.chunked_forward import chunked_forward
from tests.gla_cases import make_inputs


def generated_code(fast: bool) -> tuple[torch.Tensor, str]:
    for cached in (sizevars.stride_at, sizevars.simplify_index_in_vec_range, sizevars.stride_at_vec_range):
        cached.cache_clear()  # else the second compile reads the first one's answers
    torch._dynamo.reset()
    q, k, v, gk, h0 = make_inputs(1, 130, 2, 8, 6, gate_divisor=1.0)
    compiled = torch.compile(functools.partial(chunked_forward, scale=0.3, chunk_size=64, sub_chunk_size=4),
                             backend="inductor")
    with torch._inductor.config.patch(fx_graph_cache=False):
        if fast:
            with inductor_fast.fast_index_simplify():
                result, code = run_and_get_code(compiled, q, k, v, gk, h0)
        else:
            result, code = run_and_get_code(compiled, q, k, v, gk, h0)
    # The AOT ID line numbers compiles in order; the rest is what Inductor wrote.
    return result[0], "\n".join(line for text in code for line in text.splitlines() if not line.startswith("# AOT ID"))


def test_inductor_writes_the_same_kernels_with_polynomials_expanded(monkeypatch):
    expanded = []
    real = inductor_fast.simplify

    def counting(expr, *args, **kwargs):
        if inductor_fast.is_plain_polynomial(expr):
            expanded.append(expr)
        return real(expr, *args, **kwargs)

    monkeypatch.setattr(inductor_fast._SympyWithPolynomialSimplify, "simplify", staticmethod(counting))
    fast_out, fast_code = generated_code(fast=True)
    plain_out, plain_code = generated_code(fast=False)
    assert len(expanded) > 10  # the patch was on the path Inductor took
    assert fast_code == plain_code
    torch.testing.assert_close(fast_out, plain_out, rtol=0, atol=0)


def test_only_plain_polynomials_are_expanded():
    x0, x1 = sympy.symbols("x0 x1", integer=True)
    index = 8192 * x0 + 256 * x1 + 16
    assert inductor_fast.simplify(index.subs(x0, x0 + 1) - index) == 8192
    assert inductor_fast.is_plain_polynomial(index)
    for other in (FloorDiv(x0, 4) + x1, ModularIndexing(x0, 1, 16), x0 ** 2, sympy.Lt(x0, 4)):
        assert not inductor_fast.is_plain_polynomial(other)
