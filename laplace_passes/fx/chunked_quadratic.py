"""A chunked GLA written with no loop over its chunks, read back into the token-level GLA it computes.

NOTE [a chunked form without a loop]
transformers' Mamba-2 reference (`mamba2_chunk_scan`, which Bamba, Zamba2,
FalconH1, NemotronH and GraniteMoeHybrid share) computes every chunk at
once, the chunk index c a batch dimension of each tensor, with A_cum the
gates summed inside each chunk:

    Y_diag    = (C B^T (.) exp(segsum(A))) x          # per chunk: an intra-chunk quadratic form
    states    = (B * exp(A_cum[-1] - A_cum))^T x      # each chunk's own state
    entering  = exp(segsum over chunks) @ states      # the states entering each chunk (a quadratic form over chunks)
    y         = Y_diag + (C entering) * exp(A_cum)    # [b, c, l, h, p]

The intra-chunk part alone is a quadratic form (`laplace_passes.fx.quadratic`)
over C tokens, batched over the chunks. Where that form's output is added to
a term that reads the same queries (the off-diagonal blocks), the sum is
tried as GLA over all N C tokens: the form's q, k, v and gates with the
chunk index and the row merged into the tokens (chunk-major), its other
batch dimensions as before, a zero initial state. Which batch dimension is
the chunk index is not read off the ops: each is tried in turn and the
random-input check (`laplace_passes.fx.validate`) decides, as for every
recognised site. Then the same with a given initial state (Mamba-2's cache
passes one at prefill): a tensor the sum reads that reads none of the
form's sources and is no constant, with the state's sizes, in each order
its sizes allow (`_initial_states`, at most six tries). When none passes,
the intra-chunk form is rewritten alone.

Before: the graph above. After: one `laplace::gla` call over N C tokens,
re-tiled at the target's chunk (128 on trn2) whatever chunk the user chose;
the states between chunks and both parts' [.., C, C] tensors are gone. The
final state (`new_states[:, -1]`), where a caller reads it, is left as the
user's code computes it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import torch
import torch.fx

from laplace_passes.fx.algebra import Index
from laplace_passes.fx.per_step import constant_value
from laplace_passes.fx.quadratic import QuadraticForm
from laplace_passes.fx.token_loop import CHUNKS, ROW, TIME, RoleFactors
from laplace_passes.infra.fx_helpers import ancestors, fake_tensor
from laplace_passes.infra.op_facts import base_op_name

Node = torch.fx.Node


@dataclass
class ChunkedQuadratic(QuadraticForm):
    """An intra-chunk quadratic form plus the off-diagonal term added to it: GLA over chunks * rows tokens.

    `node` is the sum; `time` the row inside a chunk; `chunk` the chunk index, no longer a batch index.
    """

    chunk: Index | None = None
    positions: tuple = ()  # per dimension of the sum: CHUNKS, ROW, a batch or the value position, or None
    initial_order: tuple[int, ...] | None = None  # the initial state's dimensions: batch, key, value, size-1 ones

    @property
    def chunks(self) -> int:
        return self.chunk.size

    @property
    def rows(self) -> int:
        return self.time.size

    @property
    def T(self) -> int:
        return self.chunks * self.rows

    def output_positions(self) -> tuple:
        return self.positions

    def source_nodes(self) -> set[Node]:
        return super().source_nodes() | ({self.initial_state} if self.initial_state is not None else set())


def over_chunks(form: QuadraticForm) -> list[ChunkedQuadratic]:
    """The whole chunked forms `form` may be the diagonal part of, one per batch index that may be the chunk
    index (NOTE [a chunked form without a loop]); none when its output is not added to a term reading its
    queries."""
    total = _sum_with_off_diagonal(form)
    if total is None:
        return []
    wholes = [whole for chunk in form.batch if (whole := _with_chunk_index(form, total, chunk)) is not None]
    return wholes + [replace(whole, initial_state=node, initial_order=order)
                     for whole in wholes for node, order in _initial_states(whole)]


def _sum_with_off_diagonal(form: QuadraticForm) -> Node | None:
    """The node adding `form` to another term of its shape that reads the form's queries, or None."""
    shape = fake_tensor(form.node).shape
    queries = {n for f in form.roles.get("q", []) for n in f.nodes}
    for user in form.node.users:
        if base_op_name(user) not in ("add", "iadd") or len(user.args) != 2 or user.kwargs.get("alpha", 1) != 1:
            continue
        other = user.args[1] if user.args[0] is form.node else user.args[0]
        if not isinstance(other, Node) or other is form.node or fake_tensor(user).shape != shape:
            continue
        if queries and queries <= ancestors([other]):
            return user
    return None


def _with_chunk_index(form: QuadraticForm, total: Node, chunk: Index) -> ChunkedQuadratic | None:
    """`form` with `chunk` merged into its tokens, chunk-major: None when a factor reads only one of the two."""
    old = form.batch.index(chunk)

    def moved(position):
        if position == TIME:
            return ROW
        if position == old:
            return CHUNKS
        return position - 1 if isinstance(position, int) and position > old else position

    roles = {}
    for name, factors in form.roles.items():
        roles[name] = [RoleFactors(f.nodes, tuple(moved(p) for p in f.positions)) for f in factors]
        if any((CHUNKS in f.positions) != (ROW in f.positions) for f in roles[name]):
            return None
    positions = tuple(moved(p) for p in form.output_positions())
    if CHUNKS not in positions or ROW not in positions:
        return None
    return ChunkedQuadratic(total, form.expr, form.time, [b for b in form.batch if b is not chunk], form.key,
                            form.value, roles=roles, gate_kind=form.gate_kind, coefs=dict(form.coefs),
                            offset=form.offset, created=list(form.created), chunk=chunk, positions=positions)


def _initial_states(whole: ChunkedQuadratic, most: int = 6) -> list[tuple[Node, tuple[int, ...]]]:
    """Where the initial state may come from (a given state, as a Mamba-2 cache passes it), each with a layout:
    a tensor the sum reads that reads none of the form's sources, not a constant, with the state's sizes in
    some order. At most `most` of them, the random-input check trying each."""
    sources = whole.source_nodes()
    reads_a_source: set[Node] = set()
    for node in sorted(ancestors([whole.node]), key=_position(whole.node.graph)):
        if node in sources or any(i in reads_a_source for i in node.all_input_nodes):
            reads_a_source.add(node)
    found = []
    for node in sorted(reads_a_source, key=_position(whole.node.graph)):
        for given in node.all_input_nodes:
            if given in reads_a_source or constant_value(given) is not None:
                continue
            found += [(given, order) for order in _layouts(given, whole) if (given, order) not in found]
    return found[:most]


def _layouts(node: Node, whole: ChunkedQuadratic) -> list[tuple[int, ...]]:
    """Each way `node`'s dimensions of size > 1 can be the state's (batch, key, value), sizes matching."""
    value = fake_tensor(node)
    if value is None or not value.dtype.is_floating_point or value.numel() != math.prod(whole.state_shape):
        return []
    wide = [d for d, size in enumerate(value.shape) if size != 1]
    ones = [d for d, size in enumerate(value.shape) if size == 1]
    if 1 in whole.state_shape:  # a state dimension of size 1 has no dimension of its own to find
        return []
    return [(*dims, *ones) for dims in itertools.permutations(wide)
            if [value.shape[d] for d in dims] == list(whole.state_shape)]


def _position(graph: torch.fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def describe_over_chunks(whole: ChunkedQuadratic, as_quadratic: str) -> str:
    """The report's form, from `describe_quadratic`'s text for `whole` (its tokens and state are the whole's)."""
    return as_quadratic.replace("quadratic form (q k^T (.) D) v,", f"chunked form with no loop over its {whole.chunks} "
                                f"chunks of {whole.rows} tokens (quadratic forms inside chunks, states between "
                                "them),", 1)
