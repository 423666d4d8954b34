"""What the passes did, in a form users can read, diff and serialise.

One `Report` gathers every graph a compile produced (the Dynamo graphs, then
the forward and backward ATen graphs AOT Autograd derives from them), a
snapshot of each graph before and after every pass, one record per pass run
(applied or declined, with the reason), and one record per GLA site with its
chunk plan.
"""

from __future__ import annotations

import copy
import json
import logging
import operator
import re
from collections import Counter, deque
from dataclasses import asdict, dataclass, field

import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from laplace_passes.infra.op_facts import op_name

STAGES = ("before", "after")


@dataclass
class SiteRecord:
    """One GLA call found in a graph."""

    graph: str
    node: str
    origin: str
    status: str  # "retiled" or "declined"
    reason: str | None = None
    plan: dict | None = None  # T, chunk_size, n_chunks, padding
    shape: dict | None = None  # B, H, K, V, dtype
    saved_bytes: int | None = None  # kept for the explicit backward: q, k, v, gk, initial_state (and the residuals)
    form: str | None = None  # "chunked" or "recurrent" (short sites, decode), and why
    gates: str | None = None  # "<= 0 by construction: ..." (no run-time check) or "checked at run time: ..."


@dataclass
class RecurrenceRecord:
    """A loop in a graph that carries a state from step to step: rewritten as a GLA site, or why not."""

    graph: str
    node: str  # its first state update
    steps: int
    state: list[int]  # the state's shape
    status: str  # "GLA site" or "declined"
    form: str = ""  # how it was written: "token loop, 256 steps, per-key gates, ..."
    reason: str | None = None


@dataclass
class PassRecord:
    """One pass run over one graph."""

    name: str
    graph: str
    modified: bool
    nodes_before: int
    nodes_after: int
    summary: str = ""
    declined: list[str] = field(default_factory=list)
    findings: list = field(default_factory=list)  # the preflight's `Finding`s (lowering/checks.py)


@dataclass
class TrafficRecord:
    """Per-rank communication and Newton-Schulz work of one graph, before and after a rewrite.

    Bytes are those of the worst rank; `before` / `after` hold one entry per
    collective ({"node", "op", "sent", "received"}). `lower_bound_bytes` is
    2 (W-1) G / W^2 for G = `matrix_bytes`, what two all-to-alls with one
    owner per matrix must receive at least.
    """

    graph: str
    world_size: int
    ownership: str  # "uniform" (same slots on every rank) or "balanced" (cond per owner)
    matrices: int
    padding_matrices: int
    matrix_bytes: int
    lower_bound_bytes: int
    before: list[dict]
    after: list[dict]
    sent_before: int
    received_before: int
    sent_after: int
    received_after: int
    received_ratio: float  # received_before / received_after
    ns_flops_before: int
    ns_flops_after: int
    # Each ownership plan over the whole graph: {"kind", "chosen", "received" (bytes per rank), "ns_flops"
    # (the busiest rank's Newton-Schulz FLOPs), "zero_matrices", "owner_branches" (conds), "why"}.
    plans: list[dict] = field(default_factory=list)


@dataclass
class LoopRecord:
    """One sequential loop in a graph: unrolled into straight-line code, or declined and why."""

    node: str
    kind: str  # "laplace.chunked_gla", "laplace.chunked_gla_backward", "scan" or "while_loop"
    trip_count: int | None
    status: str  # "unrolled", "compiled" (a chunk-loop op kept whole, its body compiled once per shape) or "declined"
    reason: str | None = None


@dataclass
class PartitionRecord:
    """One piece of a graph cut to fit the instruction budget, compiled on its own."""

    index: int
    nodes: int
    instructions: int
    bytes_in: int  # bytes it receives from earlier partitions


@dataclass
class SizeRecord:
    """A graph's estimated size against the target's budget (see `laplace_passes.unroll.size`)."""

    nodes: int
    instructions: int  # estimated
    budget: int | None  # None: the target sets no limit
    partitions: list[PartitionRecord] = field(default_factory=list)  # empty: compiled whole
    cut_bytes: list[int] = field(default_factory=list)  # bytes crossing the cut after partition i
    saved_for_backward_bytes: int | None = None  # backward graphs: activations the forward kept
    note: str | None = None  # e.g. why an over-budget graph could not be cut
    # The TensorEngine's use (laplace_passes.unroll.tiles): matmul FLOPs on whole 128 x 128 tiles, small products.
    whole_tile_share: float | None = None
    small_products: int | None = None


@dataclass
class GraphRecord:
    """One graph: its kind and its snapshots (the input, then after each pass)."""

    name: str
    kind: str  # "dynamo", "forward", "backward" or "inference"
    snapshots: list[tuple[str, torch.fx.GraphModule]] = field(default_factory=list)
    loops: list[LoopRecord] = field(default_factory=list)
    size: SizeRecord | None = None
    traffic: TrafficRecord | None = None  # set by the Muon all-to-all rewrite
    # A Dynamo graph's inputs as the user passed them ("args[0][3]", "self.layers.0.weight"), in order:
    # the order of the forward and inference graphs' (and their modules') inputs too.
    input_sources: list[str] = field(default_factory=list)
    # Dynamo's compile id of the frame the graph came from ("0/0"): a restarted analysis compiles it again.
    compile_id: str | None = None

    def snapshot(self, label: str, gm: torch.fx.GraphModule, modified: bool = True) -> None:
        """Keep a copy of `gm` as it is after `label`; a pass that changed nothing shares the previous copy.

        "Nothing" is checked, not taken on trust: the same node count and the
        same graph-level annotations (`gm.meta`, where passes leave findings).
        """
        if not modified and self.snapshots:
            previous = self.snapshots[-1][1]
            if len(previous.graph.nodes) == len(gm.graph.nodes) and _same_entries(previous.meta, gm.meta):
                self.snapshots.append((label, previous))
                return
        self.snapshots.append((label, copy_graphs(gm)))

    @property
    def before(self) -> torch.fx.GraphModule:
        return self.snapshots[0][1]

    @property
    def after(self) -> torch.fx.GraphModule:
        return self.snapshots[-1][1]

    def op_counts(self, stage: str = "after") -> dict[str, int]:
        gm = self.before if stage == "before" else self.after
        return dict(Counter(op_name(n) for n in gm.graph.nodes if n.op == "call_function"))

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "nodes_before": _node_count(self.before),
            "nodes_after": _node_count(self.after),
            "passes": [label for label, _ in self.snapshots[1:]],
            "loops": [asdict(loop) for loop in self.loops],
            "size": asdict(self.size) if self.size is not None else None,
            "traffic": asdict(self.traffic) if self.traffic is not None else None,
        }


def _same_entries(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[key] is b[key] for key in a)


def copy_graphs(gm: torch.fx.GraphModule, class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """`gm` with its graph copied, and the graphs of the subgraphs it reads (loop bodies, branches).

    Tensors and other attributes are shared: cheap, and later passes
    mutating `gm` or its subgraphs cannot change what the user inspects.
    The graph-level annotations passes leave in `gm.meta` are kept.
    """
    # Lazy: its Python code is generated when first read (`.code`, a call), not
    # for every snapshot of every pass; most snapshots are never read.
    copied = _LazyGraphModule(gm, copy.deepcopy(gm.graph), class_name=class_name)
    copied.meta = dict(gm.meta)
    done = set()
    for node in copied.graph.nodes:
        if node.op == "get_attr" and node.target not in done:
            done.add(node.target)
            value = operator.attrgetter(node.target)(copied)
            if isinstance(value, torch.fx.GraphModule):
                copied.set_submodule(node.target, copy_graphs(value, type(value).__name__))
    return copied


class Report:
    """Everything one compile (or one `inspect`) did."""

    def __init__(self, target: str = "", inner: str = "") -> None:
        self.target = target
        self.inner = inner
        self.graphs: list[GraphRecord] = []
        self.passes: list[PassRecord] = []
        self.sites: list[SiteRecord] = []
        self.recurrences: list[RecurrenceRecord] = []
        self.notes: list[str] = []
        # Where Dynamo split the captured function (`inspect`, `export`, `preflight`; infra/graph_breaks.py).
        self.graph_breaks: list[str] = []
        self._compile_starts: dict[str, int] = {}  # Dynamo compile id -> index of its first graph (attempt_begins)
        # Graphs with symbolic sizes (laplace_passes.driver.shapes): "graph input dim i = symbol" per dynamic
        # dimension, and one entry per concrete shape compiled on its own for a static-shape target.
        self.dynamic_dims: list[str] = []
        self.specialised: list[str] = []

    # -- building -----------------------------------------------------------
    def new_graph(self, kind: str, gm: torch.fx.GraphModule) -> GraphRecord:
        index = self.count(kind)
        record = GraphRecord(name=f"{kind}_{index}", kind=kind)
        record.snapshot("input", gm)
        self.graphs.append(record)
        return record

    def attempt_begins(self, compile_id: str, attempt: int) -> None:
        """Dynamo compiles frame `compile_id` ("0/0"); a second attempt (it restarted its analysis) replaces the
        graphs the first one left, with their passes, sites and loops: the report shows what runs, once."""
        if attempt == 0:  # where this compile's graphs begin (a reset() starts the ids again: not earlier ones)
            self._compile_starts[compile_id] = len(self.graphs)
            return
        start = self._compile_starts.get(compile_id, len(self.graphs))
        gone = {g.name for g in self.graphs[start:] if g.compile_id == compile_id}
        if not gone:
            return
        self.graphs = [g for g in self.graphs if g.name not in gone]
        self.passes = [p for p in self.passes if p.graph not in gone]
        self.sites = [s for s in self.sites if s.graph not in gone]
        self.recurrences = [r for r in self.recurrences if r.graph not in gone]

    # -- reading ------------------------------------------------------------
    def count(self, kind: str) -> int:
        """How many graphs of `kind` ("dynamo", "forward", ...) the report holds."""
        return sum(1 for g in self.graphs if g.kind == kind)

    def graph(self, stage: str = "after", name: str | None = None) -> torch.fx.GraphModule:
        """The graph `name` (default: the first Dynamo graph) before or after the passes."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        record = self._find(name)
        return record.before if stage == "before" else record.after

    @property
    def traffic(self) -> list[TrafficRecord]:
        """The Muon rewrite's traffic records, one per rewritten graph."""
        return [g.traffic for g in self.graphs if g.traffic is not None]

    def graph_record(self, name: str | None = None) -> GraphRecord:
        return self._find(name)

    def _find(self, name: str | None) -> GraphRecord:
        if not self.graphs:
            raise LookupError("this report holds no graph: nothing was compiled")
        if name is None:
            return self.graphs[0]
        for record in self.graphs:
            if record.name == name:
                return record
        raise LookupError(f"no graph named {name!r}; graphs: {', '.join(g.name for g in self.graphs)}")

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "inner": self.inner,
            "graphs": [g.to_dict() for g in self.graphs],
            "passes": [asdict(p) for p in self.passes],
            "sites": [asdict(s) for s in self.sites],
            "recurrences": [asdict(r) for r in self.recurrences],
            "notes": list(self.notes),
            "graph_breaks": list(self.graph_breaks),
            "dynamic_dims": list(self.dynamic_dims),
            "specialised": list(self.specialised),
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [f"laplace_passes report: target={self.target} inner={self.inner}"]
        lines += _table(
            "graphs",
            ["graph", "kind", "nodes before", "nodes after"],
            [[g.name, g.kind, _node_count(g.before), _node_count(g.after)] for g in self.graphs],
        )
        lines += _table(
            "passes",
            ["pass", "graph", "result", "nodes", "summary"],
            [
                [p.name, p.graph, "applied" if p.modified else "no change",
                 f"{p.nodes_before} -> {p.nodes_after}", p.summary]
                for p in self.passes
            ],
        )
        lines += _table(
            "declined",
            ["pass", "graph", "reason"],
            [[p.name, p.graph, reason] for p in self.passes for reason in p.declined],
        )
        lines += _table(
            "GLA sites",
            ["graph", "node", "origin", "status", "T", "chunk", "chunks", "padding", "saved for bwd", "gates",
             "form / reason"],
            [
                [s.graph, s.node, s.origin, s.status,
                 *(_plan_cells(s.plan)), _bytes(s.saved_bytes) if s.saved_bytes is not None else "",
                 s.gates or "", s.reason or s.form or ""]
                for s in self.sites
            ],
        )
        lines += _table(
            "recurrences (loops carrying a state)",
            ["graph", "node", "steps", "state", "status", "form / reason"],
            [[r.graph, r.node, r.steps, r.state, r.status, r.reason or r.form] for r in self.recurrences],
        )
        lines += _loop_and_size_tables(self.graphs)
        if self.traffic:
            lines += _traffic_tables(self.traffic)
        lines += _shape_lines(self.dynamic_dims, self.specialised)
        lines += [f"graph break (the Python around it runs in no graph): {b}" for b in self.graph_breaks]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines + legend(lines))

    __repr__ = __str__


def _loop_and_size_tables(graphs: list[GraphRecord]) -> list[str]:
    """Loops per graph (grouped by kind and trip count), then sizes against the budget."""
    groups: dict[tuple, int] = {}
    for g in graphs:
        for loop in g.loops:
            key = (g.name, loop.kind, loop.trip_count, loop.status, loop.reason or "")
            groups[key] = groups.get(key, 0) + 1
    lines = _table(
        "loops",
        ["graph", "kind", "trips", "count", "status", "reason"],
        [[name, kind, "" if trips is None else trips, n, status, reason]
         for (name, kind, trips, status, reason), n in groups.items()],
    )
    sized = [g for g in graphs if g.size is not None]
    lines += _table(
        "graph sizes (estimated instructions)",
        ["graph", "nodes", "instructions", "budget", "partitions", "bytes across cuts", "saved for bwd",
         "whole-tile mm", "small mm", "note"],
        [[g.name, g.size.nodes, g.size.instructions, "none" if g.size.budget is None else g.size.budget,
          len(g.size.partitions) or 1, ", ".join(_bytes(b) for b in g.size.cut_bytes),
          "" if g.size.saved_for_backward_bytes is None else _bytes(g.size.saved_for_backward_bytes),
          "" if g.size.whole_tile_share is None else f"{g.size.whole_tile_share:.0%}",
          "" if g.size.small_products is None else g.size.small_products, g.size.note or ""]
         for g in sized],
    )
    parts = [(g.name, p) for g in sized for p in g.size.partitions]
    if parts:
        lines += _table(
            "partitions",
            ["graph", "partition", "nodes", "instructions", "bytes in"],
            [[name, p.index, p.nodes, p.instructions, _bytes(p.bytes_in)] for name, p in parts],
        )
    return lines


def _shape_lines(dynamic_dims: list[str], specialised: list[str]) -> list[str]:
    if not dynamic_dims:
        return []
    lines = ["dynamic dimensions: " + "; ".join(dynamic_dims)]
    if specialised:
        count = len(specialised)
        lines.append(f"{count} shape{'' if count == 1 else 's'} specialised (each compiled statically on its own): "
                     + "; ".join(specialised))
    return lines


def _traffic_tables(records: list[TrafficRecord]) -> list[str]:
    lines = _table(
        "Muon traffic per rank (worst rank)",
        ["graph", "W", "ownership", "matrices", "zero pads", "received before", "received after", "ratio",
         "lower bound", "NS GFLOP before", "NS GFLOP after"],
        [
            [t.graph, t.world_size, t.ownership, t.matrices, t.padding_matrices, _bytes(t.received_before),
             _bytes(t.received_after), f"{t.received_ratio:.2f}x", _bytes(t.lower_bound_bytes),
             f"{t.ns_flops_before / 1e9:.3g}", f"{t.ns_flops_after / 1e9:.3g}"]
            for t in records
        ],
    )
    lines += _table(
        "Muon ownership plans compared (per rank; 'uniform' is branch-free)",
        ["graph", "plan", "chosen", "received", "NS GFLOP busiest rank", "zero matrices", "owner branches", "why"],
        [
            [t.graph, p["kind"], "yes" if p["chosen"] else "", _bytes(p["received"]), f"{p['ns_flops'] / 1e9:.3g}",
             p["zero_matrices"], p["owner_branches"], p["why"]]
            for t in records
            for p in t.plans
        ],
    )
    return lines + _table(
        "Muon collectives per rank",
        ["graph", "stage", "node", "op", "sent", "received"],
        [
            [t.graph, stage, c["node"], c["op"], _bytes(c["sent"]), _bytes(c["received"])]
            for t in records
            for stage, entries in (("before", t.before), ("after", t.after))
            for c in entries
        ],
    )


# What a column means, for the columns a newcomer cannot guess; `legend` lists those of the tables shown.
COLUMNS = {
    "origin": "what the GLA call was found as: laplace::gla, an fla function, or a recognised loop",
    "T": "the sequence length the site runs at",
    "chunk": "the chunk size the site was re-tiled to (tokens per chunk)",
    "chunks": "T / chunk, rounded up",
    "padding": "tokens appended so T fills the last chunk (sliced off after)",
    "saved for bwd": "bytes the forward keeps for the backward (a GLA site's q, k, v, gk, state and residuals; "
                     "a backward graph's inputs from its forward)",
    "gates": "how gk <= 0 holds: by construction (no check) or checked at run time; not checked (a lowered graph): "
             "unproven gates of a recognised loop, whose token steps run as written",
    "trips": "iterations of the loop",
    "count": "loops of this kind, trip count and status",
    "instructions": "the graph's size estimated in the target compiler's instructions",
    "budget": "the target's instruction limit per graph (none: no limit); graphs above it are cut into partitions",
    "bytes across cuts": "bytes passed from one partition to the next, per cut",
    "whole-tile mm": "share of the matmul FLOPs on whole 128 x 128 TensorEngine tiles (the rest leaves it idle)",
    "small mm": "matmul products (batch elements) with K or max(M, N) under 128: they fill part of the TensorEngine",
    "W": "ranks (world size)",
    "ownership": "uniform: the same slots on every rank, branch-free; balanced: a cond per owner",
    "zero pads": "zero matrices added so every rank owns as many",
    "received before": "bytes the busiest rank receives per step, before the rewrite (gathers)",
    "received after": "the same after the rewrite (two all-to-alls)",
    "ratio": "received before / received after",
    "lower bound": "the least two all-to-alls with one owner per matrix can receive: 2 (W-1) G / W^2",
    "NS GFLOP before": "Newton-Schulz GFLOP on the busiest rank, before the rewrite",
    "NS GFLOP after": "the same after the rewrite (each rank orthogonalises only the matrices it owns)",
    "received": "bytes the busiest rank receives per step under this plan",
    "NS GFLOP busiest rank": "Newton-Schulz GFLOP of the busiest rank under this plan",
    "owner branches": "conds choosing a rank's matrices at run time (0: branch-free)",
}


def legend(lines: list[str]) -> list[str]:
    """One line per explained column of the tables in `lines` (a table: its title line, then its header)."""
    shown = set()
    for title, header in zip(lines, lines[1:]):
        if not title.startswith(" ") and title.endswith(":") and header.startswith("  "):
            shown.update(re.split(r"\s{2,}", header.strip()))
    explained = [name for name in COLUMNS if name in shown]
    if not explained:
        return []
    width = max(len(name) for name in explained)
    return ["columns:"] + [f"  {name:<{width}}  {COLUMNS[name]}" for name in explained]


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _plan_cells(plan: dict | None) -> list:
    if plan is None:
        return ["", "", "", ""]
    return [plan["T"], plan["chunk_size"], plan["n_chunks"], plan["padding"]]


def _node_count(gm: torch.fx.GraphModule) -> int:
    return len(gm.graph.nodes)


def _table(title: str, header: list[str], rows: list[list]) -> list[str]:
    if not rows:
        return [f"{title}: none"]
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda row: "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return [f"{title}:", fmt(cells[0])] + [fmt(r) for r in cells[1:]]


# The reports of recent compiles, newest last, for `last_report()`: users of
# plain `torch.compile(backend="laplace")` have no other handle on them.
_RECENT: deque[Report] = deque(maxlen=32)


def remember(report: Report) -> None:
    if not any(r is report for r in _RECENT):
        _RECENT.append(report)


def last_report() -> Report:
    """The report of the most recent `laplace` compile in this process."""
    if not _RECENT:
        raise LookupError("no laplace compile has run in this process yet")
    return _RECENT[-1]


class _RecompileLimitHits(logging.Handler):
    """NOTE [calls past Dynamo's recompile limit]: once Dynamo has compiled a function its
    `recompile_limit` times, the function's later calls run uncompiled and no laplace compile takes
    place, so `last_report()` would go on showing an earlier compile as if it were the latest call's.
    Dynamo's warning is caught here and becomes a note on the latest report: which function runs
    uncompiled from then on, and why."""

    def emit(self, record: logging.LogRecord) -> None:
        if not (_RECENT and str(record.msg).startswith("torch._dynamo hit config.")
                and isinstance(record.args, tuple) and len(record.args) >= 3):
            return
        limit_type, limit, function = record.args[:3]
        _RECENT[-1].notes.append(
            f"{function}: a later call ran uncompiled, as will every call after it: Dynamo hit "
            f"config.{limit_type} ({limit}), so no laplace compile took place and this report is of an earlier "
            "compile (TORCH_LOGS=recompiles says why it recompiled; dynamic shapes or seq_buckets avoid a compile "
            "per shape)")


# Dynamo's logger for the warning; a child of the loggers torch's logging setup clears and configures.
logging.getLogger("torch._dynamo.convert_frame").addHandler(_RecompileLimitHits())
