"""Emitting the all-to-all form of one bucket (see `rewrite.py` for the graphs before and after).

Everything emitted depends on the plan and on the matched computations,
never on a rank constant: a rank sends its shard of matrix i to i's owner,
runs its own work on what the first all-to-all routed to it (a uniform
plan's slots, or its branch of `cond(rank == owner)` in a balanced plan),
and takes its rows of matrix i from i's owner after the second.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from laplace_passes.collectives.match import GatherBucket, MatrixSite
from laplace_passes.collectives.plan import OwnershipPlan
from laplace_passes.collectives.regions import copy_region
from laplace_passes.fx_helpers import COND, fake_tensor

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
Node = torch.fx.Node


def emit_all_to_all(gm: torch.fx.GraphModule, bucket: GatherBucket, plan: OwnershipPlan, rank: Node | None) -> None:
    """Insert pack -> all_to_all -> owned work -> all_to_all -> unpack; reroute the selections.

    `rank` (the rank as a graph input) is needed by balanced plans only.
    """
    graph = gm.graph
    with graph.inserting_before(bucket.all_gather):
        packed = _pack_by_owner(graph, bucket, plan)
        received = _all_to_all(graph, packed, plan, bucket.group)  # [W sources, chunk]
        if plan.slots:
            work = _slot_work(graph, bucket, plan, received)
        else:
            work = _owner_work(gm, bucket, plan, received, rank)
        flat = _call(graph, aten.view.default, work, [-1])  # [W destinations, chunk], flattened
        returned = _all_to_all(graph, flat, plan, bucket.group)  # [W owners, chunk]
        mine = [_unpack(graph, returned, plan, i, site) for i, site in enumerate(bucket.sites)]
    for site, node in zip(bucket.sites, mine):
        site.selection.replace_all_uses_with(node)


def _call(graph: torch.fx.Graph, op, *args, **kwargs) -> Node:
    return graph.call_function(op, args, kwargs)


def _pack_by_owner(graph: torch.fx.Graph, bucket: GatherBucket, plan: OwnershipPlan) -> Node:
    """This rank's shards, ordered by the rank that owns them, zeros where an owner has nothing."""
    zeros: dict[int, Node] = {}
    pieces = []
    for owner in range(plan.world_size):
        for _, numel, i in plan.layout(owner):
            if i is None:
                if numel not in zeros:
                    zeros[numel] = _zeros(graph, [numel], fake_tensor(bucket.send))
                pieces.append(zeros[numel])
            else:
                site = bucket.sites[i]
                pieces.append(_call(graph, aten.slice.Tensor, bucket.send, 0, site.offset, site.offset + site.numel))
    return _call(graph, aten.cat.default, pieces)


def _all_to_all(graph: torch.fx.Graph, flat: Node, plan: OwnershipPlan, group: str) -> Node:
    """Equal splits: `chunk` elements to and from every rank; viewed [W, chunk]."""
    splits = [plan.chunk_numel] * plan.world_size
    sent = _call(graph, c10d.all_to_all_single.default, flat, splits, splits, group)
    done = _call(graph, c10d.wait_tensor.default, sent)
    return _call(graph, aten.view.default, done, [plan.world_size, plan.chunk_numel])


def _matrix_work(graph: torch.fx.Graph, site: MatrixSite, received: Node, offset: int, world_size: int) -> Node:
    """Rebuild one matrix from every rank's shard, orthogonalise it, lay it out per rank: [W, numel]."""
    block = _call(graph, aten.slice.Tensor, received, 1, offset, offset + site.numel)
    full = copy_region(graph, site.unpad, block)
    result = copy_region(graph, site.ns_template, full)
    layout = copy_region(graph, site.layout, result)  # [W, shard...]
    if not fake_tensor(site.layout.output).is_contiguous():
        layout = _call(graph, aten.clone.default, layout, memory_format=torch.contiguous_format)
    return _call(graph, aten.view.default, layout, [world_size, site.numel])


def _slot_work(graph: torch.fx.Graph, bucket: GatherBucket, plan: OwnershipPlan, received: Node) -> Node:
    """Uniform plan: every rank runs every slot's computation (its group's template)."""
    pieces = [_matrix_work(graph, bucket.sites[s.template], received, s.offset, plan.world_size) for s in plan.slots]
    return _call(graph, aten.cat.default, pieces, 1)


def _owner_work(gm: torch.fx.GraphModule, bucket: GatherBucket, plan: OwnershipPlan, received: Node,
                rank: Node) -> Node:
    """Balanced plan: one `cond(rank == owner)` per owner; each rank's result picked by `where`."""
    graph = gm.graph
    like = fake_tensor(bucket.send)  # dtype and device of everything sent
    not_owner = _add_branch(gm, "_laplace_muon_not_owner", _zeros_branch(plan, like))
    combined = None
    for owner in range(plan.world_size):
        owned = plan.owned(owner)
        if not owned:
            continue
        branch = _add_branch(gm, f"_laplace_muon_owner_{owner}", _owner_branch(bucket, plan, owned, like))
        pred = _call(graph, aten.eq.Scalar, rank, owner)
        if fake_tensor(rank).dim():
            pred = _call(graph, aten.view.default, pred, [])
        cond = _call(graph, COND, pred, graph.get_attr(branch),
                     graph.get_attr(not_owner), (received,))
        out = _call(graph, operator.getitem, cond, 0)
        # A selection, not a sum: bits (and signs of zeros) pass through unchanged.
        combined = out if combined is None else _call(graph, aten.where.self, pred, out, combined)
    return combined


def _owner_branch(bucket: GatherBucket, plan: OwnershipPlan, owned: list[int], like) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    received = graph.placeholder("received")
    pieces = [_matrix_work(graph, bucket.sites[i], received, plan.offsets[i], plan.world_size) for i in owned]
    used = sum(plan.numels[i] for i in owned)
    if used < plan.chunk_numel:
        pieces.append(_zeros(graph, [plan.world_size, plan.chunk_numel - used], like))
    graph.output((_call(graph, aten.cat.default, pieces, 1),))
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
