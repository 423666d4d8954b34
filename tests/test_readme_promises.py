"""README promises checked against formulas written here, each at the boundary where a bug would show.

Each test names the README promise it checks. The traffic, budget, gate,
saved-bytes and chunk_size tests were each seen to fail with a one-line bug
planted in the code they check (tests/README.md, "Can the test fail?").
"""

import functools
import re
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import laplace_passes
from laplace_passes.collectives.traffic import collective_bytes, per_rank_totals
from laplace_passes.fx import RetileGLA
from laplace_passes.infra.pass_base import run_pass
from laplace_passes.infra.targets import TRN2
from laplace_passes.unroll import FitGraphToBudget, SizeModel
from tests.gla_cases import make_inputs, relative_rmse

c10d = torch.ops._c10d_functional


# -- Muon traffic: "bytes sent and received per rank for every collective" ------------------------


def _collectives_graph(W: int, numel: int, src: int):
    """One of each collective the traffic model counts, on a bf16 buffer of `numel` elements."""

    def f(x):
        return (
            c10d.broadcast(x, src, "0"),
            c10d.all_gather_into_tensor(x, W, "0"),
            c10d.all_to_all_single(x, [numel // W] * W, [numel // W] * W, "0"),
            c10d.reduce_scatter_tensor(x, "sum", W, "0"),
            c10d.all_reduce(x, "sum", "0"),
        )

    return make_fx(f, tracing_mode="fake")(torch.zeros(numel, dtype=torch.bfloat16))


@pytest.mark.parametrize("W,src", [(4, 1), (3, 0)])
def test_traffic_per_rank_follows_the_documented_formulas(W, src):
    """traffic.py's table: what each rank sends to and receives from *other* ranks."""
    numel = 12 * W
    size = numel * 2  # bf16
    counted = {c.op: c for c in collective_bytes(_collectives_graph(W, numel, src), W)}
    assert set(counted) == {"broadcast", "all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor",
                            "all_reduce"}
    broadcast = counted["broadcast"]
    assert broadcast.sent == tuple((W - 1) * size if r == src else 0 for r in range(W))
    assert broadcast.received == tuple(0 if r == src else size for r in range(W))
    symmetric = {
        "all_gather_into_tensor": (W - 1) * size,
        "all_to_all_single": size - size // W,
        "reduce_scatter_tensor": (W - 1) * size // W,
        "all_reduce": 2 * (W - 1) * size // W,
    }
    for op, expected in symmetric.items():
        assert counted[op].sent == counted[op].received == (expected,) * W, op
    # The worst rank: the source sends the broadcast, another rank receives it.
    sent, received = per_rank_totals(list(counted.values()), W)
    assert sent == (W - 1) * size + sum(symmetric.values())
    assert received == size + sum(symmetric.values())


def test_report_shows_bytes_sent_and_received_per_collective():
    W, numel = 4, 1000
    collectives = collective_bytes(_collectives_graph(W, numel, src=0), W)
    record = laplace_passes.infra.report.TrafficRecord(
        graph="step", world_size=W, ownership="uniform", matrices=1, padding_matrices=0, matrix_bytes=2 * numel,
        lower_bound_bytes=0, before=[c.as_dict() for c in collectives], after=[], sent_before=0,
        received_before=0, sent_after=0, received_after=0, received_ratio=1.0, ns_flops_before=0, ns_flops_after=0,
    )
    report = laplace_passes.Report()
    report.new_graph("inference", make_fx(lambda x: x + 1)(torch.zeros(1))).traffic = record
    rows = [line.split() for line in str(report).splitlines()]
    # graph, stage, node, op, sent, received: the broadcast's source sends 3 x 2 kB, a receiver gets 2 kB.
    broadcast_row = next(r for r in rows if "broadcast" in r)
    assert broadcast_row[-4:] == ["6", "kB", "2", "kB"]


# -- the size budget: "a graph whose estimated instructions pass the target's budget is cut" -----


def test_a_graph_exactly_at_the_budget_is_not_cut():
    gm = make_fx(lambda a, b: (torch.mm(a, b).sin() * 2).sum())(torch.randn(256, 384), torch.randn(384, 1024))
    model = SizeModel.for_target(TRN2)
    instructions = model.measure(gm).instructions
    at_budget = run_pass(FitGraphToBudget(instructions, model, "forward"), gm)
    assert not at_budget.modified and at_budget.size.partitions == []
    assert at_budget.summary.endswith(": fits")
    over_budget = run_pass(FitGraphToBudget(instructions - 1, model, "forward"), gm)
    assert over_budget.modified and len(over_budget.size.partitions) == 2


# -- gate checks: "Positive or NaN gates raise ValueError (gk must be <= 0)" ----------------------


def _gla_output(q, k, v, gk):
    return laplace_passes.gla(q, k, v, gk)[0]


@pytest.mark.parametrize("positive", [2.0**-20, 0.0625, 0.375])  # exact in fp32: the message names them
def test_any_positive_gate_is_refused_eagerly_and_compiled(positive):
    q, k, v, gk, _ = make_inputs(1, 20, 1, 4, 4, initial_state=False)
    gk = gk.clone()
    gk[0, 7, 0, 2] = positive
    with pytest.raises(ValueError, match=r"gk must be <= 0 everywhere .*found " + re.escape(str(positive))):
        laplace_passes.gla(q, k, v, gk)
    compiled = laplace_passes.compile(_gla_output, target="cpu")
    with pytest.raises(ValueError, match="gk must be <= 0 everywhere"):
        compiled(q, k, v, gk)


def test_a_gate_of_exactly_zero_is_accepted():
    q, k, v, gk, _ = make_inputs(1, 20, 1, 4, 4, initial_state=False)
    gk = gk.clone()
    gk[:, 5:9] = 0.0  # decay exp(0) = 1: the state is carried unchanged, a valid gate
    o, _ = laplace_passes.gla(q, k, v, gk)
    assert torch.isfinite(o).all()


# -- the re-tiling pass: saved bytes, the chunk_size option, declined sites -----------------------


def _gla_with_state(q, k, v, gk, h0):
    o, state = laplace_passes.gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    return o.sum() + state.sum()


@pytest.mark.parametrize("T", [100, 200])
@pytest.mark.parametrize("target", ["trn2", "cpu"])
def test_saved_bytes_per_site_are_the_inputs_and_on_cpu_the_residuals(T, target):
    """"saves q, k, v, gk and the initial state, O(T x (K+V)) bytes; [with save_residuals] its two
    residuals, the state entering each chunk and tril(A) ... The report shows the saved bytes per site"."""
    B, H, K, V = 2, 2, 8, 12
    inputs = [x.requires_grad_() for x in make_inputs(B, T, H, K, V)]
    report = laplace_passes.inspect(_gla_with_state, *inputs, target=target)
    (site,) = report.sites
    expected = 4 * (B * T * H * (3 * K + V) + B * H * K * V)  # fp32 q, k, gk [B,T,H,K], v [B,T,H,V], h0
    if target == "cpu":  # chunks of 64: fp32 states [B,H,N,K,V] and tril(A) [B,H,N,64,64]
        N = -(-T // 64)
        expected += 4 * B * H * N * (K * V + 64 * 64)
    assert site.saved_bytes == expected
    assert f"{expected / 1e3:.3g} kB" in str(report)  # the report shows 3 significant digits


def test_a_site_without_a_gradient_saves_nothing_for_a_backward():
    """Under no_grad (an evaluation) the chunked site keeps nothing: its report had shown the training figure."""
    inputs = make_inputs(2, 100, 2, 8, 12)
    with torch.no_grad():
        report = laplace_passes.inspect(_gla_with_state, *inputs, target="cpu")
    (site,) = report.sites
    assert site.plan["n_chunks"] == 2 and site.saved_bytes == 0
    assert [g.kind for g in report.graphs] == ["dynamo", "inference"]


def test_the_chunk_size_option_sets_every_site_plan():
    q, k, v, gk, _ = make_inputs(1, 100, 1, 8, 8, initial_state=False)
    compiled = laplace_passes.compile(_gla_output, target="trn2", chunk_size=32)
    assert relative_rmse(compiled(q, k, v, gk), laplace_passes.gla(q, k, v, gk)[0]) < 1e-5
    report = compiled.laplace_report
    assert [s.plan for s in report.sites] == [{"T": 100, "chunk_size": 32, "n_chunks": 4, "padding": 28}]
    assert "re-tiled at chunk 32" in str(report)


def test_a_site_whose_inputs_the_checks_reject_is_declined_with_the_reason():
    """"A site is declined, with the reason in the report, when the op's argument checks reject its inputs"."""
    q, k, v, gk, _ = make_inputs(1, 16, 1, 4, 4, initial_state=False)
    gm = make_fx(functools.partial(_gla_output), tracing_mode="fake")(q, k, v, gk)
    site_node = next(n for n in gm.graph.nodes if n.target == torch.ops.laplace.gla.default)
    fake_v = site_node.args[2].meta["val"]
    site_node.args[2].meta["val"] = fake_v.new_empty(1, 15, 1, 4)  # v no longer matches q's [B, T, H]
    outcome = run_pass(RetileGLA(chunk_size=8, sub_chunk_size=4), gm)
    (site,) = outcome.sites
    assert site.status == "declined" and not outcome.modified
    assert site.reason.startswith("inputs rejected by chunked_gla: v must have shape [B,T,H,V] = [1,16,1,V]")
    FileCheck().check("laplace.gla.default").check_not("chunked_gla").run(gm.code)


# -- the API table: inspect(..., report=r) --------------------------------------------------------


def test_inspect_fills_the_report_it_is_given():
    given = laplace_passes.Report()
    inputs = [x.requires_grad_() for x in make_inputs(1, 100, 1, 8, 8)]  # T = 100: one chunk of 128
    assert laplace_passes.inspect(_gla_with_state, *inputs, target="trn2", report=given) is given
    assert [s.plan["n_chunks"] for s in given.sites] == [1]
    unrolled = [p.summary for p in given.passes if p.name == "unroll_loops" and p.modified]
    assert unrolled and all(s.startswith("unrolled 1 loop (1 x ") and s.endswith(", 1 trip)") for s in unrolled)


# -- inner="iree": a process exits quietly ---------------------------------------------------------

IREE_RUN = """
import torch, laplace_passes
compiled = laplace_passes.compile(lambda x: (x * 2).sin(), target="cpu", inner="iree")
torch.testing.assert_close(compiled(torch.ones(4)), torch.full((4,), 2.0).sin())
"""


def test_a_process_that_ran_iree_exits_without_leak_reports():
    """Dynamo's caches keep IREE's nanobind objects to the end; they are released before shutdown."""
    pytest.importorskip("iree.runtime")
    done = subprocess.run([sys.executable, "-c", IREE_RUN], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "nanobind: leaked" not in done.stderr, done.stderr[-2000:]


# -- model_zoo.mqar: "generates multi-query associative recall data" ------------------------------


def test_mqar_asks_each_listed_key_once_for_its_value():
    from model_zoo.mqar import IGNORE, MQARTask, recall_accuracy

    task = MQARTask(vocab_size=128, num_pairs=8, seq_len=64)
    ids, targets = task.batch(4, torch.Generator().manual_seed(0))
    for seq, target in zip(ids.tolist(), targets.tolist()):
        listed = dict(zip(seq[0:16:2], seq[1:16:2]))  # keys 1..63, values 64..127, as the docstring says
        assert len(listed) == 8 and all(1 <= key <= 63 and 64 <= value <= 127 for key, value in listed.items())
        asked = [(pos, seq[pos]) for pos, t in enumerate(target) if t != IGNORE]
        assert sorted(key for _, key in asked) == sorted(listed)
        assert all(target[pos] == listed[key] and seq[pos + 1] == 0 for pos, key in asked)
        # No value after the listing: an answer in the input would allow answering by elimination.
        assert all(token < 64 for token in seq[16:])
        assert seq[32:] == [0] * 32  # padding
    assert task.chance == 1 / 64 and task.listed_chance == 1 / 8
    # recall_accuracy counts the asked positions only: right everywhere there, wrong everywhere else.
    logits = torch.nn.functional.one_hot(targets.clamp_min(0), 128).float()
    logits[targets == IGNORE] = torch.nn.functional.one_hot(torch.tensor(5), 128).float()
    assert recall_accuracy(logits, targets) == 1.0
    logits[:, :, 64:] = logits[:, :, 64:].roll(1, -1)  # every recalled value off by one
    assert recall_accuracy(logits, targets) == 0.0
