"""Emitting the all-to-all form of one bucket (see `rewrite.py` for the graphs before and after).

Everything emitted depends on the plan and on the matched computations,
never on a rank constant: a rank sends its shard of matrix i to i's owner,
runs its own work on what the first all-to-all routed to it (a uniform
plan's slots, or its branch of `cond(rank == owner)` in a balanced plan),
and takes its rows of matrix i from i's owner after the second.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from laplace_passes.collectives.match import GatherBucket, MatrixSite
from laplace_passes.collectives.plan import OwnershipPlan
from laplace_passes.collectives.regions import copy_region
from laplace_passes.infra.fx_helpers import COND, fake_tensor

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
Node = torch.fx.Node


@dataclass
class Exchange:
    """The matrices whose gathers become one pair of all-to-alls: one group, one dtype, one plan."""

    group: str
    world_size: int
    buckets: list[GatherBucket]

    @property
    def sites(self) -> list[MatrixSite]:
        return [site for bucket in self.buckets for site in bucket.sites]

    @property
    def dtype_like(self) -> torch.Tensor:
        return fake_tensor(self.buckets[0].send)


def emit_all_to_all(gm: torch.fx.GraphModule, exchange: Exchange, plan: OwnershipPlan, rank: Node | int | None) -> None:
    """Insert pack -> all_to_all -> owned work -> all_to_all -> unpack; reroute the selections.

    `rank` (the rank as a graph input, or this process's rank when the graph
    is per rank) is needed by balanced plans only. The new nodes go before
    the last gather (after every send); the graph is sorted again afterwards,
    since updates of earlier matrices now read the second all-to-all.
    """
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    last_gather = max((b.all_gather for b in exchange.buckets), key=order.__getitem__)
    sites = exchange.sites
    with graph.inserting_before(last_gather):
        packed = _pack_by_owner(graph, exchange, plan)
        received = _all_to_all(graph, packed, plan, exchange.group)  # [W sources, chunk]
        if plan.slots:
            work = _slot_work(graph, sites, plan, received)
        elif isinstance(rank, int):  # a per-rank graph: only this rank's owner work
            work = _owned_work(graph, sites, plan, rank, received, exchange.dtype_like)
        else:
            work = _owner_work(gm, exchange, plan, received, rank)
        flat = _call(graph, aten.view.default, work, [-1])  # [W destinations, chunk], flattened
        returned = _all_to_all(graph, flat, plan, exchange.group)  # [W owners, chunk]
        mine = [_unpack(graph, returned, plan, i, site) for i, site in enumerate(sites)]
    for site, node in zip(sites, mine):
        site.selection.replace_all_uses_with(node)
    _sort_in_place(graph)


def _sort_in_place(graph: torch.fx.Graph) -> None:
    """Move each node after its inputs, keeping the order otherwise (node objects unchanged)."""
    placed: set[Node] = set()
    waiting: dict[Node, list[Node]] = {}
    pending = list(reversed(graph.nodes))
    cursor = None
    while pending:
        node = pending.pop()
        missing = [n for n in node.all_input_nodes if n not in placed]
        if missing:
            waiting.setdefault(missing[-1], []).append(node)
            continue
        placed.add(node)
        if cursor is not None and cursor.next is not node:
            cursor.append(node)
        cursor = node
        pending.extend(reversed(waiting.pop(node, [])))
    if waiting:
        raise RuntimeError("muon_all_to_all: the rewritten graph has a cycle")


def _call(graph: torch.fx.Graph, op, *args, **kwargs) -> Node:
    return graph.call_function(op, args, kwargs)


def _pack_by_owner(graph: torch.fx.Graph, exchange: Exchange, plan: OwnershipPlan) -> Node:
    """This rank's shards, ordered by the rank that owns them, zeros where an owner has nothing."""
    zeros: dict[int, Node] = {}
    flat_sends: dict[Node, Node] = {}
    sites = exchange.sites
    pieces = []
    for owner in range(plan.world_size):
        for _, numel, i in plan.layout(owner):
            if i is None:
                if numel not in zeros:
                    zeros[numel] = _zeros(graph, [numel], exchange.dtype_like)
                pieces.append(zeros[numel])
                continue
            pieces.append(_shard_in_send(graph, sites[i], flat_sends))
    return _call(graph, aten.cat.default, pieces)


def _shard_in_send(graph: torch.fx.Graph, site: MatrixSite, flat_sends: dict[Node, Node]) -> Node:
    """This rank's shard of one matrix, flat: the send cat's own input when it is one, else a slice of the send.

    ShardedMuon's send is `cat([view(u_0, [-1]), ...])`: taking `u_i`'s view
    directly leaves the user's cat dead (erased with the gather), so the
    shards are copied once, into the all-to-all's buffer, not twice.
    """
    piece = _cat_input_at(site.send, site.offset, site.numel)
    if piece is not None:
        return piece
    if site.send not in flat_sends:
        flat_sends[site.send] = _flat(graph, site.send)
    return _call(graph, aten.slice.Tensor, flat_sends[site.send], 0, site.offset, site.offset + site.numel)


def _cat_input_at(send: Node, offset: int, numel: int) -> Node | None:
    """The input of a 1-D `cat` that holds exactly elements [offset, offset + numel) of it, if there is one."""
    if send.target is not aten.cat.default or (len(send.args) > 1 and send.args[1] not in (0, -1)):
        return None
    like = fake_tensor(send)
    if like is None or like.dim() != 1:
        return None
    start = 0
    for piece in send.args[0]:
        value = fake_tensor(piece) if isinstance(piece, Node) else None
        if value is None or value.dim() != 1:
            return None
        if start == offset and value.numel() == numel:
            return piece if value.dtype == like.dtype else None
        start += value.numel()
    return None


def _flat(graph: torch.fx.Graph, send: Node) -> Node:
    value = fake_tensor(send)
    if value.dim() == 1:
        return send
    if not value.is_contiguous():
        send = _call(graph, aten.clone.default, send, memory_format=torch.contiguous_format)
    return _call(graph, aten.view.default, send, [-1])


def _all_to_all(graph: torch.fx.Graph, flat: Node, plan: OwnershipPlan, group: str) -> Node:
    """Equal splits: `chunk` elements to and from every rank; viewed [W, chunk]."""
    # The ATen op takes `SymInt[]` split lists, never None: torch's own
    # `all_to_all_single(x, None, None, group)` fills in `[x.shape[0] // group_size] * group_size`
    # (torch/distributed/_functional_collectives.py, torch 2.13, line 581), the lists emitted here.
    splits = [plan.chunk_numel] * plan.world_size
    sent = _call(graph, c10d.all_to_all_single.default, flat, splits, splits, group)
    done = _call(graph, c10d.wait_tensor.default, sent)
    return _call(graph, aten.view.default, done, [plan.world_size, plan.chunk_numel])


def _matrix_work(graph: torch.fx.Graph, site: MatrixSite, received: Node, offset: int, plan: OwnershipPlan) -> Node:
    """Rebuild one matrix from every rank's shard, orthogonalise it, lay it out per rank: [W, numel]."""
    world_size = plan.world_size
    block = _call(graph, aten.slice.Tensor, received, 1, offset, offset + site.numel)  # [W, numel]
    block_shape = list(fake_tensor(site.block).shape)
    # A column slice of the chunk is strided; the user's own ops may view the block (a gathered
    # value viewed [W, -1] is contiguous): give them a contiguous one when theirs was.
    needs_copy = site.numel != plan.chunk_numel and fake_tensor(site.block).is_contiguous()
    if block_shape != [world_size, site.numel] or needs_copy:  # a whole gathered matrix: W row blocks, rank-major
        block = _call(graph, aten.clone.default, block, memory_format=torch.contiguous_format)
        block = _call(graph, aten.view.default, block, block_shape)
    full = copy_region(graph, site.unpad, block)
    result = copy_region(graph, site.ns_template, full)
    layout = copy_region(graph, site.layout, result)  # [W, shard...]
    if not fake_tensor(site.layout.output).is_contiguous():
        layout = _call(graph, aten.clone.default, layout, memory_format=torch.contiguous_format)
    return _call(graph, aten.view.default, layout, [world_size, site.numel])


def _slot_work(graph: torch.fx.Graph, sites: list[MatrixSite], plan: OwnershipPlan, received: Node) -> Node:
    """Uniform plan: every rank runs every slot's computation (its group's template)."""
    pieces = [_matrix_work(graph, sites[s.template], received, s.offset, plan) for s in plan.slots]
    return _call(graph, aten.cat.default, pieces, 1)


def _owned_work(graph: torch.fx.Graph, sites, plan: OwnershipPlan, rank: int, received: Node, like) -> Node:
    """Balanced plan in a per-rank graph: this rank's matrices only, zeros for the rest of its chunk."""
    owned = plan.owned(rank)
    pieces = [_matrix_work(graph, sites[i], received, plan.offsets[i], plan) for i in owned]
    used = sum(plan.numels[i] for i in owned)
    if used < plan.chunk_numel:
        pieces.append(_zeros(graph, [plan.world_size, plan.chunk_numel - used], like))
    return _call(graph, aten.cat.default, pieces, 1)


def _owner_work(gm: torch.fx.GraphModule, exchange: Exchange, plan: OwnershipPlan, received: Node,
                rank: Node) -> Node:
    """Balanced plan: one `cond(rank == owner)` per owner; each rank's result picked by `where`."""
    graph = gm.graph
    like = exchange.dtype_like  # dtype and device of everything sent
    not_owner = _add_branch(gm, "_laplace_muon_not_owner", _zeros_branch(plan, like))
    combined = None
    for owner in range(plan.world_size):
        owned = plan.owned(owner)
        if not owned:
            continue
        branch = _add_branch(gm, f"_laplace_muon_owner_{owner}", _owner_branch(exchange.sites, plan, owned, like))
        pred = _call(graph, aten.eq.Scalar, rank, owner)
        if fake_tensor(rank).dim():
            pred = _call(graph, aten.view.default, pred, [])
        cond = _call(graph, COND, pred, graph.get_attr(branch),
                     graph.get_attr(not_owner), (received,))
        out = _call(graph, operator.getitem, cond, 0)
        # A selection, not a sum: bits (and signs of zeros) pass through unchanged.
        combined = out if combined is None else _call(graph, aten.where.self, pred, out, combined)
    return combined


def _owner_branch(sites, plan: OwnershipPlan, owned: list[int], like) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    received = graph.placeholder("received")
    graph.output((_owned_work(graph, sites, plan, plan.owners[owned[0]], received, like),))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _zeros_branch(plan: OwnershipPlan, like) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.placeholder("received")
    graph.output((_zeros(graph, [plan.world_size, plan.chunk_numel], like),))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _zeros(graph: torch.fx.Graph, size: list[int], like: torch.Tensor) -> Node:
    """aten.full, not new_zeros: a core op every inner compiler lowers after decomposition."""
    return _call(graph, aten.full.default, size, 0.0, dtype=like.dtype, layout=torch.strided,
                 device=like.device, pin_memory=False)


def _add_branch(gm: torch.fx.GraphModule, name: str, branch: torch.fx.GraphModule) -> str:
    suffix = 0
    while hasattr(gm, f"{name}_{suffix}"):
        suffix += 1
    gm.add_submodule(f"{name}_{suffix}", branch)
    return f"{name}_{suffix}"


def _unpack(graph: torch.fx.Graph, returned: Node, plan: OwnershipPlan, i: int, site: MatrixSite) -> Node:
    """Site i's rows for this rank: from its owner's row of the second all-to-all."""
    row = _call(graph, aten.select.int, returned, 0, plan.owners[i])
    piece = _call(graph, aten.slice.Tensor, row, 0, plan.offsets[i], plan.offsets[i] + site.numel)
    return _call(graph, aten.view.default, piece, list(fake_tensor(site.selection).shape))
