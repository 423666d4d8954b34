"""Inductor's index analysis without sympy.simplify on plain polynomials: the same kernels, compiled sooner.

NOTE [index strides without sympy.simplify]
Inductor's C++ backend asks, for every load and store of every kernel, the
stride of its index along the vectorised loop (`stride_at_vec_range` in
`torch._inductor.sizevars`): it rewrites the index and calls
`sympy.simplify` twice, on the index and on the difference of two indices.
Those are mostly plain polynomials with integer coefficients
(`8192*x0 + 256*x1 + 16*x2 + x3 + 128`), where `sympy.simplify` takes about
10 ms each, its whole heuristic search, for what `sympy.expand` computes
exactly: a polynomial's expanded form is canonical, so the difference of
two indices expands to the same number the search finds. In a compile of
`tiny`'s training step it was 40% of the main process's CPU time
(`benchmarks/bench_compile.py`). Within `fast_index_simplify()`,
`torch._inductor.sizevars` sees a `sympy` whose `simplify` expands
expressions built only of symbols, rational numbers, sums and products,
and calls `sympy.simplify` on anything else (FloorDiv, ModularIndexing,
relations). The kernels Inductor writes are the same text either way
(tests/test_inductor_fast.py); the results of the patched functions are
lru-cached by Inductor, and equal to the unpatched ones.
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator
from unittest import mock

import sympy

_POLYNOMIAL_PARTS = (sympy.Symbol, sympy.Rational, sympy.Add, sympy.Mul)


def is_plain_polynomial(expr) -> bool:
    """Built only of symbols, rational numbers, sums and products (no powers, functions or relations)."""
    return isinstance(expr, sympy.Basic) and all(isinstance(part, _POLYNOMIAL_PARTS)
                                                 for part in sympy.preorder_traversal(expr))


def simplify(expr, *args, **kwargs):
    """`sympy.simplify`, by expansion for a plain polynomial (canonical, exact)."""
    if not args and not kwargs and is_plain_polynomial(expr):
        return sympy.expand(expr)
    return sympy.simplify(expr, *args, **kwargs)


class _SympyWithPolynomialSimplify(types.ModuleType):
    """sympy, with `simplify` replaced: what `torch._inductor.sizevars` sees inside `fast_index_simplify`."""

    simplify = staticmethod(simplify)

    def __getattr__(self, name: str):
        return getattr(sympy, name)


_SYMPY = _SympyWithPolynomialSimplify("sympy")


@contextlib.contextmanager
def fast_index_simplify() -> Iterator[None]:
    """Inductor's stride analysis with polynomials expanded, not searched (NOTE above); nothing else changes."""
    from torch._inductor import sizevars

    if getattr(sizevars, "sympy", None) is not sympy:  # another torch: leave it as it is
        yield
        return
    with mock.patch.object(sizevars, "sympy", _SYMPY):
        yield
