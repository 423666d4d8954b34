"""A user's own chunked GLA, at any chunk size, read back into the token-level GLA it computes.

NOTE [a user's chunked algorithm]
A team that wrote the chunked algorithm itself (fla's `naive_chunk_simple_gla`
is the usual model) has, per chunk n of C tokens, with G = the gates summed
cumulatively inside each chunk:

    o[:, :, n] = (q_n * exp(G_n)) @ S + (q_n k_n^T (.) L_n) @ v_n            # written into a buffer
    S = S * exp(G_n[-1]) + (k_n * exp(G_n[-1] - G_n))^T @ v_n

In the canonical form each update sums over the chunk's rows (`Step.rows`),
and each chunk's output reads the state entering the chunk. That is GLA over
the T = N C tokens: q, k, v are the chunked tensors read back in token order
(the chunk and row dimensions merged), the gates are what the cumulative sum
adds up, the initial state is the chain's first. `plan_chunk_loop` builds
that hypothesis from the chain; the random-input check (`validate`) decides
whether it holds. The rewrite is one GLA call, which the re-tiling pass then
cuts at the target's own chunk (128 on trn2), whatever C the user chose.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from laplace_passes.fx.aggregates import Aggregate, find_aggregate
from laplace_passes.fx.algebra import Expr, Index, NotAlgebraic, read
from laplace_passes.fx.per_step import step_index
from laplace_passes.fx.steps import Chain
from laplace_passes.fx.token_loop import CHUNKS, ROW, TIME, RoleFactors, _is_zero_fill
from laplace_passes.infra.fx_helpers import ancestors, fake_tensor
from laplace_passes.infra.pass_base import Declined

Node = torch.fx.Node
MAX_OUTPUT_DEPTH = 6  # ops from the state entering a chunk to that chunk's output


@dataclass
class ChunkLoop:
    chain: Chain
    chunks: int
    rows: int
    state_shape: tuple[int, ...]
    key_axis: int
    value_axis: int
    outputs: list[Node]  # each chunk's output, in order
    output_positions: tuple  # per dimension of an output: ROW, a batch / the value position, or None
    aggregate: Aggregate | None
    roles: dict[str, list[RoleFactors]] = field(default_factory=dict)
    coefs: dict[str, float] = field(default_factory=dict)
    initial_state: Node | None = None
    offset: int = 0
    form: str = ""

    @property
    def T(self) -> int:
        return self.chunks * self.rows

    @property
    def like(self) -> Node:
        return self.chain.last.node

    @property
    def batch_axes(self) -> list[int]:
        return [p for p in range(len(self.state_shape)) if p not in (self.key_axis, self.value_axis)]

    def gate_factors(self):
        return ("log", self.roles["decay"]) if self.roles.get("decay") else ("none", [])

    def gate_sources(self) -> dict[str, set[Node]]:
        return {"log": {n for f in self.roles.get("decay", []) for n in f.nodes}}

    def source_nodes(self) -> set[Node]:
        nodes = {n for factors in self.roles.values() for f in factors for n in f.nodes}
        return nodes | ({self.initial_state} if self.initial_state is not None else set())

    def results(self, steps: int) -> list[Node]:
        return [*self.outputs, self.chain.last.node]

    def gla_results(self, builder, old: list[Node], target) -> list[Node]:
        o, state = builder.gla(self.form or "validation", target=target)
        over = builder.outputs_over_steps(o)
        found = []
        for n, like in enumerate(old[:-1]):
            rows = builder.call(torch.narrow, over, 0, n * self.rows, self.rows)
            positions = tuple(TIME if p == ROW else p for p in self.output_positions)
            found.append(builder.laid_out_whole(rows, positions, like))
        return found + [builder.final_state(state, old[-1])]


def plan_chunk_loop(chain: Chain, memo: dict) -> ChunkLoop:
    first = chain.first
    rows = first.rows.size
    key_axis, value_axis = first.key_axis % len(first.shape), first.value_axis % len(first.shape)
    if first.prev is None:
        # The first chunk's state is its own product (no S_0 and no zeros): its output reads no state, so the
        # form of o_n = q_n . S_{n-1} + ... cannot be read off it.
        raise Declined("its first chunk starts without a state (no S_0 = 0 or initial state to read o_1 against)")
    entering = [first.prev] + [s.node for s in chain.steps[:-1]]
    outputs = [_chunk_output(state, step.node) for state, step in zip(entering, chain.steps)]
    if any(o is None for o in outputs):
        raise Declined("no output of each chunk reads the state entering it (o_n = q_n . S_{n-1} + ...)")
    nodes = [node for node, _ in outputs]
    loop = ChunkLoop(chain, len(chain.steps), rows, first.shape, key_axis, value_axis, nodes, (),
                     find_aggregate(nodes))
    inter = outputs[0][1]
    loop.output_positions = _positions(inter.axes, first, inter, rows_index=_rows_of(inter, rows))
    gate = _gate_source(first)
    loop.roles["decay"] = [gate]
    cumsum = gate.nodes[0]
    loop.roles["q"] = [_token_factor(inter, first, exclude=cumsum)]
    loop.roles["k"] = [_step_token_factor(first, first.keys, cumsum, "k")]
    loop.roles["v"] = [_step_token_factor(first, first.values, cumsum, "v")]
    scale = [t.coef for t in inter.terms if any(f.node is entering[0] for f in t.factors)]
    loop.coefs = {"input": first.input_coef, "decay": 1.0, "scale": scale[0], "initial": 1.0}
    prev = first.prev
    loop.initial_state = None if prev is None or _is_zero_fill(prev) else prev
    return loop


def _chunk_output(state: Node, update: Node):
    """The node written out for a chunk that reads `state` (the state entering it), and its form."""
    frontier, seen = [(u, 1) for u in state.users if u is not update], set()
    while frontier:
        node, depth = frontier.pop(0)
        if node in seen or node.op == "output" or depth > MAX_OUTPUT_DEPTH:
            continue
        seen.add(node)
        if _gathered(node):
            try:
                return node, read(node, lambda n: n is state, {})
            except NotAlgebraic:
                return None
        frontier += [(u, depth + 1) for u in node.users]
    return None


def _gathered(node: Node) -> bool:
    """A value written into a buffer, stacked or concatenated: the chunk's output as the user keeps it."""
    import operator

    for user in node.users:
        name = getattr(user.target, "__name__", user.target)
        if user.target is operator.setitem and user.args[2] is node:
            return True
        if name in ("stack", "cat", "index_copy"):
            return True
    return False


def _rows_of(expr: Expr, rows: int) -> Index:
    found = [a for a in expr.axes if a is not None and a.size == rows]
    if not found:
        raise Declined("a chunk's output has no dimension of the chunk's rows")
    return found[0]


def _positions(axes: tuple, step, expr: Expr, rows_index: Index) -> tuple:
    """Where each dimension of a chunk's output sits: its rows, a batch or the value dimension of the state."""
    (term,) = [t for t in expr.terms if any(f.node is step.prev for f in t.factors)] or [None]
    if term is None:
        raise Declined("no term of a chunk's output reads the state")
    state_axes = next(f.axes for f in term.factors if f.node is step.prev)
    where = {a: p for p, a in enumerate(state_axes) if a is not None} | {rows_index: ROW}
    if any(a is not None and a not in where for a in axes):
        raise Declined("a chunk's output has a dimension that is neither its rows nor the state's")
    return tuple(where.get(a) if a is not None else None for a in axes)


def _gate_source(step) -> RoleFactors:
    """The gates: what a cumulative sum over the chunk's rows adds up, read by the update's decay."""
    frontier = [f.node for f in step.decay]
    for _ in range(MAX_OUTPUT_DEPTH):
        for node in frontier:
            if getattr(node.target, "__name__", node.target) == "cumsum" and isinstance(node.args[0], Node):
                return _gate_layout(node.args[0], node, step)
        frontier = [i for n in frontier for i in n.all_input_nodes]
    raise Declined("its decay is not built from a cumulative sum of gates over the chunk's rows")


def _gate_layout(gates: Node, cumsum: Node, step) -> RoleFactors:
    """The gates' dimensions: [*batch, chunks, rows] or [*batch, chunks, rows, key], in the state's batch order."""
    value = fake_tensor(gates)
    dim = cumsum.args[1] if len(cumsum.args) > 1 else cumsum.kwargs["dim"]
    dim %= value.dim()
    positions = [None] * value.dim()
    positions[dim], positions[dim - 1] = ROW, CHUNKS
    batch = [p for p in range(len(step.shape)) if p not in (step.key_axis % len(step.shape),
                                                             step.value_axis % len(step.shape))]
    rest = [d for d in range(value.dim()) if d not in (dim, dim - 1)]
    if len(rest) == len(batch) + 1:
        positions[rest[-1]] = step.key_axis % len(step.shape)
        rest = rest[:-1]
    if value.dim() < len(batch) + 2 or [value.shape[d] for d in rest] != [step.shape[p] for p in batch]:
        raise Declined(f"its gates ({list(value.shape)}, summed over dimension {dim}) are not laid out "
                       "[*batch, chunks, rows(, key)] like its state: the pass reads a chunked algorithm whose "
                       "inputs are reshaped into chunks (g.view(B, H, T // C, C, K)[:, :, n], as fla's "
                       "naive_chunk_simple_gla), not one that slices each chunk out of the sequence "
                       "(g[:, :, i:i + C])")
    for d, p in zip(rest, batch):
        positions[d] = p
    return RoleFactors([gates], tuple(positions))


def _token_factor(expr: Expr, step, exclude: Node) -> RoleFactors:
    """q in token order: the chunked tensor the inter-chunk readout takes each chunk's queries from."""
    (term,) = [t for t in expr.terms if any(f.node is step.prev for f in t.factors)]
    state_axes = next(f.axes for f in term.factors if f.node is step.prev)
    rows_index = _rows_of(expr, step.rows.size)
    where = {a: p for p, a in enumerate(state_axes) if a is not None} | {rows_index: ROW}
    return _chunked_source([f for f in term.factors if f.node is not step.prev], where, exclude, "q")


def _step_token_factor(step, factors, exclude: Node, role: str) -> RoleFactors:
    where = {a: p for p, a in enumerate(step.expr.axes) if a is not None} | {step.rows: ROW}
    return _chunked_source(list(factors), where, exclude, role)


def _chunked_source(factors, where: dict, exclude: Node, role: str) -> RoleFactors:
    """The one factor read at the chunk's position from a chunked tensor, the gate weights (read from the
    cumulative sum) left out: that tensor, its chunk dimension CHUNKS and the others where they sit."""
    plain = [f for f in factors if exclude not in ancestors([f.node])]
    if len(plain) != 1:
        raise Declined(f"its {role} is not one chunked tensor read at the chunk's position")
    (factor,) = plain
    memo: dict = {}
    index = step_index(factor.node, memo)
    if index is None:
        raise Declined(f"its {role} is not read at the chunk's position of one chunked tensor")
    base, kind = index.key[1], index.key[0]
    value = fake_tensor(base)
    if kind != "select" and kind != "index":
        raise Declined(f"its {role} is read from its chunked tensor in a way this pass does not read back")
    dim = _indexed_dim(factor.node, index)
    slice_positions = [where.get(a) if a is not None else None for a in factor.axes]
    positions = slice_positions[:dim] + [CHUNKS] + slice_positions[dim:]
    if len(positions) != value.dim():
        raise Declined(f"its {role} is read with extra dimensions inserted")
    return RoleFactors([base], tuple(positions))


def _indexed_dim(node: Node, index) -> int:
    if index.key[0] == "select":
        return index.key[2]
    from laplace_passes.fx.per_step import source_dim

    items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    position = next(i for i, item in enumerate(items) if isinstance(item, int) and not isinstance(item, bool))
    return source_dim(items, position, fake_tensor(node.args[0]).dim())


def describe_chunks(loop: ChunkLoop, origin: str) -> str:
    per = "per-key" if any(loop.key_axis in f.positions for f in loop.roles.get("decay", [])) else "per-head"
    return (f"{origin} over chunks: {loop.chunks} chunks of {loop.rows} tokens ({loop.T} tokens), {per} gates, "
            f"state {list(loop.state_shape)}")
