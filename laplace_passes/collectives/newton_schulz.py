"""Recognising Muon's Newton-Schulz iteration in an ATen graph.

What is matched (the quintic iteration of `torch.optim.Muon`, any coefficients,
one step or more), anchored on the normalisation:

    [x = _to_copy(input, dtype=bf16)]                # the cast, when the input is not bf16 yet
    [x = permute(x, [1, 0])]                         # tall matrices are transposed ...
    x = div(x, clamp(linalg_vector_norm(x), eps))    # Frobenius normalisation (or its decomposition)
    repeat `steps` times:
        gram = mm(x, permute(x, [1, 0]))
        gram_update = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, gram_update, x, beta=a)
    [x = permute(x, [1, 0])]                         # ... and transposed back

The region must be closed (nothing else flows in) and use the same (a, b, c)
in every step. A normalisation that no iteration follows is not Newton-Schulz
(models normalise matrices for other reasons): it is neither matched nor a
near miss. A normalisation followed by a broken iteration, or an
iteration-shaped `addmm(gram, gram, gram)` without the normalisation, is a
near miss: its reason goes to the report.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from laplace_passes.collectives.regions import Region, RegionError, closed_region, live_nodes, live_users
from laplace_passes.fx_helpers import fake_tensor
from laplace_passes.passes import Declined

aten = torch.ops.aten
Node = torch.fx.Node


@dataclass(frozen=True)
class NewtonSchulz:
    region: Region
    steps: int
    rows: int
    cols: int

    @property
    def flops(self) -> int:
        return newton_schulz_flops(self.rows, self.cols, self.steps)


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Matmul FLOPs of `steps` quintic iterations on a rows x cols matrix (the smaller side is m)."""
    m, n = min(rows, cols), max(rows, cols)
    # gram m x n @ n x m, gram @ gram, gram_update @ x
    return steps * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)


def find_newton_schulz(graph: torch.fx.Graph, live: set[Node] | None = None) -> tuple[list[NewtonSchulz], list[str]]:
    """Every Newton-Schulz region in `graph`, and the reasons for near misses (`live`: `live_nodes(graph)`)."""
    found: list[NewtonSchulz] = []
    near_misses: list[str] = []
    live = live_nodes(graph) if live is None else live
    for node in graph.nodes:
        if node not in live or not _starts_iteration(node):
            continue
        try:
            found.append(_match_from_normalisation(node, live))
        except Declined as miss:
            near_misses.append(str(miss))
    claimed = set().union(*(ns.region.node_set for ns in found)) if found else set()
    for node in graph.nodes:
        if node not in claimed and node in live and _is_gram_update(node):
            near_misses.append(
                f"{node.name}: addmm(gram, gram, gram) looks like a Newton-Schulz step, but no "
                "Frobenius normalisation div(x, clamp(linalg_vector_norm(x), eps)) starts its chain"
            )
    return found, near_misses


def may_hold_newton_schulz(graph: torch.fx.Graph) -> bool:
    """Whether `find_newton_schulz` would report anything (a region or a near miss), without matching.

    A normalisation followed by x @ x.T starts a region or a near miss; an
    addmm(gram, gram, gram) is either in a region or a near miss itself.
    """
    live = live_nodes(graph)
    return any(n in live and (_is_gram_update(n) or _starts_iteration(n)) for n in graph.nodes)


def _starts_iteration(node: Node) -> bool:
    """A Frobenius normalisation that an x @ x.T follows (a normalisation alone, x / ||x||, is no Newton-Schulz)."""
    return _gram_user(node) is not None and _normalisation_input(node) is not None


def _normalisation_input(node: Node) -> Node | None:
    """x when `node` is div(x, clamp(norm(x), min=eps)), else None.

    norm(x) is aten.linalg_vector_norm(x), or what decompositions make of it
    (inductor's: convert, pow 2, sum, pow 0.5; clamp_min for clamp).
    """
    if node.target is not aten.div.Tensor or not isinstance(node.args[1], Node):
        return None
    x, scale = node.args
    value, scale_value = fake_tensor(x), fake_tensor(scale)
    if value is None or value.dim() != 2 or scale_value is None or scale_value.dim() != 0:
        return None
    return x if _frobenius_clamp(x, scale) is not None else None


_NORM_OPS = {
    aten.linalg_vector_norm.default, aten.pow.Tensor_Scalar, aten.sum.dim_IntList, aten.sum.default,
    aten.sqrt.default, aten.mul.Tensor, aten._to_copy.default, torch.ops.prims.convert_element_type.default,
    aten.clamp.default, aten.clamp_min.default,
}


def _frobenius_clamp(x: Node, scale: Node) -> float | None:
    """eps when `scale` is a clamped Frobenius norm of `x` (and nothing else), else None."""
    try:
        region = closed_region(x, scale)
    except RegionError:
        return None
    targets = {n.target for n in region.nodes}
    if not targets <= _NORM_OPS:
        return None
    has_norm = aten.linalg_vector_norm.default in targets or (
        targets & {aten.sum.dim_IntList, aten.sum.default} and targets & {aten.pow.Tensor_Scalar, aten.mul.Tensor}
    )
    clamps = [n for n in region.nodes if n.target in (aten.clamp.default, aten.clamp_min.default)]
    if not has_norm or len(clamps) != 1 or len(clamps[0].args) != 2:
        return None
    return float(clamps[0].args[1])


def _match_from_normalisation(div: Node, live: set[Node]) -> NewtonSchulz:
    x0 = _normalisation_input(div)
    output, steps = _follow_iterations(div, live)
    transposed = _is_transpose(x0) and _transpose_user(output, live) is not None
    if transposed:
        output = _transpose_user(output, live)
        start = x0.args[0]
    else:
        start = x0
    if _is_cast(start) and len(live_users(start, live)) == 1:
        start = start.args[0]  # include the cast to bf16 in the region
    try:
        region = closed_region(start, output)
    except RegionError as error:
        raise Declined(f"{div.name}: Newton-Schulz normalisation found, but the region is not closed: {error}")
    rows, cols = fake_tensor(start).shape
    return NewtonSchulz(region, steps, int(rows), int(cols))


def _follow_iterations(x: Node, live: set[Node]) -> tuple[Node, int]:
    """The last step's output and the number of steps (each with the first step's coefficients)."""
    steps, coefficients = 0, None
    while (gram := _gram_user(x)) is not None:
        update = _single_user(gram, live)
        if update is None or not _is_gram_update(update):
            raise Declined(
                f"{gram.name}: Newton-Schulz step {steps + 1} computes x @ x.T but is not followed by "
                "a single addmm(gram, gram, gram, beta=b, alpha=c)"
            )
        nxt = _single_user(update, live)
        if nxt is None or not _is_step_output(nxt, x, update):
            raise Declined(
                f"{update.name}: Newton-Schulz step {steps + 1} is not completed by addmm(x, gram_update, x, beta=a)"
            )
        abc = (float(nxt.kwargs["beta"]), float(update.kwargs["beta"]), float(update.kwargs["alpha"]))
        if coefficients is not None and abc != coefficients:
            raise Declined(f"{nxt.name}: Newton-Schulz step {steps + 1} uses coefficients {abc}, earlier steps {coefficients}")
        coefficients = abc
        steps += 1
        x = nxt
    return x, steps


def _is_cast(node: Node) -> bool:
    if node.target is aten._to_copy.default:
        return set(node.kwargs) == {"dtype"}
    return node.target is torch.ops.prims.convert_element_type.default


def _gram_user(x: Node) -> Node | None:
    for user in x.users:
        if user.target is aten.mm.default and user.args[0] is x:
            other = user.args[1]
            if isinstance(other, Node) and _is_transpose(other) and other.args[0] is x:
                return user
    return None


def _is_gram_update(node: Node) -> bool:
    if node.target is not aten.addmm.default or set(node.kwargs) != {"beta", "alpha"}:
        return False
    gram = node.args[0]
    return len(node.args) == 3 and all(a is gram for a in node.args) and gram.target is aten.mm.default


def _is_step_output(node: Node, x: Node, update: Node) -> bool:
    return (
        node.target is aten.addmm.default
        and node.args == (x, update, x)
        and set(node.kwargs) == {"beta"}
    )


def _is_transpose(node: Node) -> bool:
    if node.target is aten.permute.default:
        return list(node.args[1]) == [1, 0]
    return node.target in (aten.t.default,) or (
        node.target is aten.transpose.int and sorted(node.args[1:3]) in ([0, 1], [-2, -1], [-1, 0], [-2, 1])
    )


def _transpose_user(x: Node, live: set[Node]) -> Node | None:
    users = live_users(x, live)
    return users[0] if len(users) == 1 and _is_transpose(users[0]) and users[0].args[0] is x else None


def _single_user(node: Node, live: set[Node]) -> Node | None:
    users = live_users(node, live)
    return users[0] if len(users) == 1 else None
