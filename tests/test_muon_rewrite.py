"""The Muon all-to-all rewrite (laplace_passes.collectives) against torch.optim.Muon.

Multi-rank tests run W gloo processes on CPU (tests/_dist.py); ShardedMuon
compiles its shard step with the `laplace` backend, whose ATen pass rewrites
the gathers into two all-to-alls.

Tolerance: none, the comparison is torch.equal. Newton-Schulz runs in bf16,
so any change in the matrix it sees or in the order of its ops would show
up at bf16 resolution (about 1e-2 relative after five steps); the rewrite
avoids both: each owner rebuilds the full matrix from the same bf16 shards
with the original graph's ops and runs the original Newton-Schulz ops on it,
and everything else is elementwise on row shards. The gradient average is
the only reduction across ranks; the test gradients are multiples of 1/32 in
[-2, 2), whose sums are exact in fp32 in any order (as in
test_sharded_muon.py).
"""

from __future__ import annotations

import datetime
import functools
import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import laplace_passes
from laplace_passes.driver.backend import laplace_backend
from laplace_passes.collectives import find_newton_schulz, plan_ownership, rewrite_muon_step
from laplace_passes.collectives.plan import uniform_plan
from model_zoo.muon import (
    COMM_MODES,
    MuonHParams,
    RowSplit,
    ShardedMuon,
    ShardedMuonStepError,
    adjust_lr,
    assign_owners,
    muon_shard_step,
    newton_schulz,
)
from tests._dist import run_ranks
from tests.muon_cases import rank_grads, step_beside_reference, step_with_same_grads

# Muon matrices: tall and wide, rows not divisible by 2, 3 or 4 (33, 10, 1),
# fewer rows than ranks, two of each shape: at W = 2 every rank owns one of
# each (the uniform plan), at W = 3 and 4 owners get different shapes (the
# balanced plan, one cond per owner). Plus a non-2D parameter (AdamW) and an
# embedding in an AdamW group.
MUON_SHAPES = [(10, 6), (6, 10), (33, 16), (1, 5)] * 2
EXPECTED_OWNERSHIP = {2: "uniform", 3: "balanced", 4: "balanced"}
ADAMW_SHAPE = (9,)
EMBED_SHAPE = (11, 4)
STEPS = 3
HPARAMS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=3)  # 3 steps: smaller graphs, faster compiles


def _laplace(report: laplace_passes.Report, **options):
    """backend= for ShardedMuon: `laplace` on the CPU target (every group size allowed)."""
    return functools.partial(laplace_backend, options={"target": "cpu", "report": report, **options})


def _params(seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in [*MUON_SHAPES, ADAMW_SHAPE, EMBED_SHAPE]]


def _optimizers(initial, comm, backend):
    mine = [p.clone().requires_grad_() for p in initial]
    ref = [p.clone().requires_grad_() for p in initial]
    n = len(MUON_SHAPES)
    opt = ShardedMuon(
        [{"params": mine[: n + 1]}, {"params": mine[n + 1 :], "use_muon": False}],
        comm=comm, backend=backend, **HPARAMS,
    )
    ref_muon = torch.optim.Muon(ref[:n], **HPARAMS)
    ref_adamw = torch.optim.AdamW(ref[n:], lr=1e-3, weight_decay=1e-2)
    return opt, mine, (ref_muon, ref_adamw), ref


def _run_against_reference(rank, world_size, comm, backend, failures):
    opt, mine, refs, ref = _optimizers(_params(), comm, backend)
    step_beside_reference(opt, refs, mine, ref, rank, world_size, STEPS, f"W={world_size} {comm}", failures)
    return opt


# ---------------------------------------------------------------- W ranks


def _body_rewritten(rank, world_size, comms):
    failures, graphs = [], {}
    for comm in comms:
        report = laplace_passes.Report()
        _run_against_reference(rank, world_size, comm, _laplace(report), failures)
        (record,) = [p for p in report.passes if p.name == "muon_all_to_all"]
        (traffic,) = report.traffic
        graphs[comm] = (record.modified, record.declined, report.graph("after", traffic.graph).code,
                        traffic.matrices, traffic.ownership, traffic.received_after, traffic.lower_bound_bytes)
        # What users see: the traffic table, and the graph's entry in the JSON report.
        if "Muon traffic per rank" not in str(report):
            failures.append(f"{comm}: no traffic table in the report")
        as_json = next(g for g in report.to_dict()["graphs"] if g["name"] == traffic.graph)
        if as_json["traffic"]["received_after"] != traffic.received_after:
            failures.append(f"{comm}: the JSON report lacks the traffic record")
    return failures, graphs


# Each comm mode at two world sizes (a compile per mode per rank is most of the runtime).
@pytest.mark.parametrize(
    "world_size,comms", [(2, COMM_MODES), (3, ("gather_broadcast",)), (4, ("all_gather",))]
)
def test_rewritten_step_equals_torch_muon(world_size, comms):
    """3 steps: bit-identical to torch.optim.Muon; the same rewritten graph on every rank."""
    results = run_ranks(world_size, _body_rewritten, comms, timeout=170)
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
    for comm in comms:
        per_rank = [graphs[comm] for _, graphs in results]
        modified, declined, code, matrices, ownership, received, bound = per_rank[0]
        assert modified and declined == [], (comm, declined)
        assert matrices == len(MUON_SHAPES) and ownership == EXPECTED_OWNERSHIP[world_size]
        assert received >= bound
        # The rewritten graph: two all-to-alls, no gather, broadcast or rank-indexed rows left.
        FileCheck().check_count("_c10d_functional.all_to_all_single.default(", 2, exactly=True).run(code)
        FileCheck().check_not("all_gather_into_tensor").run(code)
        FileCheck().check_not("_c10d_functional.broadcast").run(code)
        FileCheck().check_not("index_select").run(code)
        # Balanced plans gate each owner's Newton-Schulz on the rank tensor; uniform ones need no control flow.
        assert ("torch.ops.higher_order.cond(" in code) == (ownership == "balanced")
        assert all(other[2] == code for other in per_rank[1:]), f"{comm}: graph code differs between ranks"


def _body_default_backend(rank, world_size):
    """ShardedMuon as users construct it: backend="laplace" with its default options (target trn2)."""
    failures: list[str] = []
    _run_against_reference(rank, world_size, "all_gather", "laplace", failures)
    report = laplace_passes.last_report()
    applied = [p.modified for p in report.passes if p.name == "muon_all_to_all"]
    if not any(applied) and "trn2's all-to-all supports groups of" not in str(report):
        failures.append("the trn2 group-size reason is missing from str(report)")
    traffic = report.traffic
    code = report.graph("after", traffic[0].graph).code if traffic else ""
    return failures, report.target, applied, code, [t.plans for t in traffic]


@pytest.mark.parametrize("world_size,rewritten", [(4, True), (3, False)])
def test_default_backend_rewrites_where_trn2_allows_and_stays_exact(world_size, rewritten):
    """trn2's all-to-all takes 4 ranks, not 3: the gathers stay, with the reason, and the step is exact either way.
    Where it rewrites, the plan is branch-free (neuronx-cc takes no control flow) although a balanced one with a
    cond per owner would receive fewer bytes at W = 4; the report gives both."""
    results = run_ranks(world_size, _body_default_backend, timeout=170)
    assert not [f for failures, *_ in results for f in failures]
    assert all(target == "trn2" and applied == [rewritten] for _, target, applied, _, _ in results), results
    if not rewritten:
        return
    codes = {code for *_, code, _ in results}
    assert len(codes) == 1, "the rewritten graph differs between ranks"
    assert "higher_order.cond" not in codes.pop()
    (plans,) = results[0][4]
    by_kind = {p["kind"]: p for p in plans}
    assert by_kind["uniform"]["chosen"] and not by_kind["balanced"]["chosen"]
    assert "trn2's compiler takes no control flow" in by_kind["uniform"]["why"]
    assert by_kind["uniform"]["zero_matrices"] > 0 and by_kind["balanced"]["owner_branches"] > 0
    assert by_kind["balanced"]["received"] < by_kind["uniform"]["received"]  # what the branch-free plan costs


PG_TIMEOUT = 3.0


def _body_fault(rank, world_size, mode):
    """Rank 1 fails in the second step just before the rewritten shard step; report what each rank saw."""
    report = laplace_passes.Report()
    opt, mine, _, _ = _optimizers(_params(), "all_gather", _laplace(report))
    for step in range(2):
        for p, g in zip(mine, rank_grads(step, world_size, [p.shape for p in mine])):
            p.grad = g[rank].clone()
        if step == 1:
            # Step 0 compiled under the default timeout (ranks finish compiling
            # seconds apart); the failing step runs under a short one.
            torch.distributed.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=PG_TIMEOUT))
            before = [p.detach().clone() for p in mine]
            state = [{k: v.clone() for k, v in opt.state[p].items()} for p in mine]
            opt._fault_hook = functools.partial(_fail_on_rank_1, rank, mode)
            try:
                opt.step()
                outcome = ("returned", "")
            except ShardedMuonStepError as error:
                outcome = ("ShardedMuonStepError", str(error))
        else:
            opt.step()
    rewritten = any(p.name == "muon_all_to_all" and p.modified for p in report.passes)
    unchanged = all(torch.equal(p, b) for p, b in zip(mine, before)) and all(
        all(torch.equal(opt.state[p][k], v) for k, v in s.items()) for p, s in zip(mine, state)
    )
    return outcome, unchanged, rewritten


def _fail_on_rank_1(rank, mode, phase):
    if rank == 1 and phase == "shard_step":
        if mode == "hang":
            time.sleep(PG_TIMEOUT + 1.5)  # peers wait inside the first all-to-all
        raise RuntimeError("injected failure")


@pytest.mark.parametrize("world_size,mode", [(2, "hang"), (3, "exit")])
def test_rank_failure_mid_step(world_size, mode):
    """A rank that fails (or hangs) at the rewritten step: every rank raises, nothing is half-updated."""
    results = run_ranks(world_size, _body_fault, mode, timeout=150)
    for rank, ((kind, message), unchanged, rewritten) in enumerate(results):
        assert rewritten, f"rank {rank}: the step was not rewritten"
        assert kind == "ShardedMuonStepError", f"rank {rank}: {kind} {message}"
        assert f"rank {rank} of {world_size}" in message and "No parameter or optimizer state was modified" in message
        assert unchanged, f"rank {rank}: parameters or state changed by the failed step"
        if rank == 1:
            assert "injected failure" in message
        elif mode == "hang":
            assert "timed out" in message.lower() and f"{PG_TIMEOUT:g}s" in message, message


# ---------------------------------------------------------------- one process


def _step_graph(shapes, world_size, ns_steps=5, update=None, decompositions=None):
    """The all_gather shard step as an ATen graph (make_fx, fake tensors; no process group needed)."""
    splits = tuple(RowSplit(r, c, world_size) for r, c in shapes)
    hparams = tuple(
        MuonHParams(0.02, 0.1, 0.95, True, (3.4445, -4.775, 2.0315), ns_steps, 1e-7, adjust_lr(0.02, None, r, c))
        for r, c in shapes
    )
    step = update or muon_shard_step
    fn = functools.partial(step, splits=splits, hparams=hparams, owners=assign_owners(splits, world_size),
                           comm="all_gather", world_size=world_size, group="0")
    shards = lambda: [torch.zeros(sp.shard_rows, sp.cols) for sp in splits]  # noqa: E731
    trace = make_fx(torch.func.functionalize(fn), decomposition_table=decompositions, tracing_mode="fake")
    return trace(shards(), shards(), shards(), torch.tensor(0))


def test_traffic_meets_the_lower_bound_when_counts_divide():
    """16 matrices of 64 x 32 at W = 8: received per rank 2 (W-1) G / W^2, W/2 = 4x less than all-gather."""
    W = 8
    result = rewrite_muon_step(_step_graph([(64, 32)] * 16, W, ns_steps=1), world_size=W)
    t = result.traffic
    G = 16 * 64 * 32 * 2  # bf16
    assert t.matrix_bytes == G and t.padding_matrices == 0
    assert t.received_before == (W - 1) * G // W  # the all-gather
    assert t.received_after == t.lower_bound_bytes == 2 * (W - 1) * G // W**2
    assert t.received_ratio == W / 2
    assert [c["op"] for c in t.before] == ["all_gather_into_tensor"]
    assert [c["op"] for c in t.after] == ["all_to_all_single"] * 2
    # Newton-Schulz: 16 matrices on every rank before, 2 per rank after.
    assert t.ns_flops_before == 8 * t.ns_flops_after
    code = result.graph_module.code
    FileCheck().check_count("_c10d_functional.all_to_all_single.default(", 2, exactly=True).run(code)
    FileCheck().check_not("all_gather").run(code)


def test_shards_are_packed_straight_from_the_send_pieces():
    """The step sends cat(flat shards): the all-to-all's buffer is built from those pieces, the cat dies."""
    gm = _step_graph([(64, 32)] * 8, 4, ns_steps=1)
    (gather,) = gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_gather_into_tensor.default)
    send = gather.args[0]
    assert send.target is torch.ops.aten.cat.default
    shards = list(send.args[0])
    result = rewrite_muon_step(gm, world_size=4)
    first, _ = result.graph_module.graph.find_nodes(
        op="call_function", target=torch.ops._c10d_functional.all_to_all_single.default)
    packed = first.args[0]
    # Each shard goes to its owner, owner by owner in the plan's order, as the very piece the step made.
    assert packed.target is torch.ops.aten.cat.default
    assert packed.args[0] == [shards[i] for owner in range(4) for i in result.plans[0].owned(owner)]
    assert send not in result.graph_module.graph.nodes  # one copy of the shards, not two


def test_newton_schulz_runs_once_per_slot_instead_of_once_per_matrix():
    """W = 2: two of each shape, so the all-to-alls receive what the gather did and Newton-Schulz halves."""
    gm = _step_graph([(10, 6), (6, 10), (7, 7)] * 2, 2, ns_steps=2)
    before = gm.code
    result = rewrite_muon_step(gm, world_size=2)
    assert result.modified and result.declined == []
    # The same Newton-Schulz ops, now once per slot instead of once per matrix per rank.
    assert before.count("aten.addmm.default") == 6 * 2 * 2
    assert result.graph_module.code.count("aten.addmm.default") == len(result.plans[0].slots) * 2 * 2 == 3 * 2 * 2
    t = result.traffic
    assert t.received_after == t.received_before and t.ns_flops_after * 2 == t.ns_flops_before


def test_a_rewrite_that_would_receive_more_is_declined_with_the_numbers():
    """Three unequal matrices at W = 2: the best plan's chunk exceeds half the bucket, so bytes would grow."""
    gm = _step_graph([(10, 6), (6, 10), (7, 7)], 2, ns_steps=2)
    code = gm.code
    result = rewrite_muon_step(gm, world_size=2)
    assert not result.modified and result.graph_module.code == code
    (reason,) = result.declined
    # Before: (W-1) x the 88-element bf16 send buffer (5x6 + 3x10 + 4x7 shards); after: 2 (W-1) x the chunk.
    chunk = max(30 + 28, 30)  # the balanced plan's fullest owner: two of the three shards
    assert reason.startswith(f"planned received bytes per rank {2 * chunk * 2} > {88 * 2} with the gathers"), reason
    assert f"all-to-all chunk {chunk} elements" in reason and "the gathers are kept" in reason


def test_inductor_decompositions_are_recognised():
    """inner="inductor": the norm arrives as pow / sum / pow 0.5 and clamp as clamp_min."""
    from torch._inductor.decomposition import select_decomp_table

    gm = _step_graph([(10, 6), (6, 10)], 2, ns_steps=2, decompositions=select_decomp_table())
    assert "linalg_vector_norm" not in gm.code and "clamp_min" in gm.code
    result = rewrite_muon_step(gm, world_size=2)
    assert result.modified and result.declined == []
    FileCheck().check_count("_c10d_functional.all_to_all_single.default(", 2, exactly=True).run(result.graph_module.code)


def test_world_size_one_is_declined():
    gm = _step_graph([(10, 6)], 1)
    result = rewrite_muon_step(gm, world_size=1)
    assert not result.modified
    assert result.declined == ["world_size is 1: there is no communication to rewrite"]


def test_gathers_over_one_rank_are_declined_as_such():
    """The backend's pass reads the world size from the gathers: over one rank nothing travels, and the
    reason says so (not a byte count of 0 = 0)."""
    from laplace_passes.collectives import RewriteMuonStep
    from laplace_passes.infra.pass_base import run_pass

    def step(shard):
        c10d = torch.ops._c10d_functional
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard.bfloat16(), 1, "0"))
        return newton_schulz(full, (3.4445, -4.775, 2.0315), 2, 1e-7)

    gm = make_fx(step, tracing_mode="fake")(torch.zeros(10, 6))
    code = gm.code
    result = run_pass(RewriteMuonStep(), gm)
    assert not result.modified and result.graph_module.code == code
    assert result.declined == ["the gathers are over 1 rank (world size 1): there is no communication to rewrite"]


def test_torch_optim_muon_compiled_in_one_process_equals_eager():
    """torch.optim.Muon's own step compiled with the laplace backend: Newton-Schulz without a gather, nothing
    to rewrite; the reason says so and the numbers are eager's, bit for bit."""
    report = laplace_passes.Report()
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=gen) for s in [(10, 6), (6, 10)]]
    grads = [[torch.randn_like(t) for t in init] for _ in range(2)]
    runs = {}
    for mode in ("eager", "compiled"):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = torch.optim.Muon(params, **HPARAMS)
        step = opt.step if mode == "eager" else torch.compile(opt.step, backend=_laplace(report))
        for g in grads:
            for p, grad in zip(params, g):
                p.grad = grad.clone()
            step()
        runs[mode] = [p.detach().clone() for p in params] + [opt.state[p]["momentum_buffer"] for p in params]
    assert all(torch.equal(a, b) for a, b in zip(runs["compiled"], runs["eager"]))
    records = [p for p in report.passes if p.name == "muon_all_to_all"]
    assert records and not any(r.modified for r in records)
    assert all(r.declined == ["Newton-Schulz found, but no all_gather_into_tensor gathers its input (world size 1, "
                              "a gather left in an earlier graph by a graph break, or communication this pass does "
                              "not know)"] for r in records), [r.declined for r in records]


def test_single_process_backend_declines_with_reason_and_matches_torch_muon():
    """W = 1 through the backend: nothing to rewrite, the report says why, the step is still exact."""
    report = laplace_passes.Report()
    params = [torch.randn(s, generator=torch.Generator().manual_seed(5)) for s in MUON_SHAPES]
    mine = [p.clone().requires_grad_() for p in params]
    ref = [p.clone().requires_grad_() for p in params]
    opt = ShardedMuon(mine, backend=_laplace(report), **HPARAMS)
    ref_opt = torch.optim.Muon(ref, **HPARAMS)
    step_with_same_grads(opt, mine, [ref_opt], ref, steps=2)
    assert all(torch.equal(x, y) for x, y in zip(mine, ref))
    (record,) = [p for p in report.passes if p.name == "muon_all_to_all"]
    assert not record.modified
    assert record.declined == [
        "Newton-Schulz found, but no all_gather_into_tensor gathers its input "
        "(world size 1, a gather left in an earlier graph by a graph break, or communication this pass "
        "does not know)"
    ]


def test_option_switches_the_pass_off():
    report = laplace_passes.Report()
    p = torch.randn(6, 4, requires_grad=True)
    opt = ShardedMuon([p], backend=_laplace(report, muon_all_to_all=False))
    p.grad = torch.randn(6, 4)
    opt.step()
    assert report.graphs and all(r.name != "muon_all_to_all" for r in report.passes)
    with pytest.raises(TypeError, match="muon_all_to_all must be a bool"):
        laplace_passes.compile(lambda x: x, muon_all_to_all="yes")


def _sgd_shard_step(momentum_shards, grad_shards, param_shards, rank, *, splits, world_size, group, **_):
    """Another optimizer: gathers the gradient shards, but no Newton-Schulz behind them."""
    flat = torch.cat([g.reshape(-1) for g in grad_shards])
    gathered = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_gather_into_tensor(flat, world_size, group)
    ).view(world_size, -1)
    full = gathered[:, : splits[0].shard_numel].reshape(-1, splits[0].cols)
    step = full.mean() * 0.1
    return momentum_shards, [p - step for p in param_shards]


def test_another_optimizer_is_declined_with_reason():
    gm = _step_graph([(8, 4)], 2, update=_sgd_shard_step)
    result = rewrite_muon_step(gm, world_size=2)
    assert not result.modified
    (reason,) = result.declined
    assert "feeds no Newton-Schulz region: not a Muon step" in reason, reason


def _broken_newton_schulz(x, ns_coefficients, ns_steps, eps):
    """The quintic iteration without the Frobenius normalisation before it: close, but not Newton-Schulz."""
    a, b, c = ns_coefficients
    x = x.bfloat16()
    for _ in range(2):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def test_near_miss_of_newton_schulz_is_declined_with_reason(monkeypatch):
    import model_zoo.muon.shard_step as muon

    monkeypatch.setattr(muon, "newton_schulz", _broken_newton_schulz)
    result = rewrite_muon_step(_step_graph([(8, 4)], 2), world_size=2)
    assert not result.modified
    assert any("looks like Newton-Schulz, but no Frobenius normalisation" in r for r in result.declined), (
        result.declined
    )


def test_full_result_used_beyond_own_rows_is_declined():
    def leaky_step(*args, **kwargs):
        bufs, params = muon_shard_step(*args, **kwargs)
        return bufs, params, _leak.pop()

    _leak = []

    def leaky_ns(x, coefficients, steps, eps):
        out = _original_ns(x, coefficients, steps, eps)
        _leak.append(out.sum())
        return out

    import model_zoo.muon.shard_step as muon

    _original_ns = muon.newton_schulz
    muon.newton_schulz = leaky_ns
    try:
        gm = _step_graph([(8, 4)], 2, update=leaky_step)
    finally:
        muon.newton_schulz = _original_ns
    result = rewrite_muon_step(gm, world_size=2)
    assert not result.modified
    (reason,) = result.declined
    assert "reads the whole result and its value leaves the graph, so every rank needs the whole" in reason, reason


def test_trn2_group_size_rules_are_honoured():
    result = rewrite_muon_step(_step_graph([(12, 4)] * 3, 3), world_size=3, target="trn2")
    assert not result.modified
    assert result.declined == [
        "trn2's all-to-all supports groups of 4, 8, 16 or multiples of 32 ranks, not 3; the gathers are kept"
    ]
    assert rewrite_muon_step(_step_graph([(12, 4)] * 4, 4), world_size=4, target="trn2").modified


def test_world_size_must_match_the_gather():
    result = rewrite_muon_step(_step_graph([(8, 4)], 2), world_size=4)
    assert not result.modified
    assert any("gathers over 2 ranks, but world_size=4" in r for r in result.declined), result.declined


# ---------------------------------------------------------------- the plan


def test_uniform_plan_pads_groups_to_multiples_of_world_size():
    # 5 of shape A (cost 8), 2 of shape B (cost 3), W = 4: 2 A slots + 1 B slot on every rank.
    keys = ["A"] * 5 + ["B"] * 2
    plan = uniform_plan(keys, [6] * 5 + [4] * 2, [8] * 5 + [3] * 2, 4)
    assert [(s.group, s.numel, s.offset) for s in plan.slots] == [(0, 6, 0), (0, 6, 6), (1, 4, 12)]
    assert plan.chunk_numel == 16 and plan.padding_matrices == 4 * 3 - 7
    assert len(set(zip(plan.owners, plan.offsets))) == 7  # one slot per matrix
    for i, offset in enumerate(plan.offsets):
        assert offset in ((0, 6) if keys[i] == "A" else (12,))
    # The useful work is spread: rank 0 takes the fifth A, the Bs go to other ranks.
    assert sorted(plan.useful_flops(r) for r in range(4)) == [8, 11, 11, 16]
    assert plan.flops_per_rank == 8 + 8 + 3
    # Every rank's chunk: its slots, zeros where it holds no matrix.
    assert [i is None for _, _, i in plan.layout(3)] == [False, True, True]


def test_balanced_plan_when_padding_would_cost_more():
    # One big and three small matrices over 2 ranks: uniform needs a zero big matrix.
    numels, flops = [100, 10, 10, 10], [1000, 10, 10, 10]
    plan = plan_ownership(["big", "small", "small", "small"], numels, flops, 2)
    assert plan.kind == "balanced" and plan.slots == ()
    assert plan.owned(0) == [0] and plan.owned(1) == [1, 2, 3]
    assert plan.chunk_numel == 100  # the fullest owner
    assert plan.layout(1) == [(0, 10, 1), (10, 10, 2), (20, 10, 3), (30, 70, None)]
    assert plan.flops_per_rank == 1000
    # Without a rank tensor to gate the owners' work, the uniform plan is kept.
    assert plan_ownership(["big", "small", "small", "small"], numels, flops, 2, allow_balanced=False).kind == "uniform"


def test_plan_is_deterministic_and_checks_world_size():
    args = (["A", "B", "A", "C"], [3, 5, 3, 2], [9, 4, 9, 1], 3)
    assert plan_ownership(*args) == plan_ownership(*args)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        plan_ownership(*args[:3], 0)


def _gather_then(orthogonalise, flat_send=True):
    """A gather of 2 row shards, `orthogonalise` on the whole matrix, the shard picked by an int input."""

    def step(shard, which):
        send = shard.reshape(-1) if flat_send else shard
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(send, 2, "0")
        full = torch.ops._c10d_functional.wait_tensor(gathered).view(2, -1).view(8, 6)
        return torch.index_select(orthogonalise(full).view(2, 4, 6), 0, which.view(1)) * 3.0

    return make_fx(step, tracing_mode="fake")(torch.zeros(4, 6), torch.tensor(1))


def test_normalisation_without_newton_schulz_steps_is_not_muon():
    """x / ||x|| after a gather is not an orthogonalisation: no candidate, nothing rewritten."""
    gm = _gather_then(lambda full: full / full.norm().clamp(min=1e-7))
    result = rewrite_muon_step(gm, world_size=2)
    assert not result.modified
    assert any("Newton-Schulz" in reason for reason in result.declined), result.declined
    FileCheck().check("all_gather_into_tensor").check("index_select").run(gm.code)


def test_small_matrices_at_three_ranks_are_kept_when_bytes_would_grow():
    """W = 3, a 3 x 4 and a 2 x 5 matrix: one bf16 row of each per rank (4 + 5 elements sent); the best owner
    plan still sends the 5-element row in every chunk, 2 (W-1) x 5 > (W-1) x 9 elements."""
    result = rewrite_muon_step(_step_graph([(3, 4), (2, 5)], 3, ns_steps=1), world_size=3)
    assert not result.modified
    (reason,) = result.declined
    before, after = 2 * (4 + 5) * 2, 2 * 2 * 5 * 2  # bytes: (W-1) x send, 2 (W-1) x chunk
    assert reason.startswith("fewer matrices (2) than ranks (3), so 1 rank(s) own none"), reason
    assert f"planned received bytes per rank {after} > {before} with the gathers" in reason, reason
    assert "all-to-all chunk 5 elements" in reason


def test_one_matrix_at_two_ranks_is_kept_whatever_its_send_shape():
    """A 2-D send is matched like a flat one; alone at W = 2 its owner plan pads a zero matrix: bytes would double."""
    ns = lambda full: newton_schulz(full, (3.4445, -4.775, 2.0315), 2, 1e-7)  # noqa: E731
    for flat_send in (False, True):
        result = rewrite_muon_step(_gather_then(ns, flat_send=flat_send), world_size=2)
        assert not result.modified
        (reason,) = result.declined
        shard_bytes = 4 * 6 * 4  # a 4 x 6 fp32 row shard: what the gather receives from the one other rank
        assert reason.startswith("fewer matrices (1) than ranks (2), so 1 rank(s) own none"), reason
        assert (f"planned received bytes per rank {2 * shard_bytes} > {shard_bytes} with the gathers "
                                 "(1 matrices from 1 gather(s), all-to-all chunk 24 elements, uniform plan with 1 zero "
                                 "matrices)") in reason, reason


def test_rewrite_muon_step_rejects_what_is_not_a_graph_module():
    with pytest.raises(TypeError, match="takes a torch.fx.GraphModule, got int"):
        rewrite_muon_step(42, world_size=2)


def test_gather_whose_value_leaves_the_graph_is_declined_as_split_from_newton_schulz():
    """A graph that ends at the gather (as when a graph break puts Newton-Schulz in the next graph)."""
    def step(shard):
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(shard, 2, "0")
        return torch.ops._c10d_functional.wait_tensor(gathered).view(8, 6)

    result = rewrite_muon_step(make_fx(step, tracing_mode="fake")(torch.zeros(4, 6)), world_size=2)
    assert not result.modified
    (reason,) = result.declined
    assert "leaves the graph (a graph output) before any Newton-Schulz reads it" in reason, reason


def _scaled_iteration(scale):
    """Two Newton-Schulz steps after `scale(full)` in place of the Frobenius normalisation."""

    def orthogonalise(full):
        x = full / scale(full)
        for a, b, c in [(3.4445, -4.775, 2.0315)] * 2:
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x

    return orthogonalise


@pytest.mark.parametrize("name,scale", [
    ("twice the sum", lambda x: 2 * x.sum()),
    ("the sum's root", lambda x: x.sum().abs().sqrt()),
    ("a 1-norm", lambda x: x.norm(p=1)),
])
def test_a_scale_that_is_not_a_frobenius_norm_starts_no_newton_schulz(name, scale):
    gm = _gather_then(_scaled_iteration(scale), flat_send=False)
    result = rewrite_muon_step(gm, world_size=2)
    assert not result.modified
    assert any("no Frobenius normalisation" in reason for reason in result.declined), (name, result.declined)


@pytest.mark.parametrize("name,scale", [
    ("norm", lambda x: x.norm()),
    ("root of x * x summed", lambda x: (x * x).sum().sqrt() + 1e-7),
    ("root of x ** 2 summed", lambda x: x.pow(2).sum().sqrt().clamp(min=1e-7)),
])
def test_frobenius_norms_in_their_spellings_start_newton_schulz(name, scale):
    gm = _gather_then(_scaled_iteration(scale), flat_send=False)
    (found,) = find_newton_schulz(gm.graph)[0]
    assert len(found.coefficients) == 2, name


def test_summary_at_two_ranks_says_the_same_bytes_and_half_the_newton_schulz_work():
    """At W = 2 two all-to-alls receive what the gather did: the demo's summary says what the rewrite does save."""
    from laplace_passes.collectives.traffic import muon_saving
    from laplace_passes.demo.train import DemoResult

    t = rewrite_muon_step(_step_graph([(64, 32)] * 4, 2, ns_steps=1), world_size=2).traffic
    assert t.received_before == t.received_after and t.ns_flops_before == 2 * t.ns_flops_after
    result = DemoResult(losses=[2.0, 1.0], accuracy=0.5, chance=0.1, tokens_per_s=1.0, seconds=1.0, world_size=2,
                        muon_received_ratio=t.received_ratio, muon_ns_work_ratio=t.ns_flops_before / t.ns_flops_after)
    assert result.summary().endswith("; Muon step receives the same bytes, half the Newton-Schulz work per rank "
                                     "after the rewrite")
    assert muon_saving(2.0, 8.0) == "receives x2.00 fewer bytes per rank"  # W = 4 of 16 matrices, as above
