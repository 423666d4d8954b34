"""ShardedMuon (model_zoo.muon) against torch.optim.Muon + torch.optim.AdamW.

Multi-rank tests run W gloo processes on CPU (tests/_dist.py).  Every rank
compares its result with the reference applied to the full, unsharded
parameters with the rank-averaged gradient.

Why bit-identical (torch.equal) is the right bar: ShardedMuon runs
Newton-Schulz on exactly the full matrix the reference sees (same shape, same
bf16 values; in "gather_broadcast" the owner runs it, in "all_gather" every
rank does), and every other operation (momentum lerp, Nesterov lerp, bf16 cast,
weight decay, update) is elementwise, so a row shard gives the same bits as
the full tensor.  The one thing that could differ is the order in which the
ranks' gradients are summed (the collective's order vs. the reference's
``sum(0)``); the test gradients are multiples of 1/32 in [-2, 2), whose sums
are exact in fp32 in any order, so that cannot differ either.
"""

from __future__ import annotations

import copy
import inspect
import time

import pytest
import torch

from model_zoo.muon import COMM_MODES, MuonHParams, RowSplit, ShardedMuon, ShardedMuonStepError
from tests._dist import run_ranks
from tests.muon_cases import compare_params, rank_grads, step_beside_reference, step_with_same_grads

# Muon matrices (tall, wide, square, rows not divisible by 2/3/4, fewer rows
# than ranks, divisible) plus non-2D parameters that go to AdamW.
AUTO_SHAPES = [(10, 6), (6, 10), (7, 7), (33, 16), (16, 33), (1, 5), (12, 8), (9,), (2, 3, 2)]
EMBED_SHAPE = (11, 4)  # 2D, but in a use_muon=False group: AdamW
LR_GROUP_SHAPE = (5, 9)  # Muon, own group with its own lr / weight decay

CONFIGS = {
    "default": dict(lr=0.02),
    "variant": dict(
        lr=0.01,
        momentum=0.9,
        nesterov=False,
        weight_decay=0.05,
        ns_steps=3,
        adjust_lr_fn="match_rms_adamw",
    ),
}
ADAMW_KWARGS = dict(lr=3e-3, betas=(0.8, 0.99), weight_decay=0.02)
STEPS = 3


def _make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    auto = [torch.randn(s, generator=g) for s in AUTO_SHAPES]
    emb = torch.randn(EMBED_SHAPE, generator=g)
    lrp = torch.randn(LR_GROUP_SHAPE, generator=g)
    return auto, emb, lrp


def _build(auto, emb, lrp, cfg, comm="all_gather", **kw):
    """ShardedMuon and the reference optimizers over copies of the same params."""
    a = [p.clone().requires_grad_() for p in auto]
    e = emb.clone().requires_grad_()
    l = lrp.clone().requires_grad_()
    opt = ShardedMuon(
        [
            {"params": a},
            {"params": [e], "use_muon": False, "adamw_lr": 0.01},
            {"params": [l], "lr": 0.05, "weight_decay": 0.0},
        ],
        comm=comm,
        adamw_kwargs=ADAMW_KWARGS,
        **kw,
        **cfg,
    )
    ra = [p.clone().requires_grad_() for p in auto]
    re_ = emb.clone().requires_grad_()
    rl = lrp.clone().requires_grad_()
    ref_muon = torch.optim.Muon(
        [{"params": [p for p in ra if p.ndim == 2]}, {"params": [rl], "lr": 0.05, "weight_decay": 0.0}],
        **cfg,
    )
    ref_adamw = torch.optim.AdamW(
        [{"params": [p for p in ra if p.ndim != 2]}, {"params": [re_], "lr": 0.01}], **ADAMW_KWARGS
    )
    return opt, a + [e, l], (ref_muon, ref_adamw), ra + [re_, rl]


def _reload(opt, params):
    """A new ShardedMuon over copies of `params`, same groups, loaded from opt.state_dict()."""
    params2 = [p.detach().clone().requires_grad_() for p in params]
    index = {id(p): i for i, p in enumerate(params)}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [params2[index[id(p)]] for p in g["params"]]}
        for g in opt.param_groups
    ]
    opt2 = ShardedMuon(groups, comm=opt.comm)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    return params2, opt2


def _check_momentum(tag, opt, params, ref_muon, ref_params, rank, world_size, failures):
    """Each rank's momentum state is exactly its rows of the reference buffer, zero padded."""
    for p, rp in zip(params, ref_params):
        if rp not in ref_muon.state:
            continue
        ref_buf = ref_muon.state[rp]["momentum_buffer"]
        buf = opt.state[p]["momentum_buffer"]
        sp = RowSplit(p.shape[0], p.shape[1], world_size)
        lo, n = sp.offset(rank), sp.size(rank)
        if tuple(buf.shape) != (sp.shard_rows, sp.cols):
            failures.append(f"{tag}: momentum shard shape {tuple(buf.shape)} for {tuple(p.shape)}")
        elif not torch.equal(buf[:n], ref_buf[lo : lo + n]) or buf[n:].any():
            failures.append(f"{tag}: momentum shard of {tuple(p.shape)} differs")


def _run_and_compare(rank, world_size, comm, cfg_name, failures, backend=None):
    auto, emb, lrp = _make_params()
    opt, params, (ref_muon, ref_adamw), ref_params = _build(
        auto, emb, lrp, CONFIGS[cfg_name], comm=comm, backend=backend
    )
    step_beside_reference(opt, (ref_muon, ref_adamw), params, ref_params, rank, world_size, STEPS,
                          f"W={world_size} {comm} {cfg_name}", failures)
    _check_momentum(f"W={world_size} {comm} {cfg_name}", opt, params, ref_muon, ref_params, rank, world_size, failures)
    return opt, params


def _body_equal(rank, world_size):
    failures: list[str] = []
    for comm in COMM_MODES:
        for cfg_name in CONFIGS:
            opt, params = _run_and_compare(rank, world_size, comm, cfg_name, failures)
    # state_dict round trip: a fresh optimizer loaded from this rank's state
    # continues exactly like the original.
    params2, opt2 = _reload(opt, params)
    shapes = [p.shape for p in params]
    for p, p2, g in zip(params, params2, rank_grads(99, world_size, shapes)):
        p.grad = g[rank].clone()
        p2.grad = g[rank].clone()
    opt.step()
    opt2.step()
    compare_params(f"W={world_size} state_dict round trip", params2, params, failures)
    return failures


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_equals_reference(world_size):
    """Both comm modes, two hyper-parameter sets, 3 steps: bit-identical to the reference."""
    results = run_ranks(world_size, _body_equal, timeout=120)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- compile


def _recording_backend(gm, example_inputs):
    """Like backend="eager", and remembers the graph."""
    _recording_backend.graphs.append(gm)
    return gm.forward


_recording_backend.graphs = []


def _body_compiled(rank, world_size):
    failures: list[str] = []
    ops = {}
    for comm in COMM_MODES:
        _recording_backend.graphs.clear()
        _run_and_compare(rank, world_size, comm, "default", failures, backend=_recording_backend)
        ops[comm] = (
            len(_recording_backend.graphs),
            sorted(
                {
                    str(n.target)
                    for gm in _recording_backend.graphs
                    for n in gm.graph.nodes
                    if n.op == "call_function" and "c10d" in str(n.target)
                }
            ),
        )
    return failures, ops


def test_compiled_step_captures_functional_collectives():
    """torch.compile captures the shard step as one graph with the functional collectives."""
    results = run_ranks(2, _body_compiled, timeout=120)
    for rank, (failures, ops) in enumerate(results):
        assert not failures, "\n".join(failures)
        n_graphs, targets = ops["all_gather"]
        assert n_graphs == 1, f"rank {rank}: graph breaks or recompiles: {n_graphs} graphs"
        assert targets == ["_c10d_functional.all_gather_into_tensor", "_c10d_functional.wait_tensor"]
        n_graphs, targets = ops["gather_broadcast"]
        assert n_graphs == 1, f"rank {rank}: graph breaks or recompiles: {n_graphs} graphs"
        assert targets == [
            "_c10d_functional.all_gather_into_tensor",
            "_c10d_functional.broadcast",
            "_c10d_functional.wait_tensor",
        ]


# Column and row vectors as matrices: NS transposes the tall [n, 1] one, a view whose strides
# `.contiguous()` leaves as they are; gather_broadcast's torch.cond must still see one layout.
# W of each shape: every rank owns one of each, so the rewrite's plan saves and is applied.
VECTOR_SHAPES = [(5, 1), (1, 6), (6, 4)]


def _body_vectors(rank, world_size):
    """Compiled (laplace, CPU target: the Muon rewrite runs) and eager ShardedMuon beside torch.optim.Muon."""
    import functools

    import laplace_passes
    from laplace_passes.driver.backend import laplace_backend

    failures: list[str] = []
    records = {}
    gen = torch.Generator().manual_seed(4)
    init = [torch.randn(s, generator=gen) for s in VECTOR_SHAPES * world_size]
    for comm in COMM_MODES:
        report = laplace_passes.Report()
        compiled = functools.partial(laplace_backend, options={"target": "cpu", "report": report})
        for name, backend in (("compiled", compiled), ("eager", None)):
            params = [t.clone().requires_grad_() for t in init]
            ref_params = [t.clone().requires_grad_() for t in init]
            opt = ShardedMuon(params, comm=comm, backend=backend, lr=0.02)
            ref = torch.optim.Muon(ref_params, lr=0.02)
            # A schedule of lr and momentum (NOTE [step sizes are inputs of the compiled step]): one compile.
            schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + step)) for o in (opt, ref)]

            def next_settings():
                for schedule in schedules:
                    schedule.step()
                for group in (*opt.param_groups, *ref.param_groups):
                    group["momentum"] -= 0.05

            step_beside_reference(opt, (ref,), params, ref_params, rank, world_size, 3,
                                  f"W={world_size} {comm} {name}", failures, after_step=next_settings)
        records[comm] = [(p.modified, p.declined) for p in report.passes if p.name == "muon_all_to_all"]
    return failures, records


@pytest.mark.parametrize("world_size", [2, 3])
def test_column_vector_matrices_compile_and_equal_torch_muon(world_size):
    """[n, 1] parameters in both comm modes: the step compiles once for 3 steps of a learning-rate and momentum
    schedule, equals the eager step and torch.optim.Muon bit for bit, and the Muon rewrite takes every matrix
    (no decline)."""
    results = run_ranks(world_size, _body_vectors, timeout=180)
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
    for rank, (_, records) in enumerate(results):
        for comm, passes in records.items():
            assert [modified for modified, _ in passes] == [True], (rank, comm, passes)
            assert not [reason for _, declined in passes for reason in declined], (rank, comm, passes)


# ---------------------------------------------------------------- failures

PG_TIMEOUT = 3.0  # the faulted step's process-group timeout
WARM_UP_PG_TIMEOUT = 120.0  # the first step compiles the shard step: ranks may reach its collectives far apart


def _body_fault(rank, world_size, comm, phase, mode):
    """Rank 1 raises at `phase` of the second step; return what each rank saw.

    The first step (compiling) runs under a generous timeout; only the
    faulted step gets the short one, so a slow compile is never taken for a
    hung peer.
    """
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    auto, emb, lrp = _make_params()
    opt, params, _, _ = _build(auto, emb, lrp, CONFIGS["default"], comm=comm)
    shapes = [p.shape for p in params]
    for step in range(2):
        for p, g in zip(params, rank_grads(step, world_size, shapes)):
            p.grad = g[rank].clone()
        if step == 0:
            opt.step()
            before_params = [p.detach().clone() for p in params]
            before_state = copy.deepcopy(opt.state_dict()["state"])
            continue

        def hook(ph):
            if rank == 1 and ph == phase:
                raise RuntimeError("injected failure")

        opt._fault_hook = hook
        torch.distributed.barrier()  # every rank has compiled and stepped once
        _set_pg_timeout(timedelta(seconds=PG_TIMEOUT))
        t0 = time.monotonic()
        try:
            opt.step()
            outcome = ("returned", "")
        except ShardedMuonStepError as e:
            outcome = ("ShardedMuonStepError", str(e))
        except Exception as e:  # wrong exception type: report it
            outcome = (type(e).__name__, str(e))
        elapsed = time.monotonic() - t0
    if rank == 1 and mode == "hang":
        # Stay alive with connections open: the peers must notice through
        # the process group timeout, not through closed sockets.
        time.sleep(PG_TIMEOUT + 1.5)
    params_unchanged = all(torch.equal(p, b) for p, b in zip(params, before_params))
    after_state = opt.state_dict()["state"]
    state_unchanged = before_state.keys() == after_state.keys() and all(
        before_state[k].keys() == after_state[k].keys()
        and all(torch.equal(before_state[k][n], after_state[k][n]) for n in before_state[k])
        for k in before_state
    )
    return outcome, params_unchanged, state_unchanged, elapsed


@pytest.mark.parametrize(
    "world_size,comm,phase,mode",
    [
        (2, "all_gather", "reduce", "exit"),
        (3, "gather_broadcast", "shard_step", "hang"),
        (4, "all_gather", "all_gather_params", "hang"),
    ],
)
def test_rank_failure_mid_step(world_size, comm, phase, mode):
    """One rank raises mid-step: every rank raises, nothing is modified anywhere."""
    results = run_ranks(
        world_size, _body_fault, comm, phase, mode, timeout=240, pg_timeout=WARM_UP_PG_TIMEOUT
    )
    for rank, ((kind, msg), params_unchanged, state_unchanged, elapsed) in enumerate(results):
        assert kind == "ShardedMuonStepError", f"rank {rank}: {kind}: {msg}"
        assert f"rank {rank} of {world_size}" in msg, msg
        assert "No parameter or optimizer state was modified" in msg, msg
        assert params_unchanged, f"rank {rank}: parameters modified by a failed step"
        assert state_unchanged, f"rank {rank}: optimizer state modified by a failed step"
        if rank == 1:
            assert "injected failure" in msg and f"during '{phase}'" in msg, msg
        else:
            assert f"{PG_TIMEOUT:g}s" in msg, msg  # names the process group timeout
            if mode == "hang":
                # detected through the process group timeout
                assert "timed out" in msg.lower(), msg
                assert elapsed < PG_TIMEOUT + 20, elapsed


# ---------------------------------------------------------------- W = 1


def _single_process_compare(cfg, comm, backend=None, steps=STEPS):
    auto, emb, lrp = _make_params(seed=1)
    opt, params, (ref_muon, ref_adamw), ref_params = _build(auto, emb, lrp, cfg, comm=comm, backend=backend)
    assert opt.world_size == 1
    for step in range(steps):
        for p, rp in zip(params, ref_params):
            g = torch.randn(p.shape)  # arbitrary floats: no averaging at W=1
            p.grad = g.clone()
            rp.grad = g.clone()
        opt.step()
        ref_muon.step()
        ref_adamw.step()
        for i, (x, y) in enumerate(zip(params, ref_params)):
            assert torch.equal(x, y), f"step {step}: param {i} {tuple(x.shape)} differs"
    for p, rp in zip(params, ref_params):
        if rp in ref_muon.state:
            assert torch.equal(opt.state[p]["momentum_buffer"], ref_muon.state[rp]["momentum_buffer"])
        else:
            for k in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][k], ref_adamw.state[rp][k]), k


@pytest.mark.parametrize("comm", COMM_MODES)
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_single_process_equals_torch_muon(comm, cfg_name):
    assert not torch.distributed.is_initialized()
    _single_process_compare(CONFIGS[cfg_name], comm)


def test_single_process_compiled_eager_backend():
    _single_process_compare(CONFIGS["default"], "all_gather", backend="eager", steps=2)


def _counting_backend():
    compiled = []

    def backend(graph_module, example_inputs):
        compiled.append(graph_module)
        return graph_module.forward

    return backend, compiled


# (lr, weight_decay, momentum) per step: a schedule changes them all; step 3 returns to step 0's values.
SCHEDULE = [(0.02, 0.1, 0.95), (0.011, 0.1, 0.9), (0.005, 0.03, 0.85), (0.02, 0.1, 0.95), (0.0, 0.0, 0.0)]


@pytest.mark.parametrize("nesterov", [True, False])
def test_learning_rate_weight_decay_and_momentum_changes_run_one_compiled_step(nesterov):
    """NOTE [step sizes are inputs of the compiled step]: changing lr, weight decay and momentum between steps
    (what a schedule does) runs the step compiled first, and every step equals torch.optim.Muon's at that step's
    settings. A graph reused with the values of its first compile would update with the old lr: each step is
    compared bit for bit, and the compiles are counted at the backend."""
    backend, compiled = _counting_backend()
    torch._dynamo.reset()
    torch.manual_seed(5)
    ps = [torch.randn(8, 4), torch.randn(3, 6)]
    a = [p.clone().requires_grad_() for p in ps]
    b = [p.clone().requires_grad_() for p in ps]
    settings = dict(ns_steps=1, nesterov=nesterov)  # one Newton-Schulz step: the compile traces less
    opt, ref = ShardedMuon(a, **settings, backend=backend), torch.optim.Muon(b, **settings)
    for step, (lr, weight_decay, momentum) in enumerate(SCHEDULE):
        for group in (*opt.param_groups, *ref.param_groups):
            group.update(lr=lr, weight_decay=weight_decay, momentum=momentum)
        step_with_same_grads(opt, a, [ref], b, steps=1)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: the step differs from torch.optim.Muon's"
        for x, y in zip(a, b):
            assert torch.equal(opt.state[x]["momentum_buffer"], ref.state[y]["momentum_buffer"]), f"step {step}"
    assert len(compiled) == 1, f"{len(compiled)} compiles for {len(SCHEDULE)} steps of a schedule"
    placeholders = [n for n in compiled[0].graph.nodes if n.op == "placeholder"]
    assert any(tuple(n.meta["example_value"].shape) == (2, 4) for n in placeholders), "no step-size input"


def test_a_new_newton_schulz_setting_compiles_a_new_step_and_an_old_one_reuses_its_own():
    """The Newton-Schulz settings stay constants of the graph: a changed ns_steps compiles a step of its own, and
    going back reuses the first (Dynamo's guards tell them apart); each step equals torch.optim.Muon's."""
    backend, compiled = _counting_backend()
    torch._dynamo.reset()
    torch.manual_seed(6)
    ps = [torch.randn(8, 4)]
    a = [p.clone().requires_grad_() for p in ps]
    b = [p.clone().requires_grad_() for p in ps]
    opt, ref = ShardedMuon(a, ns_steps=1, backend=backend), torch.optim.Muon(b, ns_steps=1)
    for ns_steps, compiles in [(1, 1), (2, 2), (1, 2)]:
        for group in (*opt.param_groups, *ref.param_groups):
            group["ns_steps"] = ns_steps
        step_with_same_grads(opt, a, [ref], b, steps=1)
        assert len(compiled) == compiles, f"ns_steps {ns_steps}: {len(compiled)} compiles, expected {compiles}"
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"ns_steps {ns_steps}: differs from torch.optim.Muon"


@pytest.mark.filterwarnings("ignore:ShardedMuon. the learning rate")  # the recompile it warns of is expected here
def test_bfloat16_matrices_keep_their_step_sizes_as_constants():
    """A bf16 matrix's step sizes stay constants (lerp takes a weight of its input's dtype only): the compiled
    step equals the eager one at each learning rate, one compile per learning rate."""
    backend, compiled = _counting_backend()
    torch._dynamo.reset()
    torch.manual_seed(7)
    p0 = torch.randn(8, 4).bfloat16()
    a, b = p0.clone().requires_grad_(), p0.clone().requires_grad_()
    opt, eager = ShardedMuon([a], ns_steps=1, backend=backend), ShardedMuon([b], ns_steps=1, backend=None)
    for lr, compiles in [(0.02, 1), (0.01, 2)]:
        for group in (*opt.param_groups, *eager.param_groups):
            group["lr"] = lr
        a.grad = torch.randn(a.shape).bfloat16()
        b.grad = a.grad.clone()
        opt.step()
        eager.step()
        assert len(compiled) == compiles and torch.equal(a, b), f"lr {lr}: {len(compiled)} compiles"


def test_a_schedule_with_a_bfloat16_matrix_warns_once_that_it_recompiles():
    """With a bf16 matrix among float32 ones, every matrix's step sizes are constants: a learning-rate schedule
    compiled the step at every step, past the recompile limit ran it uncompiled, and said nothing. The warning
    names the bf16 matrix; all-float32 matrices under the same schedule (one compile) do not warn."""
    import warnings

    torch.manual_seed(8)
    for dtypes, compiles, warned in [((torch.float32, torch.bfloat16), 3, 1), ((torch.float32, torch.float32), 1, 0)]:
        backend, compiled = _counting_backend()
        torch._dynamo.reset()
        params = [torch.randn(8, 4).to(dtype).requires_grad_() for dtype in dtypes]
        opt = ShardedMuon(params, ns_steps=1, backend=backend)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for lr in (0.02, 0.01, 0.005):
                opt.param_groups[0]["lr"] = lr
                for p in params:
                    p.grad = torch.randn(p.shape).to(p.dtype)
                opt.step()
        messages = [str(w.message) for w in caught if "recompile" in str(w.message)]
        assert (len(compiled), len(messages)) == (compiles, warned), (dtypes, len(compiled), messages)
        assert all("parameter 1 (8, 4) torch.bfloat16" in m and "recompile_limit" in m for m in messages), messages


def test_a_matrix_without_a_grad_at_one_step_is_no_change_of_learning_rate():
    """The warning compares each matrix's step sizes with its own last ones: a matrix left out of one step (no
    .grad) changed the list of step sizes, and the learning rate was said to have changed."""
    import warnings

    torch.manual_seed(9)
    backend, _ = _counting_backend()
    torch._dynamo.reset()
    params = [torch.randn(8, 4).to(dtype).requires_grad_() for dtype in (torch.float32, torch.bfloat16, torch.float32)]
    opt = ShardedMuon(params, ns_steps=1, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for with_grad in (params, params[:2], params):  # the last float32 matrix left out of the middle step
            for p in params:
                p.grad = torch.randn(p.shape).to(p.dtype) if any(p is q for q in with_grad) else None
            opt.step()
    assert not [str(w.message) for w in caught if "recompile" in str(w.message)]


def test_step_sizes_of_the_wrong_shape_are_refused_before_any_collective():
    from model_zoo.muon import muon_shard_step

    hp = MuonHParams(0.02, 0.1, 0.95, True, (3.4445, -4.775, 2.0315), 1, 1e-7, 0.02)
    shard = torch.zeros(4, 4)
    with pytest.raises(ValueError, match=r"step_sizes must be a float32 tensor of shape \(1, 4\).*float64 \(4,\)"):
        muon_shard_step([shard], [shard], [shard], torch.tensor(0), torch.zeros(4, dtype=torch.float64),
                        splits=(RowSplit(4, 4, 1),), hparams=(hp,), owners=(0,), comm="all_gather", world_size=1,
                        group=None)


def test_only_muon_params_equals_torch_muon_exactly():
    """The plain drop-in: ShardedMuon(params) vs torch.optim.Muon(params), all defaults."""
    torch.manual_seed(3)
    ps = [torch.randn(s) for s in [(8, 3), (3, 8), (4, 4)]]
    a = [p.clone().requires_grad_() for p in ps]
    b = [p.clone().requires_grad_() for p in ps]
    opt, ref = ShardedMuon(a), torch.optim.Muon(b)
    step_with_same_grads(opt, a, [ref], b, steps=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # At W=1 the state is torch.optim.Muon's.
    sd, rsd = opt.state_dict(), ref.state_dict()
    for k in rsd["state"]:
        assert torch.equal(sd["state"][k]["momentum_buffer"], rsd["state"][k]["momentum_buffer"])


def test_single_process_state_dict_round_trip():
    auto, emb, lrp = _make_params(seed=2)
    opt, params, _, _ = _build(auto, emb, lrp, CONFIGS["default"])
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()
    params2, opt2 = _reload(opt, params)
    step_with_same_grads(opt, params, [opt2], params2, steps=1)
    assert all(torch.equal(x, y) for x, y in zip(params, params2))


# ---------------------------------------------------------------- arguments


def test_signature_matches_torch_muon():
    ref = inspect.signature(torch.optim.Muon.__init__).parameters
    ours = inspect.signature(ShardedMuon.__init__).parameters
    for name, prm in ref.items():
        if name in ("self", "params"):
            continue
        assert name in ours, name
        assert ours[name].default == prm.default, (name, ours[name].default, prm.default)
    extra = set(ours) - set(ref)
    assert extra == {"comm", "process_group", "backend", "adamw_kwargs"}
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in extra)


def _p(*shape):
    return torch.zeros(shape, requires_grad=True)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: ShardedMuon([_p(3, 3)], comm="all_to_all"), ValueError, "unknown comm='all_to_all'"),
        (lambda: ShardedMuon([{"params": [_p(3)], "use_muon": True}]), ValueError, r"only supports 2D.*\(3,\)"),
        (lambda: ShardedMuon([{"params": [_p(2, 2, 2)], "use_muon": True}]), ValueError, "only supports 2D"),
        (lambda: ShardedMuon([{"params": [_p(3, 3)], "use_muon": "yes"}]), ValueError, "use_muon"),
        (lambda: ShardedMuon([_p(3, 3)], adamw_kwargs={"momentum": 0.9}), TypeError, "unknown adamw_kwargs"),
        (lambda: ShardedMuon([_p(3, 3)], adamw_kwargs={"betas": (0.9, 1.0)}), ValueError, "beta"),
        (lambda: ShardedMuon([_p(3, 3)], lr=-1.0), ValueError, "Learning rate"),
        (lambda: ShardedMuon([_p(3, 3)], momentum=-0.1), ValueError, "momentum"),
        (lambda: ShardedMuon([_p(3, 3)], weight_decay=-0.1), ValueError, "weight decay"),
        (lambda: ShardedMuon([_p(3, 3)], adjust_lr_fn="bogus"), ValueError, "bogus"),
        (lambda: ShardedMuon([_p(3, 3)], ns_steps=100), ValueError, "ns_steps"),
        (lambda: ShardedMuon([_p(3, 3)], ns_coefficients=(1.0, 2.0)), ValueError, "ns_coefficients"),
        (lambda: ShardedMuon([_p(3, 3)], backend=3), TypeError, "backend"),
        (lambda: ShardedMuon([_p(3, 3)], process_group=object()), RuntimeError, "not initialised"),
        (lambda: ShardedMuon([torch.zeros(3, 3, dtype=torch.complex64)]), ValueError, "complex"),
        (lambda: ShardedMuon([{"params": [_p(3, 3)], "lr": -1.0}]), ValueError, "Learning rate"),
    ],
)
def test_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_add_param_group_validates():
    opt = ShardedMuon([_p(3, 3)])
    with pytest.raises(ValueError, match="only supports 2D"):
        opt.add_param_group({"params": [_p(4)], "use_muon": True})


def test_state_from_other_world_size_is_rejected():
    p = _p(5, 3)
    opt = ShardedMuon([p])
    opt.state[p]["momentum_buffer"] = torch.zeros(3, 3)  # a W=2 shard
    p.grad = torch.ones(5, 3)
    with pytest.raises(RuntimeError, match="another world size"):
        opt.step()
    assert torch.equal(p, torch.zeros(5, 3))


def test_row_split():
    for rows in range(0, 13):
        for W in (1, 2, 3, 4, 5):
            sp = RowSplit(rows, 2, W)
            sizes = [sp.size(r) for r in range(W)]
            assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1
            assert sp.shard_rows == max(sizes) and sp.shard_numel == sp.shard_rows * 2
            # Stored, not properties: Dynamo reads a field as a constant, a property it inlines as a call.
            assert {"base", "extra", "shard_rows", "shard_numel"} <= vars(sp).keys()
            assert [sp.offset(r) for r in range(W)] == [sum(sizes[:r]) for r in range(W)]
            full = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2)
            padded = sp.pad_all(full)
            assert padded.shape == (W, sp.shard_rows, 2)
            assert torch.equal(sp.unpad_all(padded), full)
            for r in range(W):
                own = sp.own(full, r)
                assert torch.equal(own, padded[r])
                assert not own[sizes[r]:].any()
