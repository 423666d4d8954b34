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
the intra-chunk form is rewritten alone, its row saying why the whole was not.

What the check cannot see is read off the graph instead (`_why_not_whole`):
it runs forward, so a term between chunks that passes no gradient (a
`detach`, truncated backpropagation; an op under `no_grad`) keeps the sum
from being taken whole; in bf16 its tolerance (4e-2) would take a term
scaled by 0.9 for rounding, so only a sum computed in float32 is (Mamba-2's
reference computes in float32 whatever its inputs). Its random gates leave
nothing of a state after some 20 tokens, so each candidate is checked a
second time with gates whose decay over all T tokens stays above exp(-1),
log-gates and decays alike (`with_weak_gates`): a state that skips a chunk
is seen at chunks of 256. Only the ops between the form's sources and the
sum count here: a given initial state detached or kept in bf16 before the
scan casts it is the state GLA reads as it is.
An in-place sum (`y = intra; y += inter`) is taken only where nothing else
reads the form, since another name for it holds the sum too.

Before: the graph above. After: one `laplace::gla` call over N C tokens,
re-tiled at the target's chunk (128 on trn2) whatever chunk the user chose;
the states between chunks and both parts' [.., C, C] tensors are gone. The
final state (`new_states[:, -1]`), where a caller reads it, is left as the
user's code computes it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import torch
import torch.fx

from laplace_passes.fx.algebra import Index
from laplace_passes.fx.per_step import constant_value
from laplace_passes.fx.quadratic import QuadraticForm, gate_words
from laplace_passes.fx.token_loop import CHUNKS, ROW, TIME, RoleFactors
from laplace_passes.fx.validate import GATE_RANGES, graph_order, reading_region
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
    gate_ranges: dict = field(default_factory=lambda: dict(GATE_RANGES))  # where the random check draws gates

    def with_weak_gates(self) -> ChunkedQuadratic:
        """The same plan, checked with gates whose decay over all T tokens stays above exp(-1): the random-input
        check's default gates leave nothing of a state after some 20 tokens, so it could not see the terms
        between chunks of Mamba-2's 256 tokens."""
        weak = (-1.0 / self.T, -0.1 / self.T)
        return replace(self, gate_ranges={"log": weak, "decay": (math.exp(weak[0]), math.exp(weak[1]))})

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


def over_chunks(form: QuadraticForm) -> tuple[list[ChunkedQuadratic], str]:
    """The whole chunked forms `form` may be the diagonal part of, each to be checked on random inputs (NOTE [a
    chunked form without a loop]): one per batch index that may be the chunk index, the likeliest first, then
    each with a given initial state; and, when there are none, why not ("" when nothing adds to the form)."""
    total = _sum_with_off_diagonal(form)
    if total is None:
        return [], ""
    why_not = _why_not_whole(form, total)
    if why_not:
        return [], why_not
    wholes = [whole for chunk in _likeliest_chunk_first(form)
              if (whole := _with_chunk_index(form, total, chunk)) is not None]
    return wholes + [replace(whole, initial_state=node, initial_order=order)
                     for whole in wholes for node, order in _initial_states(whole)], ""


def _sum_with_off_diagonal(form: QuadraticForm) -> Node | None:
    """The node adding `form` to another term that reads the form's queries (the sum of `form`'s shape), or
    None. In place (`y += inter`) only where nothing else reads the form: another name for it would see the sum."""
    shape = fake_tensor(form.node).shape
    queries = {n for f in form.roles.get("q", []) for n in f.nodes}
    for user in form.node.users:
        name = base_op_name(user)
        if name not in ("add", "iadd") or len(user.args) != 2 or user.kwargs.get("alpha", 1) != 1:
            continue
        if name == "iadd" and len(form.node.users) > 1:
            continue
        other = user.args[1] if user.args[0] is form.node else user.args[0]
        if not isinstance(other, Node) or other is form.node or fake_tensor(user).shape != shape:
            continue
        if queries and queries <= ancestors([other]):
            return user
    return None


# Ops after which a value passes no gradient back: a sum computed through one is not GLA's gradients, though
# its values are (the random-input check runs forward only).
_GRADIENT_STOPS = frozenset({"detach", "detach_"})


def _why_not_whole(form: QuadraticForm, total: Node) -> str:
    """Why the sum is not taken whole whatever the check says, or "": what a forward check cannot see."""
    region = reading_region([total], form.source_nodes())  # a given initial state's own ops are not the sum's
    stop = next((n for n in region if base_op_name(n) in _GRADIENT_STOPS or _stops_gradients(n)), None)
    if stop is not None:
        return (f"the term it is added to reads the inputs through {base_op_name(stop)} ({stop.name}), which "
                "passes no gradient; GLA's would")
    narrow = next((n for n in region if (v := fake_tensor(n)) is not None and v.dtype in (torch.bfloat16,
                                                                                        torch.float16)), None)
    if narrow is not None:
        return (f"it computes in {fake_tensor(narrow).dtype} ({narrow.name}), where the random-input check's "
                "tolerance could not tell a wrong term between chunks from rounding")
    return ""


# Ops whose value does not depend on their input's values: no gradient to stop (a zero state built like one).
_FILLS_LIKE = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
                         "new_full", "rand_like", "randn_like"})


def _stops_gradients(node: Node) -> bool:
    """A float value traced without requires_grad from one that has it (a detach, an op under no_grad)."""
    value = fake_tensor(node)
    if not isinstance(value, torch.Tensor) or value.requires_grad or not value.dtype.is_floating_point:
        return False
    if base_op_name(node) in _FILLS_LIKE:
        return False
    return any(isinstance(v := fake_tensor(i), torch.Tensor) and v.requires_grad for i in node.all_input_nodes)


def _likeliest_chunk_first(form: QuadraticForm) -> list[Index]:
    """The form's batch indices, the one just before the query position in q's layout (chunks then rows, as
    a [B, T] tensor reshaped to [B, N, C] has them) first: each candidate costs a random-input check."""
    ahead = []
    for factor in form.roles.get("q", [])[:1]:
        if TIME in factor.positions and factor.positions.index(TIME) > 0:
            before = factor.positions[factor.positions.index(TIME) - 1]
            ahead = [form.batch[before]] if isinstance(before, int) and before < len(form.batch) else []
    return ahead + [b for b in form.batch if b not in ahead]


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
    reads_a_source = sources | reading_region([whole.node], sources)
    found = []
    for node in sorted(reads_a_source, key=graph_order(whole.node.graph)):
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


def describe_over_chunks(whole: ChunkedQuadratic) -> str:
    """The report's form: the chunks the user wrote, the tokens in all, the gates, the state."""
    return (f"chunked form with no loop over its {whole.chunks} chunks of {whole.rows} tokens (quadratic forms "
            f"inside chunks, states between them), {whole.T} tokens, {gate_words(whole)}, "
            f"state {list(whole.state_shape)}")
