"""ShardedMuon's state across processes and formats; ranks that disagree; processes outside its group.

* DCP checkpoints (``dcp_state_dict``) saved at one world size load at
  another: every rank's momentum is its rows of the momentum of a reference
  run that never stopped (torch.optim.Muon on the rank-averaged gradients).
* torch.optim.Muon's state_dict loads into ShardedMuon and the other way.
* Ranks disagreeing on which parameters have a ``.grad`` get a named error on
  every rank, parameters untouched (gloo would abort the process).
"""

from __future__ import annotations

import copy

import pytest
import torch

from model_zoo.muon import RowSplit, ShardedMuon, ShardedMuonGradLayoutError
from tests._dist import run_ranks
from tests.muon_cases import rank_grads

SHAPES = [(7, 3), (2, 5), (4,)]  # rows not divisible by 2 or 3; fewer rows than ranks; AdamW
NAMES = ["w_tall", "w_short", "bias"]
ADAMW = {"lr": 0.01, "weight_decay": 0.1}


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def _grads(step: int):
    """Step `step`'s gradients, the same on every rank and at every world size (so is their average)."""
    return [g[0] for g in rank_grads(step, 1, SHAPES)]


def _reference(steps: int):
    """torch.optim.Muon + AdamW that never stopped: (params, Muon, AdamW) after `steps`."""
    params = _params()
    muon = torch.optim.Muon(params[:2], lr=0.02)
    adamw = torch.optim.AdamW(params[2:], **ADAMW)
    for step in range(steps):
        for p, g in zip(params, _grads(step)):
            p.grad = g.clone()
        muon.step()
        adamw.step()
    return params, muon, adamw


def _save_or_resume(rank, world_size, base, saved_steps, steps):
    """Resume from checkpoint `base.saved_steps` (none if 0), run to `steps`, save `base.steps`; compare."""
    import torch.distributed.checkpoint as dcp

    params = _params()
    names = dict(zip(params, NAMES))
    opt = ShardedMuon(params, lr=0.02, backend=None, adamw_kwargs=ADAMW)
    if saved_steps:
        state = {"params": {n: p.detach() for p, n in names.items()}, "optim": opt.dcp_state_dict(names)}
        dcp.load(state, checkpoint_id=f"{base}.{saved_steps}")
        opt.load_dcp_state_dict(names, state["optim"])
    with torch.no_grad():
        for step in range(saved_steps, steps):
            for p, g in zip(params, _grads(step)):
                p.grad = g.clone()
            opt.step()
    dcp.save({"params": {n: p.detach() for p, n in names.items()}, "optim": opt.dcp_state_dict(names)},
             checkpoint_id=f"{base}.{steps}")
    return _differences(opt, params, rank, world_size, steps)


def _differences(opt, params, rank, world_size, steps):
    ref_params, muon, adamw = _reference(steps)
    wrong = [f"param {n}" for n, p, r in zip(NAMES, params, ref_params) if not torch.allclose(p, r, atol=1e-6)]
    for n, p, r in zip(NAMES[:2], params[:2], ref_params[:2]):
        split = RowSplit(*p.shape, world_size)
        rows = muon.state[r]["momentum_buffer"][split.offset(rank): split.offset(rank) + split.size(rank)]
        buf = opt.state[p]["momentum_buffer"]
        if buf.shape != (split.shard_rows, split.cols) or not torch.allclose(buf[: split.size(rank)], rows, atol=1e-6):
            wrong.append(f"momentum of {n}")
    ref_adam = adamw.state[ref_params[2]]
    if not all(torch.allclose(opt.state[params[2]][k], ref_adam[k], atol=1e-6) for k in ("exp_avg", "exp_avg_sq")):
        wrong.append("AdamW state")
    return wrong


def test_dcp_checkpoint_resumes_at_other_world_sizes(tmp_path):
    """W = 1 saves after 1 step, W = 2 resumes to step 2, W = 3 resumes to step 3, W = 1 to step 4."""
    base = str(tmp_path / "ck")
    assert _save_or_resume(0, 1, base, 0, 1) == []
    for world_size, done in ((2, 1), (3, 2)):
        wrong = run_ranks(world_size, _save_or_resume, base, done, done + 1, timeout=120)
        assert wrong == [[]] * world_size, wrong
    assert _save_or_resume(0, 1, base, 3, 4) == []


# ---------------------------------------------------------------- torch.optim.Muon's state_dict


def _muon_pair():
    g = torch.Generator().manual_seed(1)
    shapes = [(6, 4), (3, 5)]
    values = [torch.randn(s, generator=g) for s in shapes]
    return [v.clone().requires_grad_() for v in values], [v.clone().requires_grad_() for v in values]


def _steps(opt, params, seed, n=2):
    for step in range(n):
        for p, g in zip(params, rank_grads(seed + step, 1, [p.shape for p in params])):
            p.grad = g[0].clone()
        opt.step()


@pytest.mark.parametrize("source_is_torch", [True, False])
def test_torch_muon_state_dict_loads_both_ways(source_is_torch):
    """A state_dict of either optimizer continues in the other exactly as in the original."""
    make = {True: lambda ps: torch.optim.Muon(ps, lr=0.03), False: lambda ps: ShardedMuon(ps, lr=0.03, backend=None)}
    original_params, loaded_params = _muon_pair()
    original = make[source_is_torch](original_params)
    _steps(original, original_params, seed=0)
    with torch.no_grad():
        for q, p in zip(loaded_params, original_params):
            q.copy_(p)
    loaded = make[not source_is_torch](loaded_params)
    loaded.load_state_dict(copy.deepcopy(original.state_dict()))
    _steps(original, original_params, seed=10)
    _steps(loaded, loaded_params, seed=10)
    assert all(torch.equal(p, q) for p, q in zip(original_params, loaded_params))


# ---------------------------------------------------------------- ranks that disagree


def _body_disagree(rank, world_size):
    import torch.distributed as dist

    outside = dist.new_group([0])  # rank 1 is not a member
    not_member = ""
    if rank == 1:
        try:
            ShardedMuon([torch.zeros(2, 2, requires_grad=True)], process_group=outside)
        except ValueError as error:
            not_member = str(error)
    params = [torch.ones(s, requires_grad=True) for s in [(4, 3), (3,), (2, 2)]]
    opt = ShardedMuon(params, backend=None)
    for p in params:
        p.grad = torch.ones_like(p)
    if rank == 1:
        params[2].grad = None  # unused on this rank
    try:
        opt.step()
        outcome = "returned"
    except ShardedMuonGradLayoutError as error:
        outcome = str(error)
    untouched = all(torch.equal(p, torch.ones_like(p)) for p in params) and not any(opt.state.values())
    return outcome, untouched, not_member


def test_ranks_disagreeing_on_grads_raise_everywhere():
    results = run_ranks(2, _body_disagree, timeout=90, pg_timeout=20)
    for rank, (outcome, untouched, _) in enumerate(results):
        assert "disagree on which parameters have a .grad" in outcome, f"rank {rank}: {outcome}"
        assert "(2, 2) has one on ranks [0] only" in outcome, outcome
        assert untouched, f"rank {rank}: parameters or state modified"
    assert "not a member of process_group" in results[1][2], results[1][2]
