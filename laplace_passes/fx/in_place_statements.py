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
`a S` between the two is not GLA's, and its row says the state is written in place).

    before:  mul = S * exp;  add_ = mul.add_(kv);  sum_1 = (q * mul).sum(-2);  mul_1 = mul * exp_1
    after:   mul = S * exp;  add_ = mul.add_(kv);  sum_1 = (q * add_).sum(-2);  mul_1 = add_ * exp_1
"""

from __future__ import annotations

import torch
import torch.fx

from laplace_passes.fx.in_place_writes import owns_its_memory
from laplace_passes.fx.update_tops import IN_PLACE_SUM_METHODS

Node = torch.fx.Node


def read_through_in_place_statements(graph: torch.fx.Graph) -> int:
    """Point the reads after each in-place sum on a temporary, read as a state is (read out and carried on),
    at the sum's own node; how many reads moved."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved = 0
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target not in IN_PLACE_SUM_METHODS or not _temporary(node.args[0]):
            continue
        written = node.args[0]
        later = [u for u in written.users if order[u] > order[node]]
        if any(order[u] < order[node] for u in written.users) or len(later) < 2:
            continue  # read before the write (not a sum nothing else sees: its row says so), or not a state
        for user in later:
            user.replace_input_with(written, node)
            moved += 1
    return moved


def _temporary(node) -> bool:
    """A tensor an op computed into memory of its own (an earlier in-place write's value is its input's)."""
    return isinstance(node, Node) and node.op in ("call_function", "call_method") and owns_its_memory(node)
