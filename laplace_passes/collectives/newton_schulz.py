"""Recognising Muon's Newton-Schulz iteration in an ATen graph by what it computes.

Newton-Schulz orthogonalisation is a Frobenius normalisation followed by one
or more steps of an odd matrix polynomial,

    X <- X / (||X||_F + eps)          (or X / clamp(||X||_F, eps), F.normalize, ...)
    X <- a X + b (X X^T) X + c (X X^T)^2 X        (any coefficients, any degree, per step)

and people spell it in many ways: `addmm(gram, gram, gram, beta=b, alpha=c)`
or `b * A + c * A @ A`, `mm` or batched `bmm` / `baddbmm`, with or without
the tall-matrix transpose, in bf16 or fp32, one coefficient triple or a table
per step, through views and write-backs functionalisation leaves behind.
Rather than list spellings, the recogniser evaluates the graph in the algebra
of odd matrix polynomials: from a normalised iterate X, every node computed
from it by `mm`, `bmm`, `addmm`, `baddbmm`, `add`, `sub`, `mul` / `div` by a
number and `neg` gets an abstract value

    L p   = p(G) X          G = X X^T, p a coefficient tuple over powers of G
    LT p  = (p(G) X)^T
    G p   = p(G)
    R p   = p(H)            H = X^T X

(products follow X H^k = G^k X; views, casts and copies are seen through by
`aliases.Aliases`). A step ends at an `L p` value of degree >= 1 whose gram
is taken next (the following step), or, for the last step, at the first value
of the highest degree (so a later `o * scale` is not taken for the step); its
`p` are the step's coefficients, read exactly from the graph's scalars. A
normalisation alone is not Newton-Schulz (models normalise for other
reasons); an iteration without the normalisation is a near miss, reported.

The rewrite copies the user's own nodes (the spellings are not bitwise
interchangeable): the recogniser only finds where the region starts and ends.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
import torch.fx

from laplace_passes.collectives.aliases import Aliases
from laplace_passes.collectives.regions import Region, RegionError, closed_region, live_nodes
from laplace_passes.infra.fx_helpers import fake_tensor
from laplace_passes.infra.op_facts import ADD_MATMULS, MATMULS, is_cast, is_value_copy, is_view

aten = torch.ops.aten
Node = torch.fx.Node



@dataclass(frozen=True)
class NewtonSchulz:
    region: Region  # matrix -> last iterate, closed
    coefficients: tuple[tuple[float, ...], ...]  # per step: (a, b, c, ...) of a X + b G X + c G^2 X ...
    rows: int
    cols: int
    batch: int  # matrices orthogonalised together ([k, rows, cols] inputs)

    @property
    def matrix(self) -> Node:
        return self.region.input

    @property
    def output(self) -> Node:
        return self.region.output

    @property
    def flops(self) -> int:
        return self.batch * sum(newton_schulz_flops(self.rows, self.cols, 1, len(p) - 1) for p in self.coefficients)


def newton_schulz_flops(rows: int, cols: int, steps: int, degree: int = 2) -> int:
    """Matmul FLOPs of `steps` steps of a degree-`degree` polynomial in G on a rows x cols matrix.

    The smaller side is m: the gram m x n @ n x m, degree - 1 products of
    m x m grams, and the polynomial times X (2 m^2 n). Degree 2 is Muon's quintic.
    """
    m, n = min(rows, cols), max(rows, cols)
    return steps * (2 * m * m * n + 2 * (degree - 1) * m ** 3 + 2 * m * m * n)


def find_newton_schulz(graph: torch.fx.Graph, live: set[Node] | None = None) -> tuple[list[NewtonSchulz], list[str]]:
    """Every Newton-Schulz region in `graph`, and the reasons for near misses (`live`: `live_nodes(graph)`)."""
    live = live_nodes(graph) if live is None else live
    finder = _Finder(graph, Aliases())
    found, misses = [], []
    for node in graph.nodes:
        if node not in live:
            continue
        norm = finder.normalisation(node)
        if norm is None:
            continue
        try:
            region = finder.region_from(node, norm)
        except RegionError as miss:
            misses.append(f"{node.name}: a Newton-Schulz iteration follows this normalisation, but {miss}")
            continue
        if region is not None:
            found.append(region)
    claimed = set().union(*(ns.region.node_set for ns in found)) if found else set()
    misses += finder.unnormalised_iterations(live, claimed)
    return found, misses


def may_hold_newton_schulz(graph: torch.fx.Graph) -> bool:
    """Whether `find_newton_schulz` reports anything (a region or a near miss); cheap when there is no matmul."""
    if not any(n.op == "call_function" and n.target in MATMULS | ADD_MATMULS for n in graph.nodes):
        return False
    found, misses = find_newton_schulz(graph)
    return bool(found or misses)


# ---------------------------------------------------------------- the algebra


def _padd(p, q, wp=1.0, wq=1.0) -> tuple[float, ...]:
    n = max(len(p), len(q))
    p, q = list(p) + [0.0] * (n - len(p)), list(q) + [0.0] * (n - len(q))
    return tuple(wp * x + wq * y for x, y in zip(p, q))


def _pmul(p, q) -> tuple[float, ...]:
    out = [0.0] * (len(p) + len(q) - 1)
    for i, x in enumerate(p):
        for j, y in enumerate(q):
            out[i + j] += x * y
    return tuple(out)


def degree(p) -> int:
    return max((i for i, x in enumerate(p) if x != 0), default=-1)


# (kind of left, kind of right) -> (kind of product, whether it adds one power of G or H)
_PRODUCTS = {
    ("G", "G"): ("G", False), ("G", "L"): ("L", False), ("L", "LT"): ("G", True), ("LT", "L"): ("R", True),
    ("L", "R"): ("L", False), ("R", "LT"): ("LT", False), ("LT", "G"): ("LT", False), ("R", "R"): ("R", False),
}
_SWAP = {"L": "LT", "LT": "L", "G": "G", "R": "R"}  # the transpose of each kind (G and R are symmetric)


class _Algebra:
    """Abstract values of the nodes computed from one iterate X, keyed by logical alias."""

    def __init__(self, aliases: Aliases, x: Node) -> None:
        self.aliases = aliases
        alias = aliases.of(x)
        self.values = {alias.key(): ("L", (1.0,)), alias.transposed().key(): ("LT", (1.0,))}

    def value(self, node) -> tuple[str, tuple[float, ...]] | None:
        if not isinstance(node, Node):
            return None
        alias = self.aliases.of(node)
        found = self.values.get(alias.key())
        if found is not None:
            return found
        found = self.values.get(alias.transposed().key())
        return None if found is None else (_SWAP[found[0]], found[1])

    def set(self, node: Node, value) -> None:
        self.values[self.aliases.of(node).key()] = value

    def evaluate(self, node: Node):
        target, args, kwargs = node.target, node.args, node.kwargs
        if target in MATMULS:
            return _product(self.value(args[0]), self.value(args[1]))
        if target in ADD_MATMULS:
            product = _product(self.value(args[1]), self.value(args[2]))
            return _combine(self.value(args[0]), product, kwargs.get("beta", 1), kwargs.get("alpha", 1))
        if target in (aten.add.Tensor, aten.sub.Tensor) and all(isinstance(a, Node) for a in args[:2]):
            alpha = kwargs.get("alpha", 1) * (1 if target is aten.add.Tensor else -1)
            return _combine(self.value(args[0]), self.value(args[1]), 1, alpha)
        if target is aten.mul.Tensor:
            a, b = args[:2]
            if _is_number(b):
                return _scale(self.value(a), b)
            if _is_number(a):
                return _scale(self.value(b), a)
        if target is aten.div.Tensor and _is_number(args[1]):
            return _scale(self.value(args[0]), 1.0 / args[1])
        if target is aten.neg.default:
            return _scale(self.value(args[0]), -1.0)
        return None


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _product(a, b):
    if a is None or b is None or (a[0], b[0]) not in _PRODUCTS:
        return None
    kind, shift = _PRODUCTS[(a[0], b[0])]
    p = _pmul(a[1], b[1])
    return kind, ((0.0,) + p if shift else p)


def _combine(a, b, wa, wb):
    if a is None or b is None or a[0] != b[0] or not (_is_number(wa) and _is_number(wb)):
        return None
    return a[0], _padd(a[1], b[1], wa, wb)


def _scale(a, s):
    return None if a is None else (a[0], tuple(s * x for x in a[1]))


# ---------------------------------------------------------------- finding regions

_NORM_OPS = frozenset({
    aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim, aten.norm.Scalar, aten.pow.Tensor_Scalar,
    aten.mul.Tensor, aten.sum.dim_IntList, aten.sum.default, aten.sqrt.default, aten.rsqrt.default,
    aten.reciprocal.default, aten.add.Tensor, aten.clamp.default, aten.clamp_min.default, aten.maximum.default,
    aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.div.Tensor,
})
_SQUARE_SUMS = frozenset({aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim, aten.norm.Scalar})


def _is_two_norm(node: Node) -> bool:
    """linalg_vector_norm / norm of order 2 (their default)."""
    if node.target not in _SQUARE_SUMS:
        return False
    order = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", node.kwargs.get("p", 2))
    return order in (2, 2.0, None)


class _Finder:
    def __init__(self, graph: torch.fx.Graph, aliases: Aliases) -> None:
        self.aliases = aliases
        self.order = {n: i for i, n in enumerate(graph.nodes)}

    def normalisation(self, node: Node) -> Node | None:
        """Y when `node` is Y / s (or Y * 1/s) with s = ||Y||_F (+ eps, or clamped at eps)."""
        if node.op != "call_function" or node.target not in (aten.div.Tensor, aten.mul.Tensor):
            return None
        y, s = node.args[:2]
        vy, vs = fake_tensor(y), fake_tensor(s)
        if vy is None or vs is None or vy.dim() < 2:
            return None
        per_matrix = vs.numel() * vy.shape[-1] * vy.shape[-2] == vy.numel()
        if not per_matrix and tuple(vs.shape) != tuple(vy.shape):
            return None  # one scale per matrix: [], [1, 1], [k, 1, 1], or expanded to Y's shape
        scale_nodes = self._scale_region(s, self.aliases.of(y).root)
        if scale_nodes is None:
            return None
        if node.target is aten.mul.Tensor and not any(
                n.target in (aten.reciprocal.default, aten.rsqrt.default) for n in scale_nodes):
            return None
        return y

    def _scale_region(self, scale: Node, root: Node) -> list[Node] | None:
        """The nodes computing `scale` from the matrix (alias root `root`) when they are norm ops only."""
        nodes, stack, seen = [], [scale], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            value = fake_tensor(n)
            if value is not None and value.dim() >= 2 and self.aliases.of(n).root is root:
                continue  # reached the matrix (through views and casts)
            if n.op != "call_function" or not (n.target in _NORM_OPS or is_value_copy(n)):
                return None
            nodes.append(n)
            stack.extend(n.all_input_nodes)
        return nodes if self._frobenius(nodes) else None

    def _frobenius(self, nodes: list[Node]) -> bool:
        """The scale is a 2-norm: a norm op of order 2, or the square root of a sum of a value times itself."""
        if any(_is_two_norm(n) for n in nodes):
            return True
        roots = {n for n in nodes if n.target in (aten.sqrt.default, aten.rsqrt.default)
                 or (n.target is aten.pow.Tensor_Scalar and n.args[1] in (0.5, -0.5))}  # Inductor's sqrt
        sums = [n for n in nodes if n.target in (aten.sum.dim_IntList, aten.sum.default)]
        return bool(roots) and any(self._is_square(n.args[0]) for n in sums)

    def _is_square(self, node) -> bool:
        """x ** 2, or x * x with both factors the same value (through views and casts)."""
        if not isinstance(node, Node):
            return False
        if node.target is aten.pow.Tensor_Scalar:
            return node.args[1] == 2
        if node.target is aten.mul.Tensor and all(isinstance(a, Node) for a in node.args[:2]):
            a, b = (self.aliases.of(x).key() for x in node.args[:2])
            return a == b
        return False

    def region_from(self, normalised: Node, y: Node) -> NewtonSchulz | None:
        """The Newton-Schulz region starting at `normalised` (None: no step follows it)."""
        x, coefficients = normalised, []
        while (step := self.one_step(x)) is not None:
            x, p = step
            coefficients.append(tuple(round(c, 9) for c in p))
        if not coefficients:
            return None
        alias = self.aliases.of(y)
        if alias.is_transpose_view():
            matrix = self._matrix_node(y, True)
            if matrix is None:
                raise RegionError(f"{y.name} is a transposed view of no node in its input chain")
        elif 1 in alias.shape[-2:]:
            # A [n, 1] matrix transposed reads its elements in row-major order (no transpose view to see):
            # the tall-matrix transpose shows only as an earlier node that holds the transposed value.
            matrix = self._matrix_node(y, True) or y
        else:
            matrix = y
        region = closed_region(matrix, x)
        value = fake_tensor(matrix)
        rows, cols = int(value.shape[-2]), int(value.shape[-1])
        batch = math.prod(int(d) for d in value.shape[:-2])
        return NewtonSchulz(region, tuple(coefficients), rows, cols, batch)

    def _matrix_node(self, y: Node, transposed: bool) -> Node | None:
        """The node holding the matrix in the caller's orientation (before the tall-matrix transpose)."""
        if not transposed:
            return y
        want = self.aliases.of(y).transposed().key()
        node = y
        while isinstance(node, Node) and node.op == "call_function" and node.args and isinstance(node.args[0], Node):
            node = node.args[0]
            if self.aliases.of(node).key() == want:
                return node
        return None

    def one_step(self, x: Node) -> tuple[Node, tuple[float, ...]] | None:
        """(next iterate, coefficients) of the step that starts at iterate `x`, or None."""
        algebra = _Algebra(self.aliases, x)
        heap: list[tuple[int, Node]] = []
        queued: set[Node] = set()

        def push_users(n: Node) -> None:
            for user in n.users:
                if user not in queued:
                    queued.add(user)
                    heapq.heappush(heap, (self.order[user], user))

        push_users(x)
        best = None
        while heap:
            _, node = heapq.heappop(heap)
            if node.op != "call_function":
                continue
            if algebra.value(node) is not None:
                push_users(node)  # a view or copy of a known value
                continue
            value = algebra.evaluate(node)
            if value is None:
                if _moves_or_copies(node):
                    push_users(node)  # a reshape or write-back: reads of it may hold a known value (see aliases)
                continue
            algebra.set(node, value)
            push_users(node)
            kind, p = value
            if kind == "L" and degree(p) >= 1 and p[0] != 0:
                if self.gram_taken(node):
                    return node, p
                if best is None or degree(p) > degree(best[1]):
                    best = (node, p)
        return best

    def gram_taken(self, o: Node) -> bool:
        """Whether some mm / bmm multiplies `o` by its own transpose (X X^T, or X^T X)."""
        alias = self.aliases.of(o)
        mine, theirs = alias.key(), alias.transposed().key()
        for node in self._same_value(o):
            for user in node.users:
                if user.target in MATMULS and all(isinstance(a, Node) for a in user.args[:2]):
                    pair = (self.aliases.of(user.args[0]).key(), self.aliases.of(user.args[1]).key())
                    if pair in ((mine, theirs), (theirs, mine)):
                        return True
        return False

    def _same_value(self, o: Node) -> list[Node]:
        """`o` and the nodes reached from it through views and copies that hold it or its transpose."""
        alias = self.aliases.of(o)
        keys = {alias.key(), alias.transposed().key()}
        found, stack, seen = [], [o], {o}
        while stack:
            node = stack.pop()
            if self.aliases.of(node).key() in keys:
                found.append(node)
            for user in node.users:
                if user not in seen and _moves_or_copies(user):
                    seen.add(user)
                    stack.append(user)
        return found

    def unnormalised_iterations(self, live: set[Node], claimed: set[Node]) -> list[str]:
        """Grams X X^T followed by a polynomial step with no normalisation before them: near misses."""
        misses = []
        for node in self.order:
            if node in claimed or node not in live or node.target not in MATMULS:
                continue
            a, b = node.args[:2]
            if not (isinstance(a, Node) and isinstance(b, Node) and self.aliases.is_transpose_of(a, b)):
                continue
            x = a if not self.aliases.of(a).is_transpose_view() else b
            if self.one_step(x) is not None:
                misses.append(
                    f"{node.name}: {x.name} @ {x.name}.T followed by a polynomial step looks like Newton-Schulz, "
                    "but no Frobenius normalisation (x / (||x|| + eps), x / clamp(||x||, eps)) starts its chain")
        return misses


def _moves_or_copies(node: Node) -> bool:
    return node.op == "call_function" and (
        is_view(node) or is_value_copy(node) or is_cast(node)
        or node.target in (aten.slice_scatter.default, aten.copy.default, aten._unsafe_view.default))
