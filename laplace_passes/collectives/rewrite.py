"""The Muon rewrite: gather-then-orthogonalise becomes two all-to-alls with one owner per matrix.

NOTE [muon_all_to_all: before and after]
Before (ShardedMuon, comm="all_gather", W = 2, a 10 x 6 and a 7 x 7 matrix;
`u_i` is this rank's bf16 row shard of matrix i, zero-padded to 5 x 6 and
4 x 7; arg4_1 is the rank as a tensor):

    cat = aten.cat([view(u_0, [-1]), view(u_1, [-1])])                    # [58]
    all_gather_into_tensor = _c10d_functional.all_gather_into_tensor(cat, 2, '0')
    view_2 = aten.view(wait_tensor(all_gather_into_tensor), [2, -1])       # [W, 58]
    slice_1 = aten.slice(view_2, 1, 0, 30)   ... _unsafe_view -> [10, 6]   # unpad
    permute = aten.permute(_unsafe_view, [1, 0]); ... addmm ... permute_3  # Newton-Schulz, every rank
    view_7 = aten.view(permute_3, [2, 5, 6])                               # layout per rank
    index_select = aten.index_select(view_7, 0, view(arg4_1, [1]))         # my rows
    (the same for matrix 1, from slice(view_2, 1, 30, 58))
    add = aten.add(mul, squeeze(index_select), alpha=-lr')                # the update

After (rank 0 owns the 10 x 6 matrix, rank 1 the 7 x 7 one: a "balanced"
plan, see plan.py; no rank constant anywhere):

    cat_default = aten.cat([view(u_0, [-1]), view(u_1, [-1]), full_default])  # to owner 0 | to owner 1 (+2 zeros)
    all_to_all_single_default = _c10d_functional.all_to_all_single(cat_default, [30, 30], [30, 30], '0')
    view_default = aten.view(wait_tensor(all_to_all_single_default), [2, 30])   # [W sources, chunk]
    cond = higher_order.cond(eq(arg4_1, 0), _laplace_muon_owner_0_0, _laplace_muon_not_owner_0, (view_default,))
    cond_1 = higher_order.cond(eq(arg4_1, 1), _laplace_muon_owner_1_0, _laplace_muon_not_owner_0, (view_default,))
    where_self = aten.where(eq(arg4_1, 1), cond_1[0], cond[0])                 # this rank's owner work
    all_to_all_single_default_1 = _c10d_functional.all_to_all_single(view(where_self, [-1]), [30, 30], [30, 30], '0')
    view_default_2 = aten.view(wait_tensor(all_to_all_single_default_1), [2, 30])  # [W owners, chunk]
    view_default_3 = aten.view(aten.slice(aten.select(view_default_2, 0, 0), 0, 0, 30), [1, 5, 6])
    add = aten.add(mul, squeeze(view_default_3), alpha=-lr')              # the update, unchanged

    _laplace_muon_owner_0_0(received):   # the original ops, copied: unpad, Newton-Schulz, layout
        view_3 = aten.view(aten.slice(received, 1, 0, 30), [2, 5, 6]) ... permute ... addmm ...
        return (aten.cat([aten.view(clone(view_7), [2, 30])], 1),)          # [W destinations, chunk]

Per-matrix gathers (one `all_gather_into_tensor` of a [s, c] row shard per
matrix, own rows by `chunk(W)[rank]`, `narrow`, slicing, ...) are planned
together: every gather of one group and dtype becomes part of one pair of
all-to-alls (pack slices every send buffer, or takes the pieces of a flat
send `cat` directly, which then dies with the gather; the owner views its
[W, numel] block back to the gathered [W * s, c] shape before the user's
own ops).
In a graph whose rank is a constant (`dist.get_rank()` baked in), a
balanced plan emits only this rank's owner work, without `cond`.

The plan is applied only when the received bytes per rank fall, or stay
equal (W = 2: 2 (W-1) G / W^2 = (W-1) G / W) while the Newton-Schulz FLOPs
per rank fall; otherwise the gathers are kept and the reason gives both
byte counts, the chunk and the plan.

When every shape group's count is a multiple of W (a "uniform" plan), there
is no cond: every rank runs the same slots, e.g. one 10 x 6 and one 7 x 7
matrix each when there are two of both. With comm="gather_broadcast" the
baseline holds `cond(rank == owner, NS, zeros_like)` and one broadcast per
owner; the rewritten graph is the same.

Where it runs: on the ATen inference graph (`pipeline.aten_passes`), not on
the Dynamo graph. There, every op is canonical (`x @ x.T` is aten.mm and
aten.permute however the user spelled it, `x.bfloat16()` is _to_copy or
nothing), the graph is functional (no in-place update to reason about),
every node carries its shape in meta["val"] for planning, and the result is
exactly the graph the inner compiler (TorchNeuron) compiles, so its
rank-independence is what the compile cache sees. A Muon step runs under
no_grad, so AOT Autograd hands it over as one inference graph.

What it matches: see `match.py` (the gather, the per-matrix unpad / layout /
rank selection) and `newton_schulz.py` (the iteration). Declines, each with
its reason in the report: no all-gather (W = 1), no Newton-Schulz behind a
gathered block (another optimizer), a near miss of the Newton-Schulz
pattern, a gathered value used outside the pattern, a world size the
target's all-to-all does not support.

Numerics: each owner rebuilds the full matrix with the original graph's own
ops from the same bf16 shards and runs the original Newton-Schulz ops on it,
so results are bit-identical to the all-gather step on the eager inner
compiler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from laplace_passes.collectives.emit import Exchange, emit_all_to_all
from laplace_passes.collectives.match import ALL_GATHER, BROADCAST, GatherBucket, find_buckets
from laplace_passes.collectives.own_rows import rank_input
from laplace_passes.collectives.newton_schulz import find_newton_schulz, may_hold_newton_schulz
from laplace_passes.collectives.plan import OwnershipPlan, choose_plan, plan_candidates
from laplace_passes.collectives.traffic import CollectiveBytes, collective_bytes, count_node, per_rank_totals
from laplace_passes.infra.fx_helpers import (
    COND,
    fake_tensor,
    fake_value,
    fill_fake_values,
    is_static,
    resolve_process_group,
    subgraph,
)
from laplace_passes.infra.pass_base import Declined, GraphPass, PassResult, run_pass
from laplace_passes.infra.report import TrafficRecord
from laplace_passes.infra.targets import HardwareTarget
from laplace_passes.infra.strict import strict_mode

def rewrite_muon_step(
    graph_module: torch.fx.GraphModule, world_size: int, target: HardwareTarget | str | None = None
) -> PassResult:
    """Rewrite the gathers of a sharded Muon step in an ATen graph into paired all-to-alls (in place).

    `graph_module` must be an ATen-level graph with shapes in meta["val"]
    (AOT Autograd's graphs, or make_fx with fake tensors). `target` (optional)
    adds its all-to-all constraints (e.g. trn2's group sizes).

    Contract: the one-element integer graph input with which the step picks
    its own rows (`index_select(result, 0, rank)`, or the owner test
    `rank == owner`) must hold this process's rank in the gather's group, as
    ShardedMuon passes it. The rewritten graph no longer reads it (each rank
    receives its own rows from the second all-to-all), and the pass cannot
    check at compile time what value it will hold.
    """
    if not isinstance(graph_module, torch.fx.GraphModule):
        raise TypeError(f"rewrite_muon_step takes a torch.fx.GraphModule, got {type(graph_module).__name__}")
    return run_pass(RewriteMuonStep(world_size=world_size, target=target), graph_module)


class RewriteMuonStep(GraphPass):
    """The pass: one entry point, `__call__(graph_module)` (see the NOTE above)."""

    name = "muon_all_to_all"

    def __init__(self, world_size: int | None = None, target: HardwareTarget | str | None = None) -> None:
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if isinstance(target, str):
            from laplace_passes.infra.targets import get_target

            target = get_target(target)
        self.world_size = world_size
        self.target = target

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        try:
            self._check_present(gm)
        except Declined as absent:
            return PassResult(gm, modified=False, summary="no Muon gather pattern", declined=[absent.reason])
        world_size = self.world_size or _gather_group_size(gm)
        if world_size == 1:  # a step run by one process: its gathers copy the shard, nothing travels
            return PassResult(gm, modified=False, summary="no Muon gather pattern",
                              declined=["the gathers are over 1 rank (world size 1): there is no communication to "
                                        "rewrite"])
        buckets, declined, folded = find_buckets(gm, world_size)
        return self._rewrite(gm, world_size, buckets, declined, folded)

    def _rewrite(self, gm: torch.fx.GraphModule, world_size: int, buckets: list[GatherBucket], declined: list[str],
                 folded: bool) -> PassResult:
        if buckets:
            try:
                self._check_group_size(world_size)
            except Declined as unsupported:
                declined.append(unsupported.reason)
                buckets = []
        before = collective_bytes(gm, world_size)
        original = set(gm.graph.nodes)
        done: list[tuple[Exchange, PlanChoice, Saving]] = []
        exchanges = _exchanges(buckets)
        for k, exchange in enumerate(exchanges):
            try:
                choice = unexpected_as_declined("planning the owners of", exchange.buckets[0].all_gather,
                                                _plan, exchange, self.target)
                saving = _check_saves(exchange, choice.plan)
            except Declined as no_gain:
                declined.append(no_gain.reason)
                continue
            snapshot = _snapshot(gm.graph)
            try:
                unexpected_as_declined("rewriting", exchange.buckets[0].all_gather,
                                       _rewrite_exchange, gm, exchange, choice.plan)
            except Declined as failed:  # the graph as it was: a half-made rewrite must never run
                gm.graph = snapshot
                gm.delete_all_unused_submodules()
                declined.append(failed.reason)
                # The other exchanges were matched on the nodes just replaced by their copies.
                declined += [f"{later.buckets[0].all_gather.name}: kept, since rewriting an earlier gather of this "
                             "graph failed" for later in exchanges[k + 1:]]
                break
            done.append((exchange, choice, saving))
        if not done:
            return PassResult(gm, modified=folded, summary="no Muon gather pattern rewritten", declined=declined)
        # Later passes and inner compilers read shapes (a graph put back after a failure holds copies).
        fill_fake_values(n for n in gm.graph.nodes if n not in original or "val" not in n.meta)
        traffic = _traffic(done, before, collective_bytes(gm, world_size), world_size)
        return PassResult(gm, modified=True, summary=_summary(done, traffic), declined=declined, traffic=traffic,
                          plans=[choice.plan for _, choice, _ in done])

    def _check_present(self, gm: torch.fx.GraphModule) -> None:
        """Declined unless the graph is an ATen graph with static shapes and a gather to rewrite."""
        if self.world_size == 1:
            raise Declined("world_size is 1: there is no communication to rewrite")
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # DTensor inputs arrive as a local tensor and an opaque mesh object: only the tensors need shapes.
        if any(fake_value(n) is None for n in placeholders):
            raise Declined("the graph carries no shapes (meta['val']): trace it with fake tensors (AOT Autograd, make_fx)")
        if not all(is_static(fake_value(n)) for n in placeholders):
            raise Declined("dynamic shapes: the ownership plan needs static sizes (compile with dynamic=False)")
        if any(n.target is ALL_GATHER for n in gm.graph.nodes):
            return
        if find_newton_schulz(gm.graph)[0] or any(n.target is COND for n in gm.graph.nodes):
            raise Declined("Newton-Schulz found, but no all_gather_into_tensor gathers its input "
                           "(world size 1, a gather left in an earlier graph by a graph break, or communication this pass "
                           "does not know)")
        if any(n.op == "call_method" for n in gm.graph.nodes):
            raise Declined("this is a torch-level (Dynamo) graph; the rewrite works on ATen graphs (after AOT Autograd)")
        raise Declined("no all_gather_into_tensor in the graph")

    def _check_group_size(self, world_size: int) -> None:
        if self.target is None or self.target.collectives.group_size_supported(world_size):
            return
        rules = self.target.collectives
        raise Declined(f"{self.target.name}'s all-to-all supports groups of "
                       f"{', '.join(map(str, rules.all_to_all_group_sizes))} or multiples of "
                       f"{rules.all_to_all_group_size_multiple} ranks, not {world_size}; the gathers are kept")


def unexpected_as_declined(doing: str, node: torch.fx.Node, fn, *args):
    """`fn(*args)`, an error it raises (a spelling the matcher or emitter did not foresee) as a Declined."""
    try:
        return fn(*args)
    except Declined:
        raise
    except Exception as error:  # noqa: BLE001 - any failure here means: leave the user's graph as it is
        if strict_mode():  # NOTE [a failing pass declines]: the suite finds such failures
            raise
        raise Declined(f"{node.name}: {type(error).__name__} while {doing} this gather ({error}); the rewrite "
                       "does not know this spelling, the gathers are kept") from error


def _snapshot(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of `graph` (nodes, names and meta) to put back when a rewrite fails halfway."""
    copy = torch.fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    copy._codegen = graph._codegen
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy


def _gather_group_size(gm: torch.fx.GraphModule) -> int:
    return next(n.args[1] for n in gm.graph.nodes if n.target is ALL_GATHER)


@dataclass(frozen=True)
class Saving:
    """What one exchange's plan changes per rank: received bytes and Newton-Schulz FLOPs."""

    received_before: int
    received_after: int
    flops_before: int
    flops_after: int


def _exchanges(buckets: list[GatherBucket]) -> list[Exchange]:
    """All gathers of one group and dtype are planned together: one owner per matrix across the step."""
    grouped: dict[tuple, list[GatherBucket]] = {}
    for bucket in buckets:
        grouped.setdefault((bucket.group, fake_tensor(bucket.send).dtype), []).append(bucket)
    return [Exchange(key[0], members[0].world_size, members) for key, members in grouped.items()]


def _rank_for(exchange: Exchange) -> torch.fx.Node | int | None:
    """How owners' work is gated: the rank input (ShardedMuon), this process's rank (per-rank graphs), or None."""
    inputs = {rank_input(site.selection) for site in exchange.sites}
    if len(inputs) != 1:
        return None
    (rank,) = inputs
    if rank is not None:
        return rank
    process_group = resolve_process_group(exchange.group)
    return None if process_group is None else process_group.rank()


@dataclass(frozen=True)
class PlanChoice:
    """The plan an exchange takes, the plans it was chosen from, and why."""

    plan: OwnershipPlan
    candidates: tuple[OwnershipPlan, ...]
    why: str


def _plan(exchange: Exchange, target: HardwareTarget | None) -> PlanChoice:
    """Balanced plans hold a `cond` per owner (or a different program per rank): never on a target whose
    compiler takes no control flow (neuronx-cc), and only with a rank to test."""
    sites = exchange.sites
    args = ([s.key for s in sites], [s.numel for s in sites], [s.newton_schulz.flops for s in sites],
            exchange.world_size)
    candidates = tuple(plan_candidates(*args))
    if len(candidates) == 1:
        why = "every shape group's count is a multiple of W: no zero matrices"
    elif target is not None and not target.control_flow:
        why = f"{target.name}'s compiler takes no control flow: one branch-free program for every rank"
    elif _rank_for(exchange) is None:
        why = "no rank input to test for the owners' branches"
    else:
        why = "the plan that receives fewer bytes per rank"
    allowed = len(candidates) > 1 and why.startswith("the plan")
    return PlanChoice(choose_plan(candidates, allowed), candidates, why)


def _check_saves(exchange: Exchange, plan: OwnershipPlan) -> Saving:
    """Declined unless the plan receives fewer bytes per rank, or as many with less Newton-Schulz work.

    At W = 2 the all-to-all bound 2 (W-1) G / W^2 equals the all-gather's
    (W-1) G / W: there the rewrite is worth it only for the Newton-Schulz
    work it stops repeating on every rank.
    """
    W = exchange.world_size
    element = fake_tensor(exchange.buckets[0].send).element_size()
    gathers = [c for b in exchange.buckets for n in (b.all_gather, *b.broadcasts) if (c := count_node(n, W))]
    _, before = per_rank_totals(gathers, W)
    after = 2 * (W - 1) * plan.chunk_numel * element
    flops_before = _ns_flops_before(exchange.sites, W)
    saving = Saving(before, after, flops_before, plan.flops_per_rank)
    what = (f"{len(exchange.sites)} matrices from {len(exchange.buckets)} gather(s), all-to-all chunk "
            f"{plan.chunk_numel} elements, {plan.kind} plan with {plan.padding_matrices} zero matrices")
    cause = _fewer_matrices_than_ranks(len(exchange.sites), W)
    cause = f"{cause}: " if cause else ""
    if after > before:
        raise Declined(f"{cause}planned received bytes per rank {after} > {before} with the gathers ({what}); "
                       "the gathers are kept")
    if after == before and saving.flops_after >= flops_before:
        raise Declined(f"{cause}planned received bytes per rank {after} = {before} with the gathers and "
                       f"Newton-Schulz FLOPs per rank {saving.flops_after} >= {flops_before} ({what}); "
                       "the gathers are kept")
    return saving


def _fewer_matrices_than_ranks(matrices: int, W: int) -> str:
    """The cause of an all-to-all above its bound when there are not enough matrices to give every rank one."""
    if matrices >= W:
        return ""
    return (f"fewer matrices ({matrices}) than ranks ({W}), so {W - matrices} rank(s) own none and every rank's "
            "all-to-all chunk is as large as the largest owner's")


def _rewrite_exchange(gm: torch.fx.GraphModule, exchange: Exchange, plan: OwnershipPlan) -> None:
    emit_all_to_all(gm, exchange, plan, _rank_for(exchange))
    for bucket in exchange.buckets:
        _erase_dead(gm, bucket)
    remaining = set(gm.graph.nodes)
    left = [n.name for b in exchange.buckets for n in (b.all_gather, *b.broadcasts) if n in remaining]
    if left:  # the pass's promise: no gather or broadcast left for the exchange's matrices
        raise RuntimeError(f"muon_all_to_all: {left} still in the graph after rewriting their gathers")


def _erase_dead(gm: torch.fx.GraphModule, bucket: GatherBucket) -> None:
    """Remove what the rerouted selections left unused: the gathers, broadcasts and their math."""
    dying = {bucket.all_gather, *bucket.infrastructure}
    if bucket.send.op == "call_function" and not bucket.send.is_impure():
        dying.add(bucket.send)  # a cat whose inputs the pack took directly (emit._shard_in_send)
    for site in bucket.sites:
        dying |= site.nodes
    for node in list(dying):
        if node.target is COND:
            dying |= {node.args[1], node.args[2]}  # the branch subgraphs' get_attr nodes
    for node in reversed(list(gm.graph.nodes)):
        if node in dying and not node.users:
            gm.graph.erase_node(node)
    gm.delete_all_unused_submodules()


def _ns_flops_before(sites, world_size: int) -> int:
    per_rank = [0] * world_size
    for site in sites:
        for rank in range(world_size) if site.owner is None else (site.owner,):
            per_rank[rank] += site.newton_schulz.flops
    return max(per_rank)


def _traffic(done, before: list[CollectiveBytes], after: list[CollectiveBytes], W: int) -> TrafficRecord:
    sites = [s for exchange, _, _ in done for s in exchange.sites]
    plans = [choice.plan for _, choice, _ in done]
    # The matrices as they travel (the dtype of the gather's buffer, bf16 in ShardedMuon), not as Newton-Schulz
    # returns them: the bound is on bytes sent.
    matrix_bytes = sum(fake_tensor(s.result).numel() * fake_tensor(exchange.buckets[0].send).element_size()
                       for exchange, _, _ in done for s in exchange.sites)
    sent_before, received_before = per_rank_totals(before, W)
    sent_after, received_after = per_rank_totals(after, W)
    return TrafficRecord(
        graph="",  # the report's runner names the graph
        world_size=W,
        ownership=", ".join(sorted({p.kind for p in plans})),
        matrices=len(sites),
        padding_matrices=sum(p.padding_matrices for p in plans),
        matrix_bytes=matrix_bytes,
        lower_bound_bytes=2 * (W - 1) * matrix_bytes // W**2,
        before=[c.as_dict() for c in before],
        after=[c.as_dict() for c in after],
        sent_before=sent_before,
        received_before=received_before,
        sent_after=sent_after,
        received_after=received_after,
        received_ratio=received_before / received_after if received_after else float("inf"),
        ns_flops_before=sum(saving.flops_before for _, _, saving in done),
        ns_flops_after=sum(p.flops_per_rank for p in plans),
        plans=_compared_plans(done, W),
    )


def _compared_plans(done, W: int) -> list[dict]:
    """Each plan kind over the whole graph (an exchange without that kind counts its uniform plan)."""
    rows = []
    for kind in ("uniform", "balanced"):
        if not any(plan.kind == kind for _, choice, _ in done for plan in choice.candidates):
            continue
        chosen = [_of_kind(choice.candidates, kind) for _, choice, _ in done]
        element = [fake_tensor(exchange.buckets[0].send).element_size() for exchange, _, _ in done]
        rows.append({
            "kind": kind,
            "chosen": all(plan is choice.plan for plan, (_, choice, _) in zip(chosen, done)),
            "received": sum(2 * (W - 1) * plan.chunk_numel * size for plan, size in zip(chosen, element)),
            "ns_flops": sum(plan.flops_per_rank for plan in chosen),
            "zero_matrices": sum(plan.padding_matrices for plan in chosen),
            "owner_branches": sum(len({*plan.owners}) for plan in chosen if plan.kind == "balanced"),
            "why": "; ".join(sorted({choice.why for _, choice, _ in done})) if kind == done[0][1].plan.kind else "",
        })
    return rows


def _of_kind(candidates: tuple[OwnershipPlan, ...], kind: str) -> OwnershipPlan:
    return next((plan for plan in candidates if plan.kind == kind), candidates[0])


def _summary(done, traffic: TrafficRecord) -> str:
    n = sum(len(exchange.sites) for exchange, _, _ in done)
    gathers = sum(len(exchange.buckets) for exchange, _, _ in done)
    comms = ", ".join(sorted({b.comm for exchange, _, _ in done for b in exchange.buckets}))
    text = (
        f"{n} Muon matrices ({comms}) from {gathers} gather(s) -> 2 all_to_all_single per exchange "
        f"({len(done)} exchange(s)), {traffic.ownership} ownership, {traffic.padding_matrices} zero matrices; "
        f"received per rank {traffic.received_before} -> {traffic.received_after} bytes"
    )
    if traffic.received_after < traffic.received_before:
        return text + f" ({traffic.received_ratio:.2f}x less)"
    W = traffic.world_size
    why = _fewer_matrices_than_ranks(n, W) or (
        f"at W = {W} two all-to-alls receive what the gather did" if W == 2 else
        "the owners' chunks are as large as the gathered shards")
    return text + (f" (unchanged: {why}); applied because Newton-Schulz FLOPs per rank fall "
                   f"{traffic.ns_flops_before} -> {traffic.ns_flops_after}")


def is_candidate(gm: torch.fx.GraphModule) -> bool:
    """Whether the pass has anything to look at: a gather or broadcast, or Newton-Schulz (even at W = 1).

    The backend skips other graphs entirely, so their reports stay free of a
    pass that never applied to them.
    """
    graphs = [gm.graph] + [
        subgraph(gm, n.args[1]).graph for n in gm.graph.nodes if n.target is COND
    ]
    if any(n.target in (ALL_GATHER, BROADCAST) for n in gm.graph.nodes):
        return True
    # The Newton-Schulz search replays views at concrete sizes: on a graph with symbolic sizes it
    # would guard them to the example's values (Dynamo would recompile for every new size).
    if not all(is_static(fake_value(n)) for n in gm.graph.find_nodes(op="placeholder")):
        return False
    return any(may_hold_newton_schulz(graph) for graph in graphs)
