"""The canonical form of NOTE [canonical tensor algebra] (`laplace_passes.fx.algebra`) and its building blocks.

Indices, factors, terms and sums of terms, and what each algebraic op does to
them (products, sums, sums over dimensions, views, einsum, matmul); reading
a graph's nodes into this form is `laplace_passes.fx.algebra.read`.
"""

from __future__ import annotations

import itertools
import string
from dataclasses import dataclass

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import fake_value

Node = torch.fx.Node

MAX_TERMS = 8  # a value read as more terms than this is a leaf: the patterns matched have two at most
MAX_FACTORS = 12


class Index:
    """One dimension's name: equal only to itself."""

    _counter = itertools.count()

    __slots__ = ("size", "number")

    def __init__(self, size: int) -> None:
        self.size = size
        self.number = next(Index._counter)

    def __repr__(self) -> str:
        return f"i{self.number}:{self.size}"


Axes = tuple  # tuple[Index | None, ...]


@dataclass(frozen=True)
class Factor:
    node: Node
    axes: Axes  # one per dimension of the node's value

    def indices(self) -> set[Index]:
        return {a for a in self.axes if a is not None}


@dataclass(frozen=True)
class Term:
    coef: float
    factors: tuple[Factor, ...]

    def indices(self) -> set[Index]:
        return set().union(*(f.indices() for f in self.factors)) if self.factors else set()


@dataclass(frozen=True)
class Expr:
    axes: Axes
    terms: tuple[Term, ...]

    def summed(self, term: Term) -> set[Index]:
        """The indices `term` sums over."""
        return term.indices() - {a for a in self.axes if a is not None}


# Why a loop of symbolic sizes is not read (the driver compiles such graphs per shape where it may).
SYMBOLIC_SIZE = "a symbolic size"


class NotAlgebraic(Exception):
    """This node is read as a leaf."""


# -- building blocks ------------------------------------------------------------------------------------


def leaf(node: Node) -> Expr:
    value = fake_value(node)
    if not isinstance(value, torch.Tensor):
        raise NotAlgebraic(f"{node.name} is not a tensor")
    axes = tuple(None if _size(d) == 1 else Index(_size(d)) for d in value.shape)
    return Expr(axes, (Term(1.0, (Factor(node, axes),)),))


def _size(d) -> int:
    if not isinstance(d, int):
        raise NotAlgebraic(SYMBOLIC_SIZE)
    return d


def rename(expr: Expr, mapping: dict[Index, Index | None]) -> Expr:
    if not mapping:
        return expr

    def axes(a: Axes) -> Axes:
        return tuple(mapping.get(x, x) if x is not None else None for x in a)

    terms = tuple(Term(t.coef, tuple(Factor(f.node, axes(f.axes)) for f in t.factors)) for t in expr.terms)
    return Expr(axes(expr.axes), terms)


def fresh_sums(expr: Expr) -> Expr:
    """`expr` with new names for the indices it sums over, so that two operands never share one by accident."""
    free = {a for a in expr.axes if a is not None}
    summed = set().union(*(t.indices() for t in expr.terms)) - free if expr.terms else set()
    return rename(expr, {i: Index(i.size) for i in summed})


def renamed_fresh(expr: Expr) -> Expr:
    """`expr` with a new name for every index, free or summed: `x[:, None] - x[None, :]` reads x twice, at
    two different positions, and the two reads must not share a name until broadcasting says they do."""
    indices = {a for a in expr.axes if a is not None}
    for term in expr.terms:
        indices |= term.indices()
    return rename(expr, {i: Index(i.size) for i in indices})


def _broadcast(pa: Axes, pb: Axes) -> tuple[Axes, dict[Index, Index]]:
    """The broadcast of two axes tuples (right-aligned), and the renaming that makes `pb`'s indices `pa`'s."""
    n = max(len(pa), len(pb))
    pa = (None,) * (n - len(pa)) + tuple(pa)
    pb = (None,) * (n - len(pb)) + tuple(pb)
    mapping, axes = {}, []
    for x, y in zip(pa, pb):
        if x is None or y is None:
            axes.append(x if y is None else y)
            continue
        if x.size != y.size:
            raise NotAlgebraic("shapes that do not broadcast")
        if x is not y:
            mapping[y] = x
        axes.append(x)
    return tuple(axes), mapping


def _align(a: Expr, b: Expr) -> tuple[Axes, Expr, Expr]:
    """Broadcast `a` and `b`: the result's axes, and both with equal dimensions named alike."""
    b = fresh_sums(b)
    axes, mapping = _broadcast(a.axes, b.axes)
    return axes, a, rename(b, mapping)


def multiply(a: Expr, b: Expr) -> Expr:
    axes, a, b = _align(a, b)
    terms = tuple(Term(x.coef * y.coef, x.factors + y.factors) for x in a.terms for y in b.terms)
    return _checked(Expr(axes, terms))


def add(a: Expr, b: Expr, alpha: float = 1.0) -> Expr:
    axes, a, b = _align(a, b)
    return _checked(Expr(axes, a.terms + tuple(Term(alpha * t.coef, t.factors) for t in b.terms)))


def scale(a: Expr, c: float) -> Expr:
    return Expr(a.axes, tuple(Term(c * t.coef, t.factors) for t in a.terms))


def sum_over(a: Expr, dims: list[int], keepdim: bool) -> Expr:
    dims = sorted({d % len(a.axes) for d in dims}) if a.axes else []
    terms = list(a.terms)
    for d in dims:
        index = a.axes[d]
        if index is None:
            continue
        # A term that does not depend on the index is counted `size` times.
        terms = [t if index in t.indices() else Term(t.coef * index.size, t.factors) for t in terms]
    axes = tuple(None if i in dims else x for i, x in enumerate(a.axes)) if keepdim else \
        tuple(x for i, x in enumerate(a.axes) if i not in dims)
    return Expr(axes, tuple(terms))


def permute(a: Expr, order: list[int]) -> Expr:
    order = [d % len(a.axes) for d in order]
    if sorted(order) != list(range(len(a.axes))):
        raise NotAlgebraic("not a permutation")
    return Expr(tuple(a.axes[d] for d in order), a.terms)


def unsqueeze(a: Expr, dim: int) -> Expr:
    dim = dim % (len(a.axes) + 1)
    return Expr(a.axes[:dim] + (None,) + a.axes[dim:], a.terms)


def squeeze(a: Expr, dims: list[int] | None) -> Expr:
    dims = [d % len(a.axes) for d in dims] if dims is not None else [i for i, x in enumerate(a.axes) if x is None]
    return Expr(tuple(x for i, x in enumerate(a.axes) if not (i in dims and x is None)), a.terms)


def reshape(a: Expr, shape: list[int]) -> Expr:
    """A reshape that only adds or drops size-1 dimensions (anything else is not read)."""
    sizes = [d for d in shape]
    known = [x.size for x in a.axes if x is not None]
    if -1 in sizes:
        rest = 1
        for d in sizes:
            rest *= d if d != -1 else 1
        total = 1
        for d in known:
            total *= d
        if rest == 0 or total % rest:
            raise NotAlgebraic("reshape")
        sizes = [total // rest if d == -1 else d for d in sizes]
    if [d for d in sizes if d != 1] != known:
        raise NotAlgebraic("a reshape that merges or splits dimensions")
    it = iter(x for x in a.axes if x is not None)
    return Expr(tuple(None if d == 1 else next(it) for d in sizes), a.terms)


def expand(a: Expr, sizes: list[int]) -> Expr:
    sizes = list(sizes)
    if len(sizes) < len(a.axes):
        raise NotAlgebraic("expand")
    axes = (None,) * (len(sizes) - len(a.axes)) + a.axes
    out = []
    for x, n in zip(axes, sizes):
        if x is None and n not in (-1, 1):
            out.append(Index(n))  # broadcast: a new index nothing depends on
        else:
            out.append(x)
    return Expr(tuple(out), a.terms)


def einsum(equation: str, operands: list[Expr]) -> Expr:
    specs, output = einsum_letters(equation, [len(o.axes) for o in operands])
    letters: dict[str, Index | None] = {}
    renamed = []
    for spec, expr in zip(specs, operands):
        if len(spec) != len(expr.axes):
            raise NotAlgebraic("einsum with more or fewer letters than an operand has dimensions")
        if len(set(spec)) != len(spec):
            raise NotAlgebraic("einsum with a repeated index (a diagonal)")
        expr = fresh_sums(expr)
        mapping = {}
        for letter, axis in zip(spec, expr.axes):
            seen = letters.get(letter)
            if axis is None:
                letters.setdefault(letter, None)
            elif seen is None:
                letters[letter] = axis
            elif seen is not axis:
                mapping[axis] = seen
        renamed.append(rename(expr, mapping))
    # a letter first seen as size 1 and later as an index: earlier operands broadcast over it
    terms = [Term(1.0, ())]
    for expr in renamed:
        terms = [Term(x.coef * y.coef, x.factors + y.factors) for x in terms for y in expr.terms]
    out_axes = tuple(letters[c] for c in output)
    result = Expr(out_axes, tuple(terms))
    summed_letters = [c for c in letters if c not in output and letters[c] is not None]
    for c in summed_letters:  # a summed index no factor of a term reads counts `size` times
        index = letters[c]
        result = Expr(result.axes, tuple(t if index in t.indices() else Term(t.coef * index.size, t.factors)
                                         for t in result.terms))
    return _checked(result)


def einsum_letters(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """The equation's operand and output specs with `...` spelled out in letters of their own (right-aligned,
    as the ellipsis dimensions broadcast) and an implicit output made explicit (torch's rule: the ellipsis,
    then the letters used once, in alphabetical order)."""
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    specs = inputs.split(",")
    if len(specs) != len(ranks):
        raise NotAlgebraic("einsum with more or fewer operands than its equation names")
    if any(s.count("...") > 1 or s.replace("...", "").count(".") for s in specs + [output]):
        raise NotAlgebraic("einsum with a malformed ellipsis")
    widths = [rank - len(spec.replace("...", "")) if "..." in spec else 0 for spec, rank in zip(specs, ranks)]
    if any(w < 0 for w in widths):
        raise NotAlgebraic("einsum with more letters than an operand has dimensions")
    spare = [c for c in string.ascii_letters if c not in equation][:max(widths, default=0)]
    if len(spare) < max(widths, default=0):
        raise NotAlgebraic("einsum with too many dimensions under its ellipsis")
    specs = [spec.replace("...", "".join(spare[len(spare) - w:])) for spec, w in zip(specs, widths)]
    if not arrow:
        once = sorted(c for c in set("".join(specs)) if "".join(specs).count(c) == 1 and c not in spare)
        output = "".join(spare) + "".join(once)
    return specs, output.replace("...", "".join(spare))


def matmul(a: Expr, b: Expr) -> Expr:
    """torch.matmul's rules: [..., n, m] @ [..., m, p], batch dimensions broadcast, 1-D operands included."""
    if not a.axes or not b.axes:
        raise NotAlgebraic("matmul of a scalar")
    a1, b1 = len(a.axes) == 1, len(b.axes) == 1
    if a1:
        a = unsqueeze(a, 0)
    if b1:
        b = unsqueeze(b, -1)
    b = fresh_sums(b)
    m, n = a.axes[-1], b.axes[-2]
    if (m is None) != (n is None):
        raise NotAlgebraic("matmul of mismatched sizes")
    if m is not None and m is not n:
        if m.size != n.size:
            raise NotAlgebraic("matmul of mismatched sizes")
        b = rename(b, {n: m})
    batch, mapping = _broadcast(a.axes[:-2], b.axes[:-2])
    b = rename(b, mapping)
    terms = tuple(Term(x.coef * y.coef, x.factors + y.factors) for x in a.terms for y in b.terms)
    result = _checked(Expr(batch + (a.axes[-2], b.axes[-1]), terms))
    if b1:
        result = squeeze(result, [-1])
    if a1:
        result = squeeze(result, [-1] if b1 else [-2])
    return result


def _checked(expr: Expr) -> Expr:
    if len(expr.terms) > MAX_TERMS or any(len(t.factors) > MAX_FACTORS for t in expr.terms):
        raise NotAlgebraic("too large to read")
    return expr
