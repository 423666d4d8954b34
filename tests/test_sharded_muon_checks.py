"""What ShardedMuon checks before it lets ranks step together, and a Tensor learning rate.

* Ranks that differ in their parameters (count, shape, dtype, order, values at the first step) raise the same kind
  of error on every rank, parameters and state untouched (NOTE [ranks agree before the step's collectives]);
  before, gloo aborted the processes, or the step mixed unrelated rows without a word.
* ``state_dict()`` says where it was saved: another rank's or another world size's is refused; one saved at world
  size 1 (whole matrices, like torch.optim.Muon's) loads at any world size.
* A Tensor ``lr`` steps bit for bit as torch.optim.Muon's, which computes its step sizes in the tensor's dtype.

The multi-rank cases all run in one launch of 2 gloo ranks (the module fixture `two_ranks`), each case on its
own parameters; a refused step leaves the ranks' collectives in step, so the next case can follow.
"""

from __future__ import annotations

import io

import pytest
import torch

from model_zoo.muon import RowSplit, ShardedMuon, ShardedMuonStepError
from tests._dist import run_ranks
from tests.muon_cases import rank_grads

MATRIX = (7, 4)  # 7 rows: 4 + 3 at W = 2, so rank 1's shard is padded


def _param(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


# (rank 0's parameters, rank 1's parameters) per case, as (shape, seed, dtype).
F32, F64 = torch.float32, torch.float64
CASES = {
    "count": ([((8, 4), 0, F32), ((6, 4), 1, F32), ((5, 3), 2, F32)], [((8, 4), 0, F32), ((6, 4), 1, F32)]),
    "dtype": ([((8, 4), 0, F32)], [((8, 4), 0, F64)]),
    "shape": ([((8, 4), 0, F32), ((6, 4), 1, F32)], [((8, 4), 0, F32), ((4, 6), 1, F32)]),
    "order": ([((8, 4), 0, F32), ((4, 8), 1, F32)], [((4, 8), 1, F32), ((8, 4), 0, F32)]),
    "same_shapes_in_another_order": ([((4, 4), 0, F32), ((4, 4), 1, F32)], [((4, 4), 1, F32), ((4, 4), 0, F32)]),
    "not_replicated": ([((4, 4), 0, F32), ((4,), 10, F32)], [((4, 4), 1, F32), ((4,), 11, F32)]),
}


def _refused_step(rank, case):
    """One step of `case`'s parameters on this rank: (what it raised, parameters and state untouched)."""
    params = [_param(*spec) for spec in CASES[case][rank]]
    before = [p.detach().clone() for p in params]
    opt = ShardedMuon(params, backend=None)
    for p in params:
        p.grad = torch.ones_like(p)
    try:
        opt.step()
        outcome = "returned"
    except ShardedMuonStepError as error:
        outcome = f"{type(error).__name__}: {error}"
    untouched = all(torch.equal(p, b) for p, b in zip(params, before)) and not any(opt.state.values())
    return outcome, untouched


def _rounding_only(rank):
    """Replicas whose values differ by far less than a reordered float64 sum may: the first step runs."""
    p = _param((64, 32), 3, torch.float64)
    if rank == 1:
        with torch.no_grad():
            p[0, 0] += 1e-12
    opt = ShardedMuon([p], backend=None)
    p.grad = torch.ones_like(p)
    opt.step()
    return "returned"


def _state_dict_cases(rank, world_size, whole_state):
    """Rank 0's state_dict loaded on rank 1 (refused); a world-size-1 state_dict loaded on every rank."""
    import torch.distributed as dist

    p = _param(MATRIX, 5)
    opt = ShardedMuon([p], lr=0.02, backend=None)
    p.grad = torch.ones_like(p)
    opt.step()
    saved = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(saved, src=0)
    fresh = ShardedMuon([_param(MATRIX, 5)], lr=0.02, backend=None)
    try:
        fresh.load_state_dict(saved[0])
        other_rank = "loaded"
    except ValueError as error:
        other_rank = str(error)
    other_rank_untouched = not any(fresh.state.values())
    # The world-size-1 state (whole momentum) after 2 steps of torch.optim.Muon's gradients, then 2 more here.
    q = _param(MATRIX, 6)
    with torch.no_grad():
        q.copy_(whole_state["param"])
    resumed = ShardedMuon([q], lr=0.02, backend=None)
    resumed.load_state_dict(whole_state["optim"])
    for step in (2, 3):
        q.grad = rank_grads(step, 1, [MATRIX])[0][0]  # the same on every rank: the average is exact
        resumed.step()
    split = RowSplit(*MATRIX, world_size)
    buf = resumed.state[q]["momentum_buffer"]
    return other_rank, other_rank_untouched, q.detach(), buf[: split.size(rank)], split.offset(rank)


def _compiled_tensor_lr(rank, world_size):
    """A float32 Tensor lr under a schedule, compiled, beside torch.optim.Muon: each step's parameters."""
    backend_calls = []

    def counting_backend(graph_module, example_inputs):
        backend_calls.append(graph_module)
        return graph_module.forward

    params, ref_params = _param(MATRIX, 7), _param(MATRIX, 7)
    opt = ShardedMuon([params], lr=torch.tensor(0.0203), ns_steps=1, backend=counting_backend)
    ref = torch.optim.Muon([ref_params], lr=torch.tensor(0.0203), ns_steps=1)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + 0.37 * step)) for o in (opt, ref)]
    exact = []
    for step in range(3):
        grads = rank_grads(step, world_size, [MATRIX])[0]
        params.grad, ref_params.grad = grads[rank].clone(), grads.sum(0) / world_size
        opt.step()
        ref.step()
        exact.append(torch.equal(params, ref_params))
        for schedule in schedules:
            schedule.step()
    return exact, len(backend_calls)


def _inf_on_one_rank(rank):
    """Rank 0's matrix holds an inf, rank 1's does not: an inf sum must not widen the tolerance to anything."""
    p = _param((8, 4), 12 + rank)
    if rank == 0:
        with torch.no_grad():
            p[0, 0] = float("inf")
    opt = ShardedMuon([p], backend=None)
    p.grad = torch.ones_like(p)
    try:
        opt.step()
        return "returned"
    except ShardedMuonStepError as error:
        return f"{type(error).__name__}: {error}"


def _group_added_later(rank):
    """A replicated first group steps; a group added after it, whose values differ between the ranks, is refused
    at the next step."""
    first = _param((8, 4), 14)
    opt = ShardedMuon([first], backend=None)
    first.grad = torch.ones_like(first)
    opt.step()
    later = _param((8, 4), 15 + rank)
    opt.add_param_group({"params": [later]})
    first.grad, later.grad = torch.ones_like(first), torch.ones_like(later)
    try:
        opt.step()
        return "returned"
    except ShardedMuonStepError as error:
        return f"{type(error).__name__}: {error}"


def _guarded(fn, *args):
    """fn(*args), or the error it raised as a string: one case's failure is reported beside the others'."""
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001 - reported to the test, which names it
        return f"{type(error).__name__}: {error}"


def _body(rank, world_size, whole_state):
    results = {case: _guarded(_refused_step, rank, case) for case in CASES}
    results["rounding_only"] = _guarded(_rounding_only, rank)
    results["inf_on_one_rank"] = _guarded(_inf_on_one_rank, rank)
    results["group_added_later"] = _guarded(_group_added_later, rank)
    results["state_dict"] = _guarded(_state_dict_cases, rank, world_size, whole_state)
    results["compiled_tensor_lr"] = _guarded(_compiled_tensor_lr, rank, world_size)
    return results


def _muon_reference(steps):
    """torch.optim.Muon over MATRIX after `steps` steps: (parameter, momentum)."""
    p = _param(MATRIX, 6)
    ref = torch.optim.Muon([p], lr=0.02)
    for step in range(steps):
        p.grad = rank_grads(step, 1, [MATRIX])[0][0]
        ref.step()
    return p.detach(), ref.state[p]["momentum_buffer"]


@pytest.fixture(scope="module")
def two_ranks():
    p = _param(MATRIX, 6)
    opt = ShardedMuon([p], lr=0.02, backend=None)
    for step in range(2):
        p.grad = rank_grads(step, 1, [MATRIX])[0][0]
        opt.step()
    whole_state = {"param": p.detach().clone(), "optim": opt.state_dict()}
    return run_ranks(2, _body, whole_state, timeout=180)


@pytest.mark.parametrize("case,words", [
    ("count", ["different numbers of parameters", "rank 0: 3, rank 1: 2"]),
    ("dtype", ["differ in shape or dtype: parameter 0", "torch.float{bits} on this rank"]),
    ("shape", ["differ in shape or dtype: parameter 1", "{shape} torch.float32 on this rank"]),
    ("order", ["differ in shape or dtype: parameter 0", "{shape} torch.float32 on this rank"]),
])
def test_ranks_with_other_parameters_raise_the_same_error_everywhere(two_ranks, case, words):
    """Counts, dtypes or shapes that differ between the ranks: gloo aborted both processes (count, dtype), or the
    step went on with each rank's rows of unrelated matrices (shapes (6, 4) and (4, 6), another order)."""
    for rank, results in enumerate(two_ranks):
        assert isinstance(results[case], tuple), f"rank {rank}: {results[case]}"
        outcome, untouched = results[case]
        assert outcome.startswith("ShardedMuonParamLayoutError: "), f"rank {rank}: {outcome}"
        shape = CASES[case][rank][1 if case == "shape" else 0][0]
        for word in words:
            assert word.format(bits=32 * (rank + 1), shape=shape) in outcome, f"rank {rank}: {outcome}"
        assert "No parameter or optimizer state was modified" in outcome, outcome
        assert untouched, f"rank {rank}: parameters or state modified"


@pytest.mark.parametrize("case", ["not_replicated", "same_shapes_in_another_order"])
def test_parameters_that_differ_between_ranks_at_the_first_step_are_refused(two_ranks, case):
    """Replicas that differ (no seed, no broadcast; same shapes listed in another order) became a patchwork of
    the ranks' rows after one step."""
    for rank, results in enumerate(two_ranks):
        assert isinstance(results[case], tuple), f"rank {rank}: {results[case]}"
        outcome, untouched = results[case]
        assert outcome.startswith("ShardedMuonUnreplicatedError: "), f"rank {rank}: {outcome}"
        assert "parameter 0 ((4, 4) torch.float32" in outcome and "ranks [1]" in outcome, outcome
        assert "same seed on every rank, or broadcast rank 0's values" in outcome, outcome
        assert untouched, f"rank {rank}: parameters or state modified"
    assert [results["rounding_only"] for results in two_ranks] == ["returned"] * 2


@pytest.mark.parametrize("case, parameter", [("inf_on_one_rank", 0), ("group_added_later", 1)])
def test_replicas_that_differ_by_an_inf_or_in_a_group_added_later_are_refused(two_ranks, case, parameter):
    """An inf in one rank's matrix made its sums' tolerance infinite, and a group added after the first step was
    never compared: both stepped as if replicated."""
    for rank, results in enumerate(two_ranks):
        outcome = results[case]
        assert outcome.startswith("ShardedMuonUnreplicatedError: "), f"rank {rank}: {outcome}"
        assert f"parameter {parameter} ((8, 4) torch.float32" in outcome, outcome


def test_a_state_dict_of_another_rank_is_refused_and_one_of_world_size_1_loads_on_every_rank(two_ranks):
    """Loading rank 0's state_dict on every rank (the single-process habit) trained rank 1 on with rank 0's
    momentum rows, without a word. A state saved at world size 1 holds whole matrices: each rank keeps its rows
    and steps on as torch.optim.Muon does."""
    ref_param, ref_momentum = _muon_reference(4)
    for rank, results in enumerate(two_ranks):
        assert isinstance(results["state_dict"], tuple), f"rank {rank}: {results['state_dict']}"
        other_rank, untouched, param, momentum, offset = results["state_dict"]
        if rank == 0:
            assert other_rank == "loaded", other_rank
        else:
            assert "saved on rank 0 of world size 2, and this is rank 1 of world size 2" in other_rank, other_rank
            assert "load_dcp_state_dict" in other_rank and "Nothing was loaded" in other_rank, other_rank
            assert untouched, "a refused load_state_dict modified the state"
        assert torch.equal(param, ref_param), f"rank {rank}: differs from torch.optim.Muon after resuming"
        assert torch.equal(momentum, ref_momentum[offset: offset + momentum.shape[0]]), f"rank {rank}: momentum"


def test_compiled_tensor_learning_rate_under_a_schedule_equals_torch_muon_on_two_ranks(two_ranks):
    for rank, results in enumerate(two_ranks):
        assert isinstance(results["compiled_tensor_lr"], tuple), f"rank {rank}: {results['compiled_tensor_lr']}"
        exact, compiles = results["compiled_tensor_lr"]
        assert exact == [True] * 3, f"rank {rank}: steps equal to torch.optim.Muon's: {exact}"
        assert compiles == 1, f"rank {rank}: {compiles} compiles for 3 steps of a schedule"


# ---------------------------------------------------------------- one process


def test_state_dict_says_where_it_was_saved_and_loads_after_torch_save():
    """The key survives torch.save / torch.load(weights_only=True); ShardedMuon and torch.optim.Muon both load
    the state and step on bit for bit."""
    p = _param(MATRIX, 8)
    opt = ShardedMuon([p], lr=0.02, backend=None)
    p.grad = torch.ones_like(p)
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["sharded_muon_saved_at"] == {"rank": 0, "world_size": 1}
    copies = [p.detach().clone().requires_grad_() for _ in range(2)]
    others = [ShardedMuon([copies[0]], lr=0.02, backend=None), torch.optim.Muon([copies[1]], lr=0.02)]
    for other in others:
        other.load_state_dict(saved)
    for step in range(2):
        for q in (p, *copies):
            q.grad = rank_grads(step, 1, [MATRIX])[0][0]
        for o in (opt, *others):
            o.step()
        assert all(torch.equal(p, q) for q in copies), f"step {step}"


def test_a_state_dict_of_another_world_size_is_refused_before_anything_changes():
    """Rank 1's state at world size 2, loaded by a single process: its momentum is rank 1's rows (3 of 7, here
    padded to 4), a shape that passed the old check."""
    p = _param((8, 4), 9)
    opt = ShardedMuon([p], lr=0.02, backend=None)
    state = {"state": {0: {"momentum_buffer": torch.ones(4, 4)}}, "param_groups": opt.state_dict()["param_groups"],
             "sharded_muon_saved_at": {"rank": 1, "world_size": 2}}
    with pytest.raises(ValueError, match=r"saved on rank 1 of world size 2, and this is rank 0 of world size 1"):
        opt.load_state_dict(state)
    assert not any(opt.state.values())
    del state["sharded_muon_saved_at"]  # a state without the key loads as before
    opt.load_state_dict(state)
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.ones(4, 4))


@pytest.mark.parametrize("compiled", [False, True])
def test_tensor_learning_rate_under_a_schedule_equals_torch_muon(compiled):
    """torch.optim.Muon computes 1 - lr * weight_decay and lr * sqrt(rows / cols) in float32 for a float32 Tensor
    lr; in float64 they differed in the last bit for some learning rates (0.0203 among them)."""
    backend = "eager" if compiled else None
    torch._dynamo.reset()
    init = [torch.randn(s, generator=torch.Generator().manual_seed(11)) for s in [(24, 8), (8, 24)]]
    mine = [t.clone().requires_grad_() for t in init]
    theirs = [t.clone().requires_grad_() for t in init]
    opt = ShardedMuon(mine, lr=torch.tensor(0.0203), ns_steps=1, backend=backend)
    ref = torch.optim.Muon(theirs, lr=torch.tensor(0.0203), ns_steps=1)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + 0.37 * step)) for o in (opt, ref)]
    for step in range(4):
        for p, q in zip(mine, theirs):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        assert all(torch.equal(p, q) for p, q in zip(mine, theirs)), f"step {step}: differs from torch.optim.Muon"
        for schedule in schedules:
            schedule.step()
