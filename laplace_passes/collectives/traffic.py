"""Per-rank bytes of each collective in a graph, and Newton-Schulz work per rank.

Bytes are the data a rank must send to or receive from *other* ranks
(its own piece is not traffic), independent of the algorithm the library
picks, except all_reduce which is counted as reduce-scatter + all-gather
(2 (W-1)/W of the buffer):

    all_gather_into_tensor(x)   sent (W-1)|x|          received (W-1)|x|
    broadcast(x, src)           src sends (W-1)|x|     every other rank receives |x|
    all_to_all_single(x)        sent |x| - |x|/W       received |x| - |x|/W   (equal splits)
    reduce_scatter_tensor(x)    sent (W-1)|x|/W        received (W-1)|x|/W

A broadcast makes ranks differ; the report gives the worst rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import fake_tensor, is_collective

c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class CollectiveBytes:
    node: str
    op: str
    sent: tuple[int, ...]  # per rank
    received: tuple[int, ...]

    def as_dict(self) -> dict:
        return {"node": self.node, "op": self.op, "sent": max(self.sent), "received": max(self.received)}


def collective_bytes(gm: torch.fx.GraphModule, world_size: int) -> list[CollectiveBytes]:
    """One entry per collective node of `gm` (subgraphs of control flow are not searched)."""
    return [c for node in gm.graph.nodes if (c := count_node(node, world_size)) is not None]


def count_node(node: torch.fx.Node, world_size: int) -> CollectiveBytes | None:
    """The bytes of one collective node, or None when it is not one we account for."""
    counted = _count(node, world_size)
    return None if counted is None else CollectiveBytes(node.name, node.target.__name__.split(".")[0], *counted)


def _count(node: torch.fx.Node, W: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(sent, received) per rank, or None when `node` is not a collective we account for."""
    if not is_collective(node):
        return None
    value = fake_tensor(node.args[0])
    if value is None:
        return None
    size = value.numel() * value.element_size()
    target = node.target.overloadpacket
    if target is c10d.broadcast:
        src = node.args[1]
        sent = tuple((W - 1) * size if r == src else 0 for r in range(W))
        return sent, tuple(0 if r == src else size for r in range(W))
    symmetric = {
        c10d.all_gather_into_tensor: (W - 1) * size,
        c10d.all_to_all_single: size - size // W,
        c10d.reduce_scatter_tensor: (W - 1) * size // W,
        c10d.all_reduce: 2 * (W - 1) * size // W,
    }
    if target not in symmetric:
        return None
    return (symmetric[target],) * W, (symmetric[target],) * W


def per_rank_totals(collectives: list[CollectiveBytes], world_size: int) -> tuple[int, int]:
    """(sent, received) of the worst rank, summed over `collectives`."""
    sent = [sum(c.sent[r] for c in collectives) for r in range(world_size)]
    received = [sum(c.received[r] for c in collectives) for r in range(world_size)]
    return max(sent, default=0), max(received, default=0)


def muon_saving(received_ratio: float, ns_work_ratio: float | None) -> str:
    """What the rewrite saves per rank, in words: "receives x2.00 fewer bytes per rank", or at a ratio of 1.00
    (W = 2: two all-to-alls receive what the gather did) "receives the same bytes, half the Newton-Schulz work
    per rank". The ratios are before / after."""
    if f"{received_ratio:.2f}" != "1.00":
        return f"receives x{received_ratio:.2f} fewer bytes per rank"
    if ns_work_ratio is None or f"{ns_work_ratio:.2f}" == "1.00":
        return "receives the same bytes per rank"
    return f"receives the same bytes, {_share(1 / ns_work_ratio)} the Newton-Schulz work per rank"


def _share(fraction: float) -> str:
    named = {"0.50": "half", "0.25": "a quarter of", "0.33": "a third of"}
    return named.get(f"{fraction:.2f}", f"{fraction:.0%} of")
