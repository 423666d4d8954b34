"""Cutting an over-budget graph into the fewest partitions that fit, with cheap cuts.

The partitions run one after another (a driver calls them in order), so each
must read only graph inputs and values of earlier partitions: a partition is
a convex set of nodes, and the partitions are ordered. Two steps:

1. Fewest partitions, cheapest cuts along a topological order
   (`_cut_positions`). Cutting a topological order into m contiguous pieces,
   each under the budget, gives ordered convex partitions. A dynamic
   programme over cut positions finds the smallest m that fits and, among
   those cuts, the ones that minimise the bytes crossing them (a value
   crosses a cut when it is made before it and read after it). A sliding-
   window minimum keeps it O(m x nodes). Three orders are tried: the
   graph's own; "as late as possible" (each node just before its first
   reader), which keeps work that reads only graph inputs off the cuts (in a
   backward graph, a weight gradient computed first but returned last); and
   depth first (each input's subgraph finished before the next starts).
2. Better cuts off that order (`_refine_boundary`, networkx). For each pair
   of neighbouring partitions, the nodes near their boundary that could move
   either way without breaking the budget form a region; a minimum s-t cut
   over the dataflow graph of that region (networkx.minimum_cut), with each
   value's bytes as its capacity and infinite capacity against moving a node
   before the values it reads, re-places the boundary where the fewest
   bytes cross.

Tuple-producing nodes stay with their getitem nodes. Attribute reads
(get_attr) and views of graph inputs are not placed: each partition reads
the attributes and graph inputs it uses and makes its own views of them.
A view costs no instruction, and a cut carrying one would count (and, in
the partitioned graph, pass) the whole input: in a backward graph the
logits' gradient, read as a view by the first and the last layer, is
vocab x T x 4 bytes.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from dataclasses import dataclass, field

import networkx as nx
import torch.fx

from laplace_passes.infra.fx_helpers import value_bytes
from laplace_passes.infra.op_facts import is_view
from laplace_passes.infra.pass_base import Declined

# The refinement's flow problem grows with the region; beyond this many
# nodes per boundary the order-based cut is kept as it is.
MAX_REFINE_NODES = 4000
_COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass
class PartitionPlan:
    part_of: dict  # compute node -> partition index
    count: int
    instructions: list[int]  # per partition
    nodes: list[int]  # compute nodes per partition
    cut_bytes: list[int]  # bytes crossing the cut after partition i (count - 1 entries)
    bytes_in: list[int]  # bytes each partition reads from earlier partitions
    input_views: set = field(default_factory=set)  # not placed: each partition makes its own (input_views)


def plan_partitions(gm: torch.fx.GraphModule, cost: dict, budget: int, refine: bool = True) -> PartitionPlan:
    """The plan (`cost`: node -> instructions); Declined, with why, when `gm` cannot be cut to fit `budget`."""
    unplaced = input_views(gm)
    order = [n for n in gm.graph.nodes if n.op in _COMPUTE_OPS and n not in unplaced]
    too_big = [n for n in order if cost[n] > budget]
    if too_big:
        worst = max(too_big, key=cost.__getitem__)
        raise Declined(f"node {worst.name} ({worst.target}) alone needs about {cost[worst]} instructions, "
                       f"over the budget of {budget}: no cut can make it fit")
    # Fewest pieces first, then fewest bytes across the cuts.
    found = []
    for candidate in (order, _as_late_as_possible(order), _depth_first(order)):
        candidate = _getitems_after_producers(candidate)
        cuts = _cut_positions(candidate, cost, budget)
        if cuts is not None:
            found.append((len(cuts[0]), cuts[1], candidate, cuts[0]))
    if not found:
        raise Declined("every cut that fits the budget would separate a tuple result from the getitem nodes reading it")
    _, _, order, cuts = min(found, key=lambda f: f[:2])
    part_of = {}
    bounds = [0, *cuts, len(order)]
    for index, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        for node in order[start:stop]:
            part_of[node] = index
    count = len(bounds) - 1
    if refine:
        for left in range(count - 1):
            _refine_boundary(order, part_of, cost, budget, left)
    plan = _summarise(order, part_of, cost, count)
    plan.input_views = unplaced
    return plan


def input_views(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """View nodes that read only graph inputs, attributes or such views: copied into each partition reading them."""
    views: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_view(node) and all(
            arg.op in ("placeholder", "get_attr") or arg in views for arg in node.all_input_nodes
        ):
            views.add(node)
    return views


# -- step 1: cuts along the node order ---------------------------------------------


def _as_late_as_possible(order: list) -> list:
    """A topological order scheduling each node as late as its readers allow (ALAP levels).

    A node's level counts back from the end: 0 when only the output reads
    it, else one more than the highest level among its readers. Sorting by
    level, highest first (ties in the graph's order), puts each node after
    everything that does not depend on it being done: work only the output
    reads (a weight gradient computed first) moves to the end.
    """
    position = {node: i for i, node in enumerate(order)}
    level: dict = {}
    for node in reversed(order):
        level[node] = 1 + max((level[user] for user in node.users if user in position), default=-1)
    return sorted(order, key=lambda node: (-level[node], position[node]))


def _depth_first(order: list) -> list:
    """A topological order finishing each input's subgraph before starting the next (post-order from the outputs).

    Independent chains written interleaved come out one after the other,
    so a cut between them carries one chain's result, not a value of each.
    """
    position = {node: i for i, node in enumerate(order)}
    producers = nx.DiGraph()
    producers.add_nodes_from(order)
    producers.add_edges_from((node, arg) for node in order for arg in node.all_input_nodes if arg in position)
    roots = [node for node in reversed(order) if not any(u in position for u in node.users)]
    producers.add_edges_from(("outputs", root) for root in reversed(roots))
    return [node for node in nx.dfs_postorder_nodes(producers, "outputs") if node != "outputs"]


def _getitems_after_producers(order: list) -> list:
    """`order` with every getitem moved right after the node whose tuple it reads (cuts keep them together)."""
    getitems: dict = {}
    for node in order:
        if node.target is operator.getitem:
            getitems.setdefault(node.args[0], []).append(node)
    placed = []
    for node in order:
        if node.target is operator.getitem and node.args[0] in getitems:
            continue
        placed.append(node)
        placed.extend(getitems.get(node, []))
    return placed if len(placed) == len(order) else order


def _cut_positions(order: list, cost: dict, budget: int) -> tuple[list[int], int] | None:
    """Positions p (cut before order[p]) of the fewest, cheapest cuts and the bytes they carry; None if none fit."""
    n = len(order)
    prefix = [0]
    for node in order:
        prefix.append(prefix[-1] + cost[node])
    crossing = _crossing_bytes(order)
    allowed = _allowed_cuts(order)
    # best[p]: the fewest bytes of `pieces` pieces ending with a cut at p (its own bytes
    # included); parents[j][p]: the cut before it.
    best = [
        (crossing[p] if p < n else 0) if (prefix[p] <= budget and allowed[p]) else math.inf
        for p in range(n + 1)
    ]
    best[0] = math.inf
    parents: list[list[int]] = [[-1] * (n + 1)]
    pieces = 1
    while best[n] == math.inf:
        if pieces >= n:
            return None  # allowed cuts too sparse (a tuple result read far from where it is made)
        best, parent = _one_more_piece(best, prefix, crossing, allowed, budget)
        parents.append(parent)
        pieces += 1
    cuts, p = [], n
    for j in range(pieces - 1, 0, -1):
        p = parents[j][p]
        cuts.append(p)
    return _balanced(sorted(cuts), prefix, crossing, allowed, budget), best[n]


def _balanced(cuts: list[int], prefix: list, crossing: list, allowed: list, budget: int) -> list[int]:
    """Slide each cut, at equal bytes, to where its two pieces weigh most alike.

    Equally cheap cuts are common (a run of views, a chain of same-sized
    values); a balanced one leaves both neighbours slack for the refinement.
    """
    bounds = [0, *cuts, len(prefix) - 1]
    for i in range(1, len(bounds) - 1):
        start, cut, stop = bounds[i - 1], bounds[i], bounds[i + 1]
        candidates = [
            p for p in range(start + 1, stop)
            if allowed[p] and crossing[p] == crossing[cut]
            and prefix[p] - prefix[start] <= budget and prefix[stop] - prefix[p] <= budget
        ]
        bounds[i] = min(candidates, key=lambda p: abs((prefix[p] - prefix[start]) - (prefix[stop] - prefix[p])))
    return bounds[1:-1]


def _one_more_piece(previous: list, prefix: list, crossing: list, allowed: list, budget: int):
    """best[p] = crossing[p] + min over q < p with prefix[p] - prefix[q] <= budget of previous[q]."""
    n = len(prefix) - 1
    best, parent = [math.inf] * (n + 1), [-1] * (n + 1)
    window: deque[int] = deque()  # candidate q, increasing position, increasing previous[q]
    lo = 0
    for p in range(1, n + 1):
        q = p - 1
        if previous[q] < math.inf:
            while window and previous[window[-1]] >= previous[q]:
                window.pop()
            window.append(q)
        while prefix[p] - prefix[lo] > budget:
            lo += 1
        while window and window[0] < lo:
            window.popleft()
        if window and allowed[p]:
            best[p] = previous[window[0]] + (crossing[p] if p < n else 0)
            parent[p] = window[0]
    return best, parent


def _crossing_bytes(order: list) -> list[int]:
    """crossing[p]: bytes of values made before position p and read at or after it."""
    position = {node: i for i, node in enumerate(order)}
    delta = [0] * (len(order) + 2)
    for i, node in enumerate(order):
        last = max((position[u] for u in node.users if u in position), default=i)
        if last > i:
            size = value_bytes(node)
            delta[i + 1] += size
            delta[last + 1] -= size
    crossing, running = [], 0
    for p in range(len(order) + 1):
        running += delta[p]
        crossing.append(running)
    return crossing


def _allowed_cuts(order: list) -> list[bool]:
    """Cuts may not separate a tuple-producing node from its getitem readers."""
    position = {node: i for i, node in enumerate(order)}
    allowed = [True] * (len(order) + 1)
    for i, node in enumerate(order):
        readers = [position[u] for u in node.users if u in position and u.target is operator.getitem]
        for p in range(i + 1, max(readers, default=i) + 1):
            allowed[p] = False
    return allowed


# -- step 2: min-cut refinement of one boundary --------------------------------------


def _refine_boundary(order: list, part_of: dict, cost: dict, budget: int, left: int) -> None:
    """Re-place the boundary between partitions `left` and `left + 1` where fewer bytes cross."""
    right = left + 1
    left_nodes = [n for n in order if part_of[n] == left]
    right_nodes = [n for n in order if part_of[n] == right]
    slack_left = budget - sum(cost[n] for n in left_nodes)
    slack_right = budget - sum(cost[n] for n in right_nodes)
    # Movable: a tail of `left` light enough for `right` to absorb, and a
    # head of `right` light enough for `left`; any split of them fits.
    movable = _tail_within(left_nodes, cost, slack_right) + _tail_within(right_nodes[::-1], cost, slack_left)[::-1]
    movable = [n for n in movable if not _glued(n)]
    if not movable or len(movable) > MAX_REFINE_NODES:
        return
    region = set(movable)
    flow = nx.DiGraph()
    source, sink = "source", "sink"

    def side(node):
        if node in region:
            return node
        return source if part_of.get(node, -1) <= left else sink

    for node in set(order) & (region | {n for m in region for n in m.all_input_nodes}):
        readers = [u for u in node.users if u in part_of]
        if side(node) is sink or not any(side(u) is not source for u in readers):
            continue
        value = ("value", node)  # paying its bytes once lets every reader sit on the sink side
        flow.add_edge(side(node), value, capacity=value_bytes(node))
        for reader in readers:
            if side(reader) is not source:
                flow.add_edge(value, side(reader))  # no capacity: infinite
    # Order: a reader on the source side pulls what it reads there too.
    for node in region:
        for producer in node.all_input_nodes:
            if producer in part_of and side(producer) is not source:
                flow.add_edge(node, side(producer))
        for reader in node.users:
            if reader in part_of and side(reader) is source:
                flow.add_edge(source, node)
    if source not in flow or sink not in flow:
        return
    _, (source_side, _) = nx.minimum_cut(flow, source, sink)
    for node in region:
        part_of[node] = left if node in source_side else right


def _tail_within(nodes: list, cost: dict, slack: int) -> list:
    tail, total = [], 0
    for node in reversed(nodes):
        total += cost[node]
        if total > slack:
            break
        tail.append(node)
    return tail[::-1]


def _glued(node: torch.fx.Node) -> bool:
    """Tuple producers and their getitems stay where the order put them."""
    if node.target is operator.getitem:
        return True
    return any(u.target is operator.getitem for u in node.users)


def _summarise(order: list, part_of: dict, cost: dict, count: int) -> PartitionPlan:
    instructions, nodes = [0] * count, [0] * count
    for node in order:
        instructions[part_of[node]] += cost[node]
        nodes[part_of[node]] += 1
    cut_bytes, bytes_in = [0] * (count - 1), [0] * count
    for node in order:
        readers = {part_of[u] for u in node.users if u in part_of} - {part_of[node]}
        size = value_bytes(node)
        for cut in range(part_of[node], max(readers, default=part_of[node])):
            cut_bytes[cut] += size
        for reader in readers:
            bytes_in[reader] += size
    return PartitionPlan(part_of, count, instructions, nodes, cut_bytes, bytes_in)
