"""What a gathered value looks like before the Muon matcher takes it apart (see `match.py`).

`dist.all_gather_into_tensor(out, x)` arrives functionalised as a copy into
a fresh buffer (folded away here); a gather of values Newton-Schulz already
produced (KellerJordan's round-robin) and a flat buffer cut by element
ranges (Megatron's layout) are told apart, each with the reason the pass
reports.
"""

from __future__ import annotations

import torch
import torch.fx

from laplace_passes.collectives.regions import live_users
from laplace_passes.infra.fx_helpers import ancestors, fake_tensor
from laplace_passes.infra.pass_base import Declined

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
Node = torch.fx.Node

ALL_GATHER = c10d.all_gather_into_tensor.default
BROADCAST = c10d.broadcast.default
WAIT = c10d.wait_tensor.default


def check_gathers_before_newton_schulz(send: Node, ns_by_input, owner_only) -> None:
    """KellerJordan's round-robin: each owner orthogonalises, then the updated parameters are gathered."""
    upstream = ancestors([send])
    computed = [ns for ns in ns_by_input.values() if ns.output in upstream]
    computed += [info.newton_schulz for info in owner_only.values() if info.getitem in upstream]
    if computed:
        raise Declined(
            f"Newton-Schulz already runs on its owner ({computed[0].output.name} feeds the send {send.name}); "
            "the gather carries updated parameters: there is no gather before Newton-Schulz to remove"
        )


def fold_copies_into_new_buffers(graph: torch.fx.Graph) -> int:
    """`dist.all_gather_into_tensor(out, x)` is functionalised as copy(new_empty(...), wait): out is wait.

    The copy writes every element of a buffer nothing else reads, so its
    users can read the gathered value directly (same values, same dtype).
    Returns how many copies were folded (the graph changed when any).
    `dist.all_gather(list, x)` is the same with one buffer per rank, each
    `copy(empty_like(x), slice(wait, 0, ...))`: a row block of the gathered
    value, contiguous, so read directly as well.
    """
    folded = 0
    for node in list(graph.nodes):
        if node.target is not WAIT or not isinstance(node.args[0], Node) or node.args[0].target is not ALL_GATHER:
            continue
        pieces = [u for u in node.users if u.target is aten.slice.Tensor and u.args[1] == 0]
        for source in [node, *pieces]:
            for user in list(source.users):
                if _copy_into_fresh_buffer(user, source):
                    buffer = user.args[0]
                    user.replace_all_uses_with(source)
                    graph.erase_node(user)
                    graph.erase_node(buffer)
                    folded += 1
    return folded


def _copy_into_fresh_buffer(user: Node, source: Node) -> bool:
    if user.target is not aten.copy.default or user.args[1] is not source or not _fresh_buffer(user.args[0]):
        return False
    into, read = fake_tensor(user), fake_tensor(source)
    return into.shape == read.shape and into.dtype == read.dtype and read.is_contiguous()


def _fresh_buffer(node) -> bool:
    return isinstance(node, Node) and node.target in (
        aten.new_empty.default, aten.empty.memory_format, aten.empty_like.default, aten.new_empty_strided.default
    ) and len(node.users) == 1


def feeds_whole(wait: Node, live: set[Node]) -> bool:
    """The gathered value reaches Newton-Schulz whole (through views), not cut into element ranges."""
    node = wait
    while True:
        users = live_users(node, live)
        if len(users) != 1 or users[0].target not in (aten.view.default, aten._unsafe_view.default):
            return not any(u.target is aten.slice.Tensor for u in users)
        node = users[0]


def element_ranges(wait: Node, width: int, world_size: int, live: set[Node]) -> Declined:
    """Megatron's layout: rank r holds elements [r L, (r+1) L) of the concatenated matrices."""
    spans = []
    for user in live_users(wait, live):
        if user.target is aten.slice.Tensor and user.args[1] == 0:
            start, end = user.args[2], min(user.args[3], width * world_size)
            ranks = sorted({start // width, (end - 1) // width}) if end > start else []
            spans.append(f"elements {start}..{end} from rank(s) {'-'.join(map(str, ranks))}")
    detail = "; ".join(spans[:3]) + ("; ..." if len(spans) > 3 else "")
    return Declined(
        f"element-range shards cross matrix boundaries: each rank sends {width} elements of one flat buffer and "
        f"the matrices are cut from the gathered buffer by element ranges ({detail or 'no matrix slices'}), "
        f"not one row block of every matrix from every rank"
    )
