"""Reads after an in-place statement on a temporary, pointed at the statement's own node.

NOTE [reads after an in-place statement]
`S = S * a; S.add_(k (x) v)` writes the sum into the product's memory as a statement: Dynamo records
`add_ = mul.add_(...)` and every later read of S names `mul`, whose value is now the sum. No chain of
states runs through `add_` then (its result is unused), so the recurrence would not be found. An in-place
method returns the tensor it wrote, so a read of `mul` after the statement and a read of `add_` are reads
of one tensor: pointing those reads at `add_` changes no value anywhere, and gives the loop the chain the
spelling `S = S.add_(...)` has, which the algebra reads when the written tensor is a temporary (NOTE
[in-place writes to temporaries] in `laplace_passes.fx.algebra`). Only in-place sums (`add_`,
`addcmul_`, ...) are followed, on a temporary (a tensor an op of its own computed: not a view, not a
graph input, not memory an earlier in-place write already holds; `S.mul_(a).add_(kv)` on a state buffer
stays an in-place update, with its own row, `laplace_passes.fx.unread_loops`) that is read afterwards
as a state is (read out and carried on: two reads or more) and not before the statement (a readout of
`a S` between the two is not GLA's, and its row says the state is written in place). The loop's last
step is read once (its readout; the final state is not carried on, nor returned): its statement is
followed too when its temporary is computed from an earlier statement followed here, the state before it.
Statements chained on one temporary are followed as one: `S = S.clone(); S.mul_(a).add_(k v)` (the
autograd-safe way to update in place) points the later reads of the clone at the `add_`.

    before:  mul = S * exp;  add_ = mul.add_(kv);  sum_1 = (q * mul).sum(-2);  mul_1 = mul * exp_1
    after:   mul = S * exp;  add_ = mul.add_(kv);  sum_1 = (q * add_).sum(-2);  mul_1 = add_ * exp_1
"""

from __future__ import annotations

import torch
import torch.fx

from laplace_passes.fx.algebra import IN_PLACE_METHODS
from laplace_passes.fx.in_place_writes import owns_its_memory
from laplace_passes.fx.update_tops import IN_PLACE_SUM_METHODS

Node = torch.fx.Node


def read_through_in_place_statements(graph: torch.fx.Graph) -> int:
    """Point the reads after each in-place sum on a temporary, read as a state is (read out and carried on),
    at the sum's own node; how many reads moved."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved = 0
    followed: set[Node] = set()  # statements whose later reads now name them: the states of a loop
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target not in IN_PLACE_SUM_METHODS:
            continue
        written, first = _written_temporary(node)
        if written is None:
            continue
        later = [u for u in written.users if order[u] > order[node]]
        if any(order[u] < order[node] and u is not first for u in written.users):
            continue  # read before the write: not a sum nothing else sees (its row says so)
        if len(later) < 2 and not (later and followed & set(written.all_input_nodes)):
            continue  # not read as a state, nor the last step of a loop of states followed here
        for user in later:
            user.replace_input_with(written, node)
            moved += 1
        followed.add(node)
    return moved


def _written_temporary(node: Node) -> tuple[Node | None, Node]:
    """The temporary an in-place sum writes, through the in-place statements chained before it on the same
    memory (`S = S.clone(); S.mul_(a).add_(k v)`: the clone), and the first statement of that chain; (None,
    node) when the memory is not a temporary's."""
    first = node
    written = node.args[0] if node.args else None
    while isinstance(written, Node) and written.op == "call_method" and written.target in IN_PLACE_METHODS \
            and len(written.users) == 1:
        first, written = written, written.args[0] if written.args else None
    return (written, first) if _temporary(written) else (None, node)


def _temporary(node) -> bool:
    """A tensor an op computed into memory of its own (an earlier in-place write's value is its input's)."""
    return isinstance(node, Node) and node.op in ("call_function", "call_method") and owns_its_memory(node)
