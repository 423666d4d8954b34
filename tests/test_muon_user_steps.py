"""The Muon rewrite on data-parallel steps written the way users write them (tests/muon_user_steps.py).

Each rank compiles a step with the `laplace` backend (CPU target, eager inner
compiler) and runs it beside the same step run eagerly, on gloo: parameters
and momenta must be bitwise equal after every step (each owner rebuilds the
whole matrix from the same bf16 shards and runs the user's own
Newton-Schulz ops on it). Where the pass rewrites, the graph holds exactly
two all-to-alls and no gather, and each rank receives 2 (W-1) G / W^2 bytes
(G: the gathered matrices), never more than with the gathers; where it
declines, the report says why. One process group per world size: every
case of that size runs in the same W processes, each case compiling from a
reset Dynamo (all cases compile the same wrapper frame, which Dynamo stops
compiling past its recompile limit: a case must never pass by running
eagerly). Steps that are torch.optim.Muon's update are also compared with
torch.optim.Muon on the whole matrices.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import pytest
import torch
from torch.testing import FileCheck

import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.fx.experimental.proxy_tensor import make_fx

import laplace_passes
from laplace_passes.driver.backend import laplace_backend
from tests import muon_user_steps as steps
from tests._dist import run_ranks

STEPS = 2
# Per-rank row shards: the gathered matrices are [W*2, 6] (wide) and [W*3, 4] (tall); W of each,
# so every rank owns as many matrices as every other and the all-to-alls meet the bound.
SHARD_SHAPES = [(2, 6), (3, 4)]

ROUND_ROBIN = "Newton-Schulz already runs on its owner"
BALANCED = "rewritten, fewer bytes than the gathers but above the bound"
UNEQUAL_SHARDS = [(2, 6), (3, 4), (1, 5)]  # one of each: owners hold different shapes
ELEMENT_RANGES = "element-range shards cross matrix boundaries"
# Dynamo does not trace distribute_tensor (torch 2.13): the gather and Newton-Schulz land in different graphs.
GRAPH_BREAK = "leaves the graph (a graph output) before any Newton-Schulz reads it"

# Each names the cause it found (not a stand-in such as "reaches the graph output unsharded").
INDEX_TENSOR = "picks rows with the index tensor arange"
OTHER_RANKS_ROWS = "rows of its [2 x 12]-element result, but this process is rank"
COLUMN_SHARDS = "takes a block of dim 1, 1/2 of the columns: column shards"
BATCHED = "orthogonalises a batch of 2 matrices at once"
FEWER_MATRICES = "fewer matrices (1) than ranks (3), so 2 rank(s) own none"
UNEVEN = "rows, which do not split into 2 equal blocks (uneven shards, the last rank's shorter); pad the result to"
WHOLE_READ = "reads the whole result and its value leaves the graph, so every rank needs the whole orthogonalised"
UNEVEN_ROWS = (3, 5)  # gathered from shards padded to SHARD_SHAPES' 2 and 3 rows at W = 2


@dataclass(frozen=True)
class Rewritten:
    """Rewritten into `all_to_alls` all-to-alls, keeping the gathers the reason `kept` names (if any)."""

    all_to_alls: int
    kept: str | None = None

# Rewritten steps that are torch.optim.Muon's update (its Newton-Schulz, Nesterov momentum, "original" lr scale):
# also compared with torch.optim.Muon on the whole matrices.
ALSO_TORCH_MUON = {"dist.all_gather into a list, torch.stack, chunk"}

# (name, step function, keyword arguments, expected: None = rewritten, else a phrase of the decline reason)
CASES = {
    2: [
        ("per-matrix all_gather_tensor, chunk, torch.optim.Muon's NS", steps.per_matrix, dict(own="chunk", ns="torch"),
         None),
        ("round-robin: NS on the owner, then gather", steps.round_robin, dict(ns="kj"), ROUND_ROBIN),
        ("DTensor Shard(0), full_tensor, redistribute back", steps.dtensor_shard0, dict(ns="kj"), None),
        ("DTensor Shard(0), full_tensor, distribute_tensor back", steps.dtensor_shard0,
         dict(ns="torch", back="distribute_tensor"), GRAPH_BREAK),
        ("own rows by an index tensor", steps.index_tensor_rows, {}, INDEX_TENSOR),
        ("the next rank's rows", steps.next_rank_rows, {}, OTHER_RANKS_ROWS),
        ("column shards gathered on dim 1", steps.column_shards, {}, COLUMN_SHARDS),
        ("batched Newton-Schulz of stacked matrices", steps.batched_newton_schulz, {}, BATCHED),
        ("dist.all_gather into a list, torch.stack, chunk", steps.gather_list_stack, dict(ns="torch"), None),
        ("uneven row shards, padded to W equal blocks for the gather", steps.uneven_row_shards,
         dict(rows=UNEVEN_ROWS), UNEVEN),
        ("whole Newton-Schulz result read besides this rank's rows", steps.whole_result_also_read, {}, WHOLE_READ),
        ("1-D bias gathered beside the matrices", steps.with_gathered_bias, {},
         Rewritten(2, kept="([6] torch.float32) feeds no Newton-Schulz region: not a Muon step")),
    ],
    3: [
        ("per-matrix all_gather_tensor, split, KellerJordan's NS", steps.per_matrix, dict(own="split", ns="kj"), None),
        ("flat bucket view(W, -1), view(W, s, c)[rank], KellerJordan's NS", steps.flat_bucket, dict(ns="kj"), None),
        ("Megatron element ranges", steps.megatron_ranges, dict(shapes=((4, 6), (5, 3))), ELEMENT_RANGES),
        ("unequal matrices (a balanced plan, owner work on its rank only)", steps.per_matrix,
         dict(own="chunk", ns="kj"), BALANCED),
        ("fewer matrices than ranks", steps.per_matrix, dict(own="chunk", ns="kj"), FEWER_MATRICES),
        ("dist.all_gather into a list, torch.cat, slicing", steps.gather_list_cat, dict(ns="torch"), None),
        ("momenta and parameters updated in place", steps.in_place, {}, None),
        ("bf16 and fp32 gathers (one exchange per dtype)", steps.mixed_dtypes, {}, Rewritten(4)),
    ],
    4: [
        ("dist.all_gather_into_tensor, narrow, torch.optim.Muon's NS", steps.per_matrix_into_tensor,
         dict(own="narrow", ns="torch"), None),
        # Each matrix's block of the all-to-all chunk is strided: the user's view of it needs a contiguous copy.
        ("per-matrix flat gathers viewed [W, -1], own row of the packed result", steps.per_matrix_flat_packed, {},
         None),
        ("Newton-Schulz with other coefficients and 5 steps", steps.per_matrix,
         dict(own="chunk", ns="torch, 5 cubic steps"), None),
    ],
}
# Each case compiles once per rank, the most of the runtime: the own-row spellings and Newton-Schulz
# spellings are spread over the world sizes rather than crossed.


def _state(name: str, world_size: int, rank: int) -> list[list[torch.Tensor]]:
    """(momenta, grads, params) as this rank's shards of global tensors every rank draws alike."""
    gen = torch.Generator().manual_seed(len(name))
    if name.startswith("Megatron"):
        length = -(-(4 * 6 + 5 * 3) // world_size)  # each rank's range of the flat buffer, padded
        return [torch.randn(world_size * length, generator=gen).chunk(world_size)[rank].clone() for _ in range(3)]
    if name.startswith("round-robin"):  # full replicas: W parameters of one shape
        return [[torch.randn(6, 4, generator=gen) for _ in range(world_size)] for _ in range(3)]
    shards = UNEQUAL_SHARDS if name.startswith("unequal") else SHARD_SHAPES * world_size
    if name.startswith("fewer"):
        shards = SHARD_SHAPES[:1]
    if name.startswith("batched"):  # stacked: one shape
        shards = SHARD_SHAPES[:1] * world_size
    if name.startswith("uneven row"):
        shards = SHARD_SHAPES
    shapes = [(world_size * s, c) for s, c in shards]
    if name.startswith("DTensor"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world_size,))
        if "distribute_tensor" in name:  # declined, and each matrix costs Dynamo several graphs: one shows it
            shapes = shapes[:1]
        return [[distribute_tensor(torch.randn(shape, generator=gen), mesh, [Shard(0)]) for shape in shapes]
                for _ in range(3)]
    return [[t.chunk(world_size)[rank].clone() for t in part] for part in _whole(name, shapes, world_size, gen)]


def _whole(name: str, shapes, world_size: int, gen: torch.Generator) -> list[list[torch.Tensor]]:
    """(momenta, grads, params) whole, as every rank draws them."""
    state = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(3)]
    if name.startswith("uneven row"):  # the rows past n are the padding: zeros
        state = [[t.index_fill(0, torch.arange(n, t.size(0)), 0.0) for t, n in zip(part, UNEVEN_ROWS)]
                 for part in state]
    if name.startswith("1-D bias"):
        state = [part + [torch.randn(world_size * 3, generator=gen)] for part in state]
    return state


def _torch_muon_rows(name: str, world_size: int, rank: int) -> list[list[torch.Tensor]]:
    """This rank's rows of torch.optim.Muon's parameters after each step, from the whole state `_state` shards
    (its momenta as torch's momentum buffers, the same gradients, torch's Newton-Schulz settings)."""
    gen = torch.Generator().manual_seed(len(name))
    momenta, grads, params = _whole(name, [(world_size * s, c) for s, c in SHARD_SHAPES * world_size], world_size, gen)
    params = [torch.nn.Parameter(p) for p in params]
    opt = torch.optim.Muon(params, lr=steps.LR, weight_decay=steps.WD, momentum=steps.MU, nesterov=True,
                           ns_coefficients=steps.COEFFICIENTS, eps=steps.EPS, ns_steps=steps.NS_STEPS,
                           adjust_lr_fn="original")
    for p, m in zip(params, momenta):
        opt.state[p]["momentum_buffer"] = m.clone()
    rows = []
    for k in range(STEPS):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        rows.append([p.detach().chunk(world_size)[rank].clone() for p in params])
        grads = _scaled(grads, 0.5 + k)
    return rows


def _step_pairs(name: str, fn, kwargs, state, compiled):
    """Run STEPS steps of `compiled` and of `fn` eagerly from the same state; the states after each step."""
    step = functools.partial(fn, **kwargs)
    mine, ref = [list(map(_clone, state)) for _ in range(2)]
    out = []
    for k in range(STEPS):
        with torch.no_grad():
            mine = _advance(name, compiled, mine, k)
            ref = _advance(name, step, ref, k)
        out.append((mine, ref))
    return out


def _advance(name: str, step, state, k: int):
    momenta, grads, params = state
    if name.startswith("round-robin"):
        new_params, new_momenta = step(params, grads, momenta)
    else:
        new_momenta, new_params = step(momenta, grads, params)
    grads = _clone(grads)
    return [new_momenta, _scaled(grads, 0.5 + k), new_params]


def _clone(x):
    return [t.clone() for t in x] if isinstance(x, list) else x.clone()


def _scaled(x, s):
    return [t * s for t in x] if isinstance(x, list) else x * s


def _flat(x) -> list[torch.Tensor]:
    """Every tensor of a state, DTensors as this rank's local shard (compared without communication)."""
    from torch.distributed.tensor import DTensor

    flat = [t for part in x for t in (part if isinstance(part, list) else [part])]
    return [t.to_local() if isinstance(t, DTensor) else t for t in flat]


REPLICATED = "state every rank keeps whole (a momentum of full matrices"


def _torch_muon(rank: int, world_size: int) -> dict:
    """torch.optim.Muon's own step on gradients gathered from row shards, compiled and eager, STEPS steps."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(world_size * s, c) for s, c in SHARD_SHAPES]
    init = [torch.randn(shape, generator=gen) for shape in shapes]
    grads = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(STEPS)]
    report = laplace_passes.Report()
    backend = functools.partial(laplace_backend, options={"target": "cpu", "report": report})
    runs = {}
    for mode, step in (("eager", steps.torch_muon_step),
                       ("compiled", torch.compile(steps.torch_muon_step, backend=backend, dynamic=False))):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.Muon(params, lr=steps.LR, weight_decay=steps.WD, momentum=steps.MU)
        with torch.no_grad():
            for g in grads:
                step(opt, params, [full.chunk(world_size)[rank].clone() for full in g])
        runs[mode] = [p.detach().clone() for p in params] + [opt.state[p]["momentum_buffer"] for p in params]
        kept_grads = [p.grad.clone() for p in params]
    (record,) = [p for p in report.passes if p.name == "muon_all_to_all"]
    graph = report.graph("before", record.graph)
    placeholders = {n.name: tuple(n.meta["val"].shape) for n in graph.graph.find_nodes(op="placeholder")
                    if isinstance(n.meta.get("val"), torch.Tensor)}
    return dict(differs=[f"tensor {i}" for i, (a, b) in enumerate(zip(runs["compiled"], runs["eager"]))
                         if not torch.equal(a, b)],
                # Plain lists, not tensors: what comes back is compared across ranks, exactly.
                state=[t.tolist() for t in runs["compiled"]], state_shapes=[tuple(t.shape) for t in runs["compiled"]],
                grad_shapes=[tuple(g.shape) for g in kept_grads],
                grads_are_gathered=[torch.equal(a, b) for a, b in zip(kept_grads, grads[-1])],
                modified=[record.modified],
                declined=record.declined, placeholders=placeholders, shapes=shapes, splits=[],
                traffic=report.traffic[0] if report.traffic else None, shown=str(report))


def _body(rank: int, world_size: int):
    results = []
    if world_size == 2:
        results.append(dict(name="torch.optim.Muon", expected=REPLICATED, **_torch_muon(rank, world_size)))
    results += [_case(rank, world_size, *case) for case in CASES[world_size]]
    return results


def _case(rank: int, world_size: int, name: str, fn, kwargs, expected) -> dict:
    """One step shape, compiled and eager from the same state: what differs, and what the pass did."""
    report = laplace_passes.Report()
    backend = functools.partial(laplace_backend, options={"target": "cpu", "report": report})
    compiled = torch.compile(functools.partial(fn, **kwargs), backend=backend, dynamic=False)
    torch._dynamo.reset()  # every case compiles the same wrapper frame: past Dynamo's recompile limit it would run eagerly
    differs = []
    pairs = _step_pairs(name, fn, kwargs, _state(name, world_size, rank), compiled)
    for k, (mine, ref) in enumerate(pairs):
        differs += [f"step {k} tensor {i}" for i, (a, b) in enumerate(zip(_flat(mine), _flat(ref)))
                    if not torch.equal(a, b)]
    if name in ALSO_TORCH_MUON:
        for k, ((mine, _), torchs) in enumerate(zip(pairs, _torch_muon_rows(name, world_size, rank))):
            differs += [f"step {k} parameter {i}: torch.optim.Muon's differs" for i, (a, b) in
                        enumerate(zip(mine[2], torchs)) if not torch.equal(a, b)]
    if not report.graphs:
        differs.append("nothing compiled: the step ran eagerly")
    records = [p for p in report.passes if p.name == "muon_all_to_all"]
    traffic = report.traffic[0] if report.traffic else None
    code = report.graph("after", traffic.graph).code if traffic else ""
    splits = _all_to_all_splits(report.graph("after", traffic.graph)) if traffic else []
    return dict(name=name, expected=expected, differs=differs, splits=splits,
                modified=[r.modified for r in records], declined=[d for r in records for d in r.declined],
                traffic=traffic, code=code, shown=str(report))


def _all_to_all_splits(gm: torch.fx.GraphModule) -> list[tuple[tuple, tuple]]:
    """(the rewrite's split and group arguments, torch's own for `all_to_all_single(x, None, None, group)`)
    for every all-to-all of `gm`: torch's functional wrapper fills equal splits in itself."""
    pairs = []
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_to_all_single.default):
        sent = node.args[0].meta["val"]
        ref = make_fx(lambda x: fc.all_to_all_single(x, None, None, dist.group.WORLD), tracing_mode="fake")(
            torch.empty(sent.shape, dtype=sent.dtype))
        (torch_node,) = ref.graph.find_nodes(op="call_function",
                                             target=torch.ops._c10d_functional.all_to_all_single.default)
        pairs.append((tuple(node.args[1:]), tuple(torch_node.args[1:])))
    return pairs


@pytest.fixture(scope="module", params=[2, 3, 4])
def ranks(request):
    world_size = request.param
    return world_size, run_ranks(world_size, _body, timeout=300)


def test_user_steps_stay_bitwise_equal_to_eager(ranks):
    world_size, results = ranks
    failures = [f"rank {r}: {case['name']}: {d}" for r, cases in enumerate(results) for case in cases
                for d in case["differs"]]
    assert not failures, "\n".join(failures)


def test_gather_before_newton_schulz_becomes_two_all_to_alls_at_the_bound(ranks):
    world_size, results = ranks
    for rank, cases in enumerate(results):
        for case in cases:
            if isinstance(case["expected"], Rewritten):
                continue
            if case["expected"] == BALANCED:
                assert case["modified"] == [True], (rank, case["name"], case["declined"])
                assert case["traffic"].received_after < case["traffic"].received_before
                FileCheck().check_count("all_to_all_single.default(", 2, exactly=True).run(case["code"])
                continue
            if case["expected"] is not None:
                continue
            assert case["modified"] == [True], (rank, case["name"], case["declined"])
            FileCheck().check_count("_c10d_functional.all_to_all_single.default(", 2, exactly=True).run(case["code"])
            FileCheck().check_not("all_gather_into_tensor").run(case["code"])
            t = case["traffic"]
            # The bound, from the matrices the test gathers: W of each shape, bf16.
            gathered = world_size * sum(world_size * s * c for s, c in SHARD_SHAPES) * 2
            assert t.matrix_bytes == gathered
            assert t.received_before == (world_size - 1) * gathered // world_size
            bound = 2 * (world_size - 1) * gathered // world_size**2
            assert bound <= t.received_after <= 1.05 * bound, (case["name"], t.received_after, bound)
            assert t.received_after <= t.received_before
            if t.received_after == t.received_before:  # W = 2: applied for the Newton-Schulz work it removes
                assert t.ns_flops_after * world_size == t.ns_flops_before
                assert "applied because Newton-Schulz FLOPs per rank fall" in case["shown"]


def test_other_shapes_are_declined_with_what_is_there(ranks):
    world_size, results = ranks
    for rank, cases in enumerate(results):
        for case in cases:
            if not isinstance(case["expected"], str) or case["expected"] == BALANCED:
                continue
            assert case["modified"] and not any(case["modified"]), (rank, case["name"])
            assert any(case["expected"] in reason for reason in case["declined"]), (case["name"], case["declined"])
            assert case["expected"] in case["shown"]  # what users read, not only the JSON
            assert case["traffic"] is None


def test_rewritten_beside_the_gathers_it_keeps(ranks):
    """Gathers of two dtypes: one exchange each; a 1-D bias's gather: kept (no Newton-Schulz reads it), the
    matrices' gathers rewritten around it."""
    world_size, results = ranks
    for rank, cases in enumerate(results):
        for case in cases:
            expected = case["expected"]
            if not isinstance(expected, Rewritten):
                continue
            assert case["modified"] == [True], (rank, case["name"], case["declined"])
            FileCheck().check_count("all_to_all_single.default(", expected.all_to_alls, exactly=True).run(case["code"])
            if expected.kept is None:
                assert case["declined"] == [], (case["name"], case["declined"])
                FileCheck().check_not("all_gather_into_tensor").run(case["code"])
                continue
            assert len(case["declined"]) == 1 and expected.kept in case["declined"][0], case["declined"]
            assert expected.kept in case["shown"]
            FileCheck().check_count("all_gather_into_tensor.default(", 1, exactly=True).run(case["code"])


def test_all_to_alls_carry_the_splits_torch_fills_in_for_none(ranks):
    """`all_to_all_single(x, None, None, group)` traces to explicit equal split lists (the ATen op takes
    `SymInt[]`, never None): the rewrite's all-to-alls carry exactly those lists and that group."""
    world_size, results = ranks
    pairs = [pair for cases in results for case in cases for pair in case["splits"]]
    assert pairs, "no rewritten case at this world size"
    for ours, torchs in pairs:
        assert ours == torchs
        assert list(ours[0]) == list(ours[1]) and len(ours[0]) == world_size


def test_torch_optim_muon_step_is_declined_for_what_is_really_there(ranks):
    """torch.optim.Muon on a gathered gradient: every rank keeps the whole gradient (p.grad), a momentum of
    whole matrices and whole parameters, so the gathered value is needed whole everywhere; the reason says
    so and names a graph input of a whole matrix's shape (the momentum) as what the gather is combined with."""
    world_size, results = ranks
    if world_size != 2:
        pytest.skip("run at W = 2 only")
    cases = [next(c for c in cases if c["name"] == "torch.optim.Muon") for cases in results]
    for case in cases:
        shapes = case["shapes"]
        assert case["grad_shapes"] == shapes and all(case["grads_are_gathered"])
        assert case["state_shapes"] == shapes * 2  # parameters, then momenta: whole
        named = re.findall(r"depends on (\w+) \(placeholder\)", " ".join(case["declined"]))
        assert len(named) == len(shapes), case["declined"]
        assert sorted(case["placeholders"][n] for n in named) == sorted(shapes)
    assert cases[0]["state"] == cases[1]["state"]  # replicated: the same on both ranks
