"""The unroll pass: every sequential loop with a static trip count becomes straight-line code.

Runs twice in the pipeline (`laplace_passes.driver.pipeline`):
  * on the Dynamo graph, for user `scan` / `while_loop` (before AOT Autograd,
    which cannot differentiate a scan in torch 2.13: "scan might be aliasing
    the input or the output!");
  * on every ATen graph, for the GLA chunk-loop ops AOT Autograd placed there
    (`laplace::chunked_gla` forward, `laplace::chunked_gla_backward` backward)
    and any scan / while_loop still present.
See `chunk_loops` and `hop_loops` for each loop's graph before and after.
With `compile_bodies` (inner inductor on the cpu target), chunk-loop ops that
share a signature with another site of their graph are left whole instead,
each calling a body Inductor compiles once (`compiled_bodies`).

A loop whose trip count is not static (a while_loop bounded by an input, a
dynamic shape) is declined with the reason and left as it is: it still runs,
as a loop. Loops nested in a body are reached once the outer loop is inlined.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import graph_and_run_once_bodies
from laplace_passes.infra.pass_base import Declined, GraphPass, PassResult
from laplace_passes.infra.report import LoopRecord
from laplace_passes.unroll import chunk_loops, compiled_bodies, hop_loops
from laplace_passes.unroll.chunk_loops import ChunkLoopExpander
from laplace_passes.unroll.inline import erase_unused, getitem_users

LEVELS = ("dynamo", "aten")
# A loop the pass declined carries the reason in its meta: the graph itself says what was left, and why.
DECLINED_META_KEY = "laplace_unroll_declined"


class UnrollLoops(GraphPass):
    """Unroll scan / while_loop (and, on ATen graphs, GLA chunk-loop ops) with static trip counts."""

    name = "unroll_loops"

    def __init__(self, level: str, decompositions: dict | None = None, chunk_recurrence: str = "unrolled",
                 compile_bodies: bool = False) -> None:
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        if compile_bodies and chunk_recurrence != "op":
            raise ValueError("compile_bodies needs chunk_recurrence='op': a compiled body keeps its recurrence whole")
        self.level = level
        # chunk_recurrence: "op" keeps a GLA chunk loop's state recurrence as one node (ChunkLoopExpander).
        self.chunk_loops = ChunkLoopExpander(decompositions, chunk_recurrence)
        # compile_bodies: a chunk-loop op with static sizes stays one node whose body Inductor compiles once
        # per signature (NOTE [chunk-loop bodies compiled once] in `laplace_passes.unroll.compiled_bodies`).
        self.compile_bodies = compile_bodies
        self._sites_per_signature: Counter = Counter()  # this graph's chunk-loop sites, counted as `call` begins

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        records: list[LoopRecord] = []
        self._sites_per_signature = _sites_per_signature(gm) if self.compile_bodies else Counter()
        for where, graph_module in self._graphs(gm):
            found_here = self._unroll_all(graph_module)
            for record in found_here:
                record.node = where + record.node
            records += found_here
        declined = [f"{r.node} ({r.kind}): {r.reason}" for r in records if r.status == "declined"]
        modified = any(r.status != "declined" for r in records)
        return PassResult(gm, modified=modified, summary=_summary(records), declined=declined, loops=records)

    def _graphs(self, gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
        """The graph, and on Dynamo graphs the bodies it calls once (NOTE [run-once bodies] in
        `laplace_passes.infra.fx_helpers`): a loop under activation checkpointing is in one of those.
        AOT Autograd inlines them, so an ATen graph has none."""
        return graph_and_run_once_bodies(gm) if self.level == "dynamo" else [("", gm)]

    def _unroll_all(self, gm: torch.fx.GraphModule) -> list[LoopRecord]:
        """Every loop of `gm`'s own graph unrolled or declined, the loops its bodies bring in included."""
        records: list[LoopRecord] = []
        declined_nodes: set[torch.fx.Node] = set()
        while True:  # inlining a body can bring nested loops into the graph
            pending = [n for n in gm.graph.nodes if self._is_loop(n) and n not in declined_nodes]
            if not pending:
                break
            for node in pending:
                before = set(gm.graph.nodes)
                bodies = [a for a in node.all_input_nodes if a.op == "get_attr"]
                record = self._unroll(gm, node)
                records.append(record)
                if record.status == "declined":
                    declined_nodes.add(node)
                    node.meta[DECLINED_META_KEY] = record.reason
                else:
                    erase_unused([n for n in gm.graph.nodes if n not in before] + bodies)
        if any(r.status == "unrolled" for r in records):
            gm.delete_all_unused_submodules()
        return records

    def ensures(self, gm: torch.fx.GraphModule) -> None:
        # Only declined loops may remain; anything else means a rewrite was skipped.
        left = [where + n.name for where, graph_module in self._graphs(gm) for n in graph_module.graph.nodes
                if self._is_loop(n) and DECLINED_META_KEY not in n.meta]
        if left:
            raise RuntimeError(f"unroll_loops left loops it did not decline: {left}")

    def _is_loop(self, node: torch.fx.Node) -> bool:
        return hop_loops.is_hop_loop(node) or (self.level == "aten" and chunk_loops.is_chunk_loop(node))

    def _unroll(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> LoopRecord:
        """Count the trips, then unroll; the record says which step declined and why."""
        kind = chunk_loops.loop_kind(node) if chunk_loops.is_chunk_loop(node) else hop_loops.loop_kind(node)
        record = LoopRecord(node=node.name, kind=kind, trip_count=None, status="declined")
        try:
            record.trip_count, unroll = self._count(gm, node)
            if self._compiles_body(node):
                node.target = compiled_bodies.TWINS[node.target]  # same arguments, same outputs
                record.status = "compiled"
                return record
            # Every kind of loop is replaced through its getitem users (inline.replace_tuple_result).
            if getitem_users(node) is None:
                raise Declined("its result is used as a whole, not through indexing")
            unroll()
        except Declined as declined:
            record.reason = declined.reason
            return record
        record.status = "unrolled"
        return record

    def _compiles_body(self, node: torch.fx.Node) -> bool:
        """A chunk-loop op left whole for its compiled body: one of several sites of a signature in this graph.

        Static sizes only (a symbolic one gets the inlined body, which takes
        it). A site alone in its graph is inlined: its body would be
        compiled once either way, and inlined it ran faster (NOTE [chunk-loop
        bodies compiled once]).
        """
        return self._sites_per_signature[_site_signature(node)] >= 2

    def _count(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[int, Callable[[], None]]:
        """The loop's trip count, and what unrolls it; Declined when the count is not static."""
        if chunk_loops.is_chunk_loop(node):
            return chunk_loops.chunk_count(node), lambda: self.chunk_loops.expand(gm, node)
        if hop_loops.loop_kind(node) == "scan":
            trips = hop_loops.scan_trip_count(node)
            return trips, lambda: hop_loops.unroll_scan(gm, node, trips)
        trips, history = hop_loops.while_trip_count(gm, node)  # history: each counter's value per trip
        return trips, lambda: hop_loops.unroll_while(gm, node, trips, history)


def _site_signature(node: torch.fx.Node) -> tuple | None:
    """A chunk-loop op's signature from its arguments' fake values (`compiled_bodies.signature`); None if not static."""
    if not chunk_loops.is_chunk_loop(node):
        return None
    args = compiled_bodies.static_arguments(node)
    return None if args is None else compiled_bodies.signature(node.target, args)


def _sites_per_signature(gm: torch.fx.GraphModule) -> Counter:
    return Counter(key for key in map(_site_signature, gm.graph.nodes) if key is not None)


def _summary(records: list[LoopRecord]) -> str:
    """e.g. 'unrolled 2 loops (2 x laplace.chunked_gla, 16 trips); declined 1', or with compiled bodies
    'unrolled 0 loops; 2 loops kept whole, their bodies compiled once per shape (2 x laplace.chunked_gla, 32 trips)'."""
    if not records:
        return "no sequential loop"
    text = f"unrolled {_plural(_count_of(records, 'unrolled'), 'loop')}{_groups(records, 'unrolled')}"
    compiled = _count_of(records, "compiled")
    if compiled:
        text += (f"; {_plural(compiled, 'loop')} kept whole, their bodies compiled once per shape"
                 f"{_groups(records, 'compiled')}")
    declined = _count_of(records, "declined")
    return text + (f"; declined {declined}" if declined else "")


def _count_of(records: list[LoopRecord], status: str) -> int:
    return sum(r.status == status for r in records)


def _groups(records: list[LoopRecord], status: str) -> str:
    """' (2 x laplace.chunked_gla, 16 trips)': the loops with `status`, by kind and trip count."""
    groups: dict[tuple, int] = {}
    for r in records:
        if r.status == status:
            groups[(r.kind, r.trip_count)] = groups.get((r.kind, r.trip_count), 0) + 1
    if not groups:
        return ""
    return " (" + ", ".join(f"{n} x {kind}, {_plural(trips, 'trip')}" for (kind, trips), n in groups.items()) + ")"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
