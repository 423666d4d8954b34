"""The recognition pass: GLA written in plain PyTorch, found by what it computes, becomes a `laplace::gla` site.

A model that never heard of this project writes GLA from the equations: a
loop over tokens (a Python loop Dynamo unrolls, `scan`, `while_loop`; the
unroll pass runs first and makes the last two straight-line code too), in
whatever spelling (elementwise products and `.sum`, `einsum`, `matmul`,
`outer`, `[..., None]`), with its own layout, scale, gates (per key, one per
head, a fixed decay, none) and initial state. This pass finds every chain of
state updates S_t = a_t (.) S_{t-1} + k_t (x) v_t with readouts q_t . S_t
(`laplace_passes.fx.recurrence`, on the canonical form of NOTE [canonical
tensor algebra]), checks that its steps are one computation over positions
(`laplace_passes.fx.token_loop`), checks the rewrite on random inputs
(`laplace_passes.fx.validate`) and replaces the loop by one GLA call
(NOTE [recognised loop: before and after] in `laplace_passes.fx.gla_build`),
which the re-tiling pass then re-tiles like any other site.

Every loop that carries a state is a row of the report's "recurrences"
table: a GLA site, with how it was written, or declined with what does not
match ("a 256-step loop carrying a [2, 4, 16, 16] state, but its update adds
2 terms besides the decayed state ...") and the graph left unchanged.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from laplace_passes.fx.aggregates import Aggregate, find_aggregate
from laplace_passes.fx.algebra import writes_a_temporary
from laplace_passes.fx.chunk_loop import ChunkLoop, describe_chunks, plan_chunk_loop
from laplace_passes.fx.chunked_quadratic import ChunkedQuadratic, describe_over_chunks, over_chunks
from laplace_passes.fx.gate_bounds import gate_bound
from laplace_passes.fx.gla_build import GlaBuilder
from laplace_passes.fx.in_place_statements import read_through_in_place_statements
from laplace_passes.fx.in_place_writes import written_from_outside, written_while_read
from laplace_passes.fx.token_loop import CHUNKS, ROW, TIME
from laplace_passes.fx.quadratic import QuadraticForm, describe_quadratic, find_quadratic_forms
from laplace_passes.fx.recurrence import find_chains
from laplace_passes.fx.steps import Chain
from laplace_passes.fx.token_loop import TokenLoop, describe, plan_token_loop
from laplace_passes.fx.unread_loops import in_place_state_rows, symbolic_size_hint
from laplace_passes.fx.validate import check_on_random_inputs
from laplace_passes.infra.fx_helpers import ancestors, fake_tensor, graph_and_run_once_bodies
from laplace_passes.infra.pass_base import Declined, GraphPass, PassResult
from laplace_passes.infra.report import RecurrenceRecord
from laplace_passes.infra.strict import strict_mode

Node = torch.fx.Node
aten = torch.ops.aten

VALIDATION_STEPS = 8  # steps of a loop run beside its GLA call before it is rewritten


class RecogniseGLA(GraphPass):
    """Replace each token loop that computes GLA by one `laplace::gla` node; report every state-carrying loop."""

    name = "recognise_gla"

    def __init__(self, min_steps: int = 2, validation_steps: int = VALIDATION_STEPS,
                 checks_become_clamps: bool = False) -> None:
        self.min_steps = min_steps
        self.validation_steps = validation_steps
        # An inner compiler that lowers: a token loop whose gates are not proven <= 0 is kept as written (NOTE
        # [unproven gates of a recognised loop] in `laplace_passes.fx.retile`).
        self.checks_become_clamps = checks_become_clamps

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        records, moved = [], 0
        # The graph and the bodies it calls once (activation checkpointing): NOTE [run-once bodies].
        for where, graph_module in graph_and_run_once_bodies(gm):
            moved += read_through_in_place_statements(graph_module.graph)  # NOTE [reads after an in-place ...]
            found_here = self._recognise_in(graph_module)
            for record in found_here:
                record.node = where + record.node
            records += found_here
        found = sum(r.status == "GLA site" for r in records)
        declined = [f"{r.node}: {r.reason}" for r in records if r.status == "declined"]
        summary = f"{found} of {len(records)} loops carrying a state rewritten as GLA sites"
        # A loop of symbolic sizes may not even be found (no row): said whenever none was rewritten.
        if not found and (hint := symbolic_size_hint(gm)):
            summary += f"; a loop whose state has symbolic sizes is not read as one{hint}"
        return PassResult(gm, modified=found > 0 or moved > 0, summary=summary, declined=declined,
                          recurrences=records)

    def _recognise_in(self, gm: torch.fx.GraphModule) -> list[RecurrenceRecord]:
        """A record for each loop carrying a state in `gm`'s own graph, each one rewritten or declined."""
        chains = find_chains(gm.graph, self.min_steps)
        # Found before any rewrite changes the graph: loops no chain follows, so that they still get a row.
        records = in_place_state_rows(gm.graph, {s.node for c in chains for s in c.steps}, self.min_steps)
        hint = symbolic_size_hint(gm)
        for chain in chains:
            records.append(self._rewrite(gm, chain))
        for form in find_quadratic_forms(gm.graph):
            records.append(_rewrite_quadratic(gm, form))
        for record in records:
            if record.status == "declined" and hint:
                record.reason += hint
        return records

    def _rewrite(self, gm: torch.fx.GraphModule, chain: Chain) -> RecurrenceRecord:
        shape = list(chain.first.shape)
        record = RecurrenceRecord("", chain.first.node.name, chain.tokens, shape, "declined")
        memo: dict = {}
        try:
            if chain.mismatch:
                raise Declined(chain.mismatch)
            if chain.first.rows is not None:
                chunked = plan_chunk_loop(chain, memo)
                record.steps = chunked.T
                record.form = chunked.form = describe_chunks(chunked, _written_as(chain))
                check_on_random_inputs(gm, chunked, memo, chunked.T)
                _replace_chunks(gm, chunked, memo)
                record.status = "GLA site"
                return record
            loop = plan_token_loop(chain, memo)
            record.form = describe(loop, _written_as(chain))
            check_on_random_inputs(gm, loop, memo, min(loop.T, self.validation_steps))
            _replace(gm, loop, memo, record.form, self.checks_become_clamps)
            if chain.unlinked:  # `steps` counts the user's loop; the site, and so its form, the steps after these
                record.form += "; " + _steps_as_written(chain)
        except Declined as declined:
            record.reason = f"a {chain.tokens}-step loop carrying a {shape} state, but {declined.reason}"
            return record
        except Exception as error:  # noqa: BLE001 (a pass never breaks a user's compile: it declines)
            if strict_mode():  # NOTE [a failing pass declines]: the suite finds such failures
                raise
            record.reason = (f"a {chain.tokens}-step loop carrying a {shape} state, left alone after an "
                             f"internal error while rewriting it: {type(error).__name__}: {error}")
            return record
        record.status = "GLA site"
        return record


def _steps_as_written(chain: Chain) -> str:
    """The steps before a site's first, which stay as written (`Chain.unlinked`)."""
    if chain.unlinked == 1:
        return f"the loop's first step ({chain.first.prev.name}) is not part of it and runs as written"
    return (f"the loop's first {chain.unlinked} steps (up to {chain.first.prev.name}) are not part of it and run "
            "as written")


def _rewrite_quadratic(gm: torch.fx.GraphModule, form: QuadraticForm | tuple) -> RecurrenceRecord:
    if isinstance(form, tuple):
        node, reason = form
        shape = list(fake_tensor(node).shape)
        return RecurrenceRecord("", node.name, 0, shape, "declined",
                                reason=f"a quadratic form (q k^T (.) D) v of shape {shape}, but {reason}")
    record = RecurrenceRecord("", form.node.name, form.T, list(form.state_shape), "declined")
    try:
        _check_not_written_from_outside(form)
        whole, why_not_whole = _over_chunks(gm, form)
        if whole is not None:  # NOTE [a chunked form without a loop]: already checked on random inputs
            _check_not_written_from_outside(whole)
            record = RecurrenceRecord("", whole.node.name, whole.T, list(whole.state_shape), "declined",
                                      form=whole.form)
            form = whole
        else:
            record.form = form.form = describe_quadratic(form)
            if why_not_whole:  # the row says what stays as written around the site
                record.form += f"; not taken whole with the term added to it, since {why_not_whole}"
            check_on_random_inputs(gm, form, {}, form.T)
        _replace_whole(gm, form)
    except Declined as declined:
        record.reason = f"a quadratic form over {form.T} tokens, but {declined.reason}"
        _erase_unused(gm.graph, set(form.created))
        return record
    except Exception as error:  # noqa: BLE001 (a pass never breaks a user's compile: it declines)
        if strict_mode():
            raise
        record.reason = (f"a quadratic form over {form.T} tokens, left alone after an internal error while "
                         f"rewriting it: {type(error).__name__}: {error}")
        _erase_unused(gm.graph, set(form.created))
        return record
    record.status = "GLA site"
    return record


def _check_not_written_from_outside(form: QuadraticForm) -> None:
    """The GLA call reads the form's sources where its result is first read: a source written in place while the
    form reads it is declined first. The rest of a form is read from how its values are built; a mask, decay or
    operand written in place after that is not seen, by the reading or by the random-input check (which
    evaluates the form's ancestors only)."""
    region = _rewritten_region([form.node], form)
    _check_sources_unchanged(form, region, next(n for n in form.node.graph.nodes if n in form.node.users))
    written = written_from_outside(region, form.node, form.source_nodes())
    if written is not None:
        raise Declined(f"{written}: the form is read from how its values are built, so a mask, decay or operand "
                       "changed in place after it is built is not seen; write the change as a new value "
                       "(torch.where, masked_fill)")


def _over_chunks(gm: torch.fx.GraphModule, form: QuadraticForm) -> tuple[ChunkedQuadratic | None, str]:
    """The whole chunked form an intra-chunk `form` is part of (NOTE [a chunked form without a loop]): the first
    candidate that passes the random-input check with the usual gates and with weak ones; or None (the form is
    then rewritten alone) and why."""
    candidates, why_not = over_chunks(form)
    for whole in candidates:
        whole.form = describe_over_chunks(whole)
        try:
            check_on_random_inputs(gm, whole, {}, whole.T)
            check_on_random_inputs(gm, whole.with_weak_gates(), {}, whole.T)
        except Declined as declined:
            why_not = why_not or declined.reason
            continue
        except Exception as error:  # noqa: BLE001 (a pass never breaks a user's compile: it declines)
            if strict_mode():
                raise
            why_not = why_not or f"an internal error while checking it: {type(error).__name__}: {error}"
            continue
        return whole, ""
    return None, why_not


def _rewritten_region(outputs: list, computation) -> set:
    """What a rewrite of `outputs` replaces: their ancestors, less the sources the GLA site reads and theirs."""
    return ancestors(outputs) - ancestors(list(computation.source_nodes()))


def _replace_whole(gm: torch.fx.GraphModule, form: QuadraticForm) -> None:
    region = _rewritten_region([form.node], form)
    anchor = next(n for n in gm.graph.nodes if n in form.node.users)
    with gm.graph.inserting_before(anchor):
        builder = GlaBuilder(gm.graph, form, form.T, {})
        o, _ = builder.gla(form.form)
        form.node.replace_all_uses_with(
            builder.laid_out_whole(builder.outputs_over_steps(o), form.output_positions(), form.node))
    _erase_unused(gm.graph, region)


def _replace_chunks(gm: torch.fx.GraphModule, loop: ChunkLoop, memo: dict) -> None:
    old = [*loop.outputs, loop.chain.last.node]
    region = _rewritten_region(old, loop)
    anchor = _anchor(gm.graph, old, region, loop.aggregate)
    _check_sources_before(gm.graph, loop, region, anchor)
    with gm.graph.inserting_before(anchor):
        builder = GlaBuilder(gm.graph, loop, loop.T, memo)
        o, state = builder.gla(loop.form)
        over = builder.outputs_over_steps(o)
        if loop.aggregate is not None:
            aggregate = loop.aggregate
            positions = list(loop.output_positions)
            positions.insert(aggregate.dim, CHUNKS)
            value = builder.laid_out_whole(over, tuple(positions), aggregate.node)
            for reader in (aggregate.readers if aggregate.readers is not None else list(aggregate.node.users)):
                reader.replace_input_with(aggregate.node, value)
        else:
            for n, node in enumerate(loop.outputs):
                rows = builder.call(torch.narrow, over, 0, n * loop.rows, loop.rows)
                positions = tuple(TIME if p == ROW else p for p in loop.output_positions)
                node.replace_all_uses_with(builder.laid_out_whole(rows, positions, node))
        loop.chain.last.node.replace_all_uses_with(builder.final_state(state, loop.chain.last.node))
    built = set()
    if loop.aggregate is not None:
        built = {*loop.aggregate.replaced, loop.aggregate.node}
        for write in [n for n in loop.aggregate.replaced if _writes(n)]:
            gm.graph.erase_node(write)
    _erase_unused(gm.graph, region | built)
    _after_their_inputs(gm.graph)


def _written_as(chain: Chain) -> str:
    """How the loop reached the graph: the unroll pass marks the nodes it inlined from a scan or while_loop."""
    kinds = {s.node.meta.get("laplace_unrolled_from") for s in chain.steps}
    kinds.discard(None)
    return f"token loop (unrolled {kinds.pop()})" if len(kinds) == 1 else "token loop"


def _replace(gm: torch.fx.GraphModule, loop: TokenLoop, memo: dict, origin: str,
             unproven_gates_stay: bool = False) -> None:
    chain = loop.chain
    readouts = [r.node for r in chain.readouts]
    last = chain.last.node
    old = readouts + [last]
    region = _rewritten_region(old, loop)
    aggregate = find_aggregate(readouts)
    anchor = _anchor(gm.graph, old, region, aggregate)
    _check_sources_before(gm.graph, loop, region, anchor)
    before_built = anchor.prev
    with gm.graph.inserting_before(anchor):
        builder = GlaBuilder(gm.graph, loop, loop.T, memo)
        o, state = builder.gla(origin)
        if unproven_gates_stay:
            _keep_unproven_gates_as_written(gm.graph, builder.call_gates, before_built, anchor)
        if readouts:
            over = builder.outputs_over_steps(o)
            if aggregate is not None:
                _replace_aggregate(aggregate, builder.stacked(over, aggregate.dim, readouts[0]), builder)
            else:
                for t, readout in enumerate(readouts):
                    readout.replace_all_uses_with(builder.readout(over, t, readout))
        last.replace_all_uses_with(builder.final_state(state, last))
    built = set()
    if aggregate is not None:
        built = {*aggregate.replaced, aggregate.node}
        for write in [n for n in aggregate.replaced if _writes(n)]:  # the buffer's setitems: read by nothing
            gm.graph.erase_node(write)
    _erase_unused(gm.graph, region | built)
    _after_their_inputs(gm.graph)


def _keep_unproven_gates_as_written(graph: torch.fx.Graph, gates: Node, before_built: Node, anchor: Node) -> None:
    """Decline a loop whose gates (log of its decay) are not proven <= 0, its GLA nodes erased, for an inner
    compiler that lowers: there a gate check becomes a clamp, which changes a decay above 1, and the log of a
    negative decay is NaN (NOTE [unproven gates of a recognised loop] in `laplace_passes.fx.retile`)."""
    bound = gate_bound(gates)
    if bound.nonpositive:
        return
    built = []
    node = before_built.next
    while node is not anchor:
        built.append(node)
        node = node.next
    for node in reversed(built):  # what the builder inserted before the anchor, users first
        graph.erase_node(node)
    raise Declined(f"its gates (the log of its decay) are not shown to be <= 0 ({bound.how}), and the inner "
                   "compiler lowers, where a gate check becomes a clamp, which would change a decay above 1 (and the "
                   "log of a decay below 0 is NaN): kept as written")


def _replace_aggregate(aggregate: Aggregate, stacked: Node, builder: GlaBuilder) -> None:
    """The readers of the aggregate read GLA's readouts stacked instead (a cat of readouts that keep a size-1
    dimension there: the stack reshaped to the cat's shape)."""
    like = fake_tensor(aggregate.node)
    value = builder.call(torch.Tensor.to, builder.call(torch.reshape, stacked, list(like.shape)), like.dtype)
    readers = list(aggregate.node.users) if aggregate.readers is None else aggregate.readers
    for reader in readers:
        reader.replace_input_with(aggregate.node, value)


def _anchor(graph: torch.fx.Graph, old: list[Node], region: set[Node], aggregate: Aggregate | None) -> Node:
    """The first node outside the loop that reads one of its results: the GLA call goes just before it."""
    readers = {u for n in old for u in n.users if u not in region}
    if aggregate is not None:
        built = set(aggregate.replaced) | {aggregate.node}
        later = aggregate.readers if aggregate.readers is not None else list(aggregate.node.users)
        readers = (readers - built) | set(later)
    return next(n for n in graph.nodes if n in readers)


def _check_sources_before(graph: torch.fx.Graph, loop: TokenLoop, region: set[Node], anchor: Node) -> None:
    position = {n: i for i, n in enumerate(graph.nodes)}
    late = [n for n in loop.source_nodes() if position[n] >= position[anchor]]
    if late:
        raise Declined(f"{late[0].name}, an input of the loop, is computed after the loop's results are first read")
    _check_sources_unchanged(loop, region, anchor)


def _check_sources_unchanged(computation, region: set[Node], anchor: Node) -> None:
    """The GLA call goes before `anchor` and reads the sources there: a write in place to one between the
    computation's reads of it and the anchor (a gate doubled after the loop, before its outputs are stacked, or
    halfway through a loop whose outputs are read step by step) would change what the call reads."""
    written = written_while_read(region, computation.source_nodes(), anchor)
    if written is not None:
        raise Declined(f"{written}: the GLA call reads its inputs once, where the results are first read, so it "
                       "would not read the values the recurrence read; write the change as a new value")


def _erase_unused(graph: torch.fx.Graph, region: set[Node]) -> None:
    """The loop's own nodes, now unread, from the last to the first (no op with a side effect but a write to
    a temporary nothing else reads, NOTE [in-place writes to temporaries])."""
    for node in reversed(list(graph.nodes)):
        if node in region and not node.users and node.op in ("call_function", "call_method") \
                and (not _writes(node) or writes_a_temporary(node)):
            graph.erase_node(node)


def _after_their_inputs(graph: torch.fx.Graph) -> None:
    """Move each node that now reads a GLA call's result inserted after it (a loop's view of its last state
    that the user returns, `S = bmm(..).reshape(..)`, and then what reads that) to just after its last
    input: one node at a time, each only later, until every node follows its inputs."""
    while True:
        position = {n: i for i, n in enumerate(graph.nodes)}
        late = next(((n, max(n.all_input_nodes, key=position.get)) for n in graph.nodes
                     if any(position[i] > position[n] for i in n.all_input_nodes)), None)
        if late is None:
            return
        node, last_input = late
        last_input.append(node)


def _writes(node: Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return node.target is operator.setitem or (name.endswith("_") and not name.endswith("__"))
