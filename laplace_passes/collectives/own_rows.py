"""Which rows of a gathered Newton-Schulz result this rank keeps, and why a result without such a pick is declined.

The last step of the gather pattern (`laplace_passes.collectives.match`):

    mine = select_own(layout(result))

`own_row_selection` searches the result's users for the one selection of
this rank's `numel`-element block: `index_select` / `index` with the rank
input, or a view reading the block at `rank * numel` (`select`, `chunk`,
`split`, `narrow`, slicing) with the rank a constant. When a path from the
result reaches the graph output past no such pick, the decline names what
was found instead (an index tensor computed in the graph, another rank's
rows, column shards, uneven row shards, the whole result read besides the
pick), so the user learns the cause, not the symptom.
"""

from __future__ import annotations

import operator
import torch
import torch.fx

from laplace_passes.collectives.aliases import Aliases, contiguous_strides
from laplace_passes.collectives.regions import live_users
from laplace_passes.infra.fx_helpers import ancestors, fake_tensor, resolve_process_group
from laplace_passes.infra.op_facts import SPLITS, is_view
from laplace_passes.infra.pass_base import Declined

aten = torch.ops.aten
Node = torch.fx.Node


def selection_source(selection: Node) -> Node:
    """The [W, ...] (or [W * rows, ...]) value a selection reads: the split's input for getitem(split, i)."""
    (split,) = split_of(selection) or (selection,)
    return split.args[0]


def split_of(selection: Node) -> tuple[Node, ...]:
    source = selection.args[0] if selection.args else None
    if selection.target is operator.getitem and isinstance(source, Node) and source.target in SPLITS:
        return (source,)
    return ()


def own_row_selection(result: Node, world_size: int, numel: int, group: str, live: set[Node]) -> Node:
    found, others, seen, frontier = [], [], set(), [(result, False)]
    reached_from: dict[Node, Node] = {}
    leak: list[Node] | None = None  # a path from the result to the graph output past no selection
    aliases = Aliases()
    while frontier:
        node, beyond = frontier.pop(0)  # beyond: downstream of a selection already
        for user in live_users(node, live):
            if user.op == "output":  # reached on every path: one past a selection does not hide one without
                if not beyond and leak is None:  # the reason names the picks found further on too
                    leak = _path_from(result, node, reached_from)
                continue
            if user in seen:
                continue
            seen.add(user)
            reached_from[user] = node
            if _is_selection(user, world_size, numel, group, aliases, others):
                found.append(user)
                if user.target in (aten.index_select.default, aten.index.Tensor):
                    continue
                frontier.append((user, True))  # a view taking a rank's block may still be part of a layout
            else:
                frontier.append((user, beyond))
    if leak is not None:
        raise Declined(_why_unsharded(result, leak, seen, _first_selections(found), others, world_size))
    found = _first_selections(found)
    if len(found) != 1:
        detail = f"; {others[0]}" if others and not found else ""
        raise Declined(
            f"Newton-Schulz result {result.name}: expected one selection of this rank's rows "
            f"(its {numel}-element block of the result, by index_select, select, chunk, split, narrow or slicing), "
            f"found {len(found)}{detail}"
        )
    return found[0]


def _path_from(result: Node, last: Node, reached_from: dict[Node, Node]) -> list[Node]:
    """The nodes from `result`'s user to `last`, along which the search reached `last`."""
    path = [last]
    while path[-1] is not result and path[-1] in reached_from and reached_from[path[-1]] is not result:
        path.append(reached_from[path[-1]])
    return path[::-1]


def _why_unsharded(result: Node, whole: list[Node], seen: set[Node], found: list[Node], others: list[str],
                   world_size: int) -> str:
    """Why no selection of this rank's rows lies on the path `whole` from `result` to the graph output."""
    last = whole[-1]
    where = f"Newton-Schulz result {result.name} reaches the graph output (at {last.name}) with no pick of this " \
            "rank's rows"
    if others:
        return f"{where}: {others[0]}; the rewrite moves each rank its own rows only"
    for node in sorted(seen):
        if node.target is aten.index.Tensor and node.args[0] in seen | {result}:
            index = next((i for i in node.args[1] if isinstance(i, Node)), None)
            made = f"{index.name} ({_op_short(index)})" if index is not None else "an index"
            return (f"{where}: {node.name} picks rows with the index tensor {made} computed in the graph, not with "
                    "the rank input or a view; the rewrite cannot tell whose rows an index tensor holds")
    for node in sorted(seen):
        dim = _column_block_dim(node, world_size)
        if dim is not None:
            return (f"{where}: {node.name} ({_op_short(node)}) takes a block of dim {dim}, 1/{world_size} of the "
                    "columns: column shards; the rewrite moves row shards (gathered and taken back on dim 0)")
    for node in sorted(seen):
        uneven = _uneven_row_block(node, world_size)
        if uneven is not None:
            taken, rows = uneven
            block = -(-rows // world_size)
            return (f"{where}: {node.name} ({_op_short(node)}) takes {taken} of the result's {rows} rows, which "
                    f"do not split into {world_size} equal blocks (uneven shards, the last rank's shorter); pad the "
                    f"result to {world_size * block} rows before taking this rank's block: the rewrite moves equal "
                    "row blocks")
    picks = ancestors(found) | set(found)
    reader = next((n for n in whole if n not in picks), None)
    if found and reader is not None and reader.op != "output":
        return (f"{where}: besides this rank's pick {found[0].name}, {reader.name} ({_op_short(reader)}) reads the "
                "whole result and its value leaves the graph, so every rank needs the whole orthogonalised matrix; "
                "the gather is kept")
    return f"{where} (the whole result leaves the graph, or is used past a pick the rewrite does not know)"


def _uneven_row_block(node: Node, world_size: int) -> tuple[int, int] | None:
    """(rows taken, rows of the source) when `node` takes at most ceil(n / W) of the n rows of a source whose n is
    not a multiple of W (by slice, narrow or chunk / split on dim 0): a rank's block of uneven row shards."""
    op = split_of(node)[0] if split_of(node) else node
    if op.target not in (aten.slice.Tensor, aten.narrow.default, *SPLITS) or op.target is aten.unbind.int:
        return None
    source, value = fake_tensor(op.args[0]), fake_tensor(node)
    if op.target in SPLITS:
        dim = op.args[2] if len(op.args) > 2 else 0
    else:
        dim = op.args[1]
    if source is None or value is None or not isinstance(dim, int) or source.dim() < 1 or value.dim() < 1:
        return None
    if dim % source.dim() != 0:
        return None
    rows, taken = source.shape[0], value.shape[0]
    if rows % world_size == 0 or not 0 < taken <= -(-rows // world_size):
        return None
    return taken, rows


def _column_block_dim(node: Node, world_size: int) -> int | None:
    """The dim (> 0) of which `node` takes 1/W, by slice, narrow or chunk / split; None otherwise."""
    op = split_of(node)[0] if split_of(node) else node
    if op.target not in (aten.slice.Tensor, aten.narrow.default, *SPLITS) or len(op.args) < 3:
        return None
    source, value = fake_tensor(op.args[0]), fake_tensor(node)
    dim = op.args[2] if op.target in SPLITS else op.args[1]
    if source is None or value is None or not isinstance(dim, int) or source.dim() < 2:
        return None
    dim %= source.dim()
    if dim == 0 or value.shape[dim] * world_size != source.shape[dim]:
        return None
    return dim


def _first_selections(found: list[Node]) -> list[Node]:
    """The rank-input selections if any (ShardedMuon), else the constant ones no other selection feeds."""
    by_input = [n for n in found if n.target in (aten.index_select.default, aten.index.Tensor)]
    if by_input:
        return by_input
    candidates = set(found)
    return [n for n in found if not (ancestors(n.all_input_nodes) & candidates)]


def _is_selection(node: Node, world_size: int, numel: int, group: str, aliases: Aliases, others: list[str]) -> bool:
    if node.op != "call_function" or not isinstance(node.args[0], Node):
        return False
    source = fake_tensor(node.args[0])
    if source is not None and source.dim() and source.shape[0] == world_size:
        if node.target is aten.index_select.default and node.args[1] == 0:
            require_rank_input(node.args[2])
            return True
        if node.target is aten.index.Tensor and len(node.args[1]) == 1:
            require_rank_input(node.args[1][0])
            return True
    owner = _block_owner(node, world_size, numel, aliases)
    rank = _this_rank(group) if owner is not None else None
    if owner is not None and rank is not None and owner != rank:
        # Not a selection of this rank's rows; it may still be part of the layout (a later op selects).
        others.append(f"{node.name} ({_op_short(node)}) takes rank {owner}'s rows of its "
                      f"[{world_size} x {numel}]-element result, but this process is rank {rank}")
    return owner is not None and owner == rank


def _block_owner(node: Node, world_size: int, numel: int, aliases: Aliases) -> int | None:
    """The rank whose `numel` elements of its source `node` holds, in order; None if it is no such block.

    Covers select / chunk / split / narrow / slicing / unbind alike: the
    selection (a view op replayed on a fake tensor) is a contiguous run of
    its source's elements, and the run's position says whose rows they are.
    Without a process group a constant selection cannot be checked: None.
    """
    value = fake_tensor(node)
    if value is None or value.numel() != numel or numel == 0:
        return None
    if not (is_view(node) or split_of(node)):
        return None
    src_value = fake_tensor(selection_source(node))
    if src_value is None or src_value.numel() != world_size * numel:
        return None
    inner = aliases.within_source(node)
    if inner is None or inner.stride != contiguous_strides(inner.shape) or inner.offset % numel:
        return None
    return inner.offset // numel


def _op_short(node: Node) -> str:
    (split,) = split_of(node) or (node,)
    return getattr(split.target, "__name__", str(split.target))


_INDEX_PLUMBING = {aten.view.default, aten.unsqueeze.default, aten.squeeze.dim, aten._unsafe_view.default}


def rank_input(selection: Node) -> Node | None:
    """The graph input holding the rank, when `selection` picks this rank's rows with it (not a constant)."""
    chain = index_plumbing(selection)
    if chain:
        return chain[-1].args[0]
    if selection.target is aten.index_select.default:
        return selection.args[2]
    if selection.target is aten.index.Tensor:
        return selection.args[1][0]
    return None


def index_plumbing(selection: Node) -> list[Node]:
    """The reshapes between the rank input and `selection`'s index (they die with it)."""
    if selection.target is aten.index_select.default:
        node = selection.args[2]
    elif selection.target is aten.index.Tensor:
        node = selection.args[1][0]
    else:
        return []
    chain = []
    while isinstance(node, Node) and node.target in _INDEX_PLUMBING:
        chain.append(node)
        node = node.args[0]
    return chain


def require_rank_input(index: Node) -> None:
    """The rank as data: a graph input, possibly reshaped."""
    node = index
    while isinstance(node, Node) and node.target in _INDEX_PLUMBING:
        node = node.args[0]
    if not (isinstance(node, Node) and node.op == "placeholder"):
        raise Declined(f"{getattr(index, 'name', index)} is not the rank: not a graph input")
    value = fake_tensor(node)
    if value is None or value.dtype not in (torch.int32, torch.int64) or value.numel() != 1:
        raise Declined(f"{node.name} is not the rank: expected a one-element integer tensor")


def _this_rank(group: str) -> int | None:
    process_group = resolve_process_group(group)
    return None if process_group is None else process_group.rank()
