"""Graph size and partitioning: over-budget graphs are cut into partitions that fit, same results.

End to end through the backend (the tiny model's backward under a forced
budget; the small model under trn2's default), and at the pass level on
graphs built here, against brute force over every cut and the uncut graph.
"""

import math
import operator
import random

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import laplace_passes
import model_zoo
from laplace_passes.driver.compile_fx import fresh_code
from laplace_passes.infra.fx_helpers import value_bytes
from laplace_passes.infra.targets import TRN2
from laplace_passes.unroll import FitGraphToBudget, SizeModel, partition, partition_calls, plan_partitions, split_graph
from tests.lm_cases import capture_inner, loss_and_grads

MODEL = SizeModel.for_target(TRN2)
TILE = MODEL.tile_elements  # elements one instruction covers: a 1-instruction elementwise op


def compile_tiny(model, ids, **options):
    capture, seen = capture_inner()
    compiled = laplace_passes.compile(fresh_code(model), target="trn2", inner=capture, **options)
    return loss_and_grads(model, ids, compiled), compiled.laplace_report, seen


def test_tiny_backward_is_cut_under_a_small_budget_with_unchanged_results():
    torch.manual_seed(0)
    model = model_zoo.build("tiny")
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    eager = loss_and_grads(model, ids, model)
    (logits, grads), whole_report, _ = compile_tiny(model, ids)
    whole = whole_report.graph_record("backward_0").size
    assert whole.partitions == [] and whole.instructions < TRN2.max_graph_instructions

    budget = whole.instructions // 3
    (cut_logits, cut_grads), report, seen = compile_tiny(model, ids, max_graph_instructions=budget)
    size = report.graph_record("backward_0").size
    assert len(size.partitions) >= 2 and size.budget == budget
    assert all(p.instructions <= budget for p in size.partitions)
    assert sum(p.instructions for p in size.partitions) == size.instructions == whole.instructions
    assert len(size.cut_bytes) == len(size.partitions) - 1 and all(b > 0 for b in size.cut_bytes)

    # Same ATen ops in the same order: bit-identical to the uncut graph, and to eager within rounding.
    assert torch.equal(cut_logits, logits)
    assert all(torch.equal(cut_grads[name], grads[name]) for name in grads)
    torch.testing.assert_close(cut_logits, eager[0], rtol=1e-4, atol=1e-5)

    # The inner compiler got each partition on its own, each within the budget and loop-free.
    backward = report.graph("after", "backward_0")
    calls = partition_calls(backward)
    assert len(calls) == len(size.partitions)
    parts = {id(backward.get_submodule(c.target)) for c in calls}
    handed = [gm for gm in seen if id(gm) in parts]
    assert len(handed) == len(size.partitions)
    for gm in handed:
        assert MODEL.measure(gm).instructions <= budget
        FileCheck().check_not("chunked_gla").check_not("higher_order.scan").run(gm.code)
    text = str(report)
    assert "partitions:" in text and "bytes across cuts" in text


def test_small_model_fits_the_default_budget():
    model = model_zoo.build("small", device="meta")
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    report = laplace_passes.inspect(model, ids, target="trn2")
    for name in ("forward_0", "backward_0"):
        size = report.graph_record(name).size
        assert size.budget == TRN2.max_graph_instructions == 5_000_000
        assert 0 < size.instructions <= size.budget
        assert size.partitions == [] and size.note is None
        assert not partition_calls(report.graph("after", name))
    data = report.to_dict()["graphs"]
    assert data[2]["size"]["saved_for_backward_bytes"] > 0


def test_bytes_saved_for_backward_are_the_activations_only():
    """Not the gradients, not the inputs, not views of them (the weight's transpose AOT keeps)."""
    x, w = torch.randn(64, 32), torch.randn(48, 32, requires_grad=True)
    compiled = laplace_passes.compile(lambda x, w: (x @ w.t()).sin().sum(), target="trn2")
    compiled(x, w).backward()
    saved = compiled.laplace_report.graph_record("backward_0").size.saved_for_backward_bytes
    assert saved == 64 * 48 * 4  # x @ w.t(), which sin's gradient reads


# -- the size model ------------------------------------------------------------------------


def test_size_model_follows_its_documented_formula():
    def f(a, b, x):
        y = torch.mm(a, b)  # [256, 384] @ [384, 1024]
        z = x.view(-1) * 2  # elementwise over 3 tiles
        return y, z.sum()  # a reduction reads 3 tiles

    gm = make_fx(f, tracing_mode="fake")(torch.randn(256, 384), torch.randn(384, 1024), torch.randn(3, TILE))
    cost = {n.target: MODEL.node_instructions(n) for n in gm.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert cost[aten.mm.default] == math.ceil(384 / 128) * math.ceil(256 / 128) * math.ceil(1024 / 512)
    assert cost[aten.view.default] == 0
    assert cost[aten.mul.Tensor] == 3 and cost[aten.sum.default] == 3
    assert MODEL.measure(gm).instructions == sum(cost.values())


def test_size_model_counts_both_branches_of_a_cond():
    def f(pred, a, b):
        return torch.cond(pred, lambda a, b: (a @ b).sin(), lambda a, b: a.cos() @ b, (a, b))

    gm = make_fx(f, tracing_mode="fake")(torch.tensor(True), torch.randn(256, 384), torch.randn(384, 1024))
    (cond,) = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.cond]
    matmul = math.ceil(384 / 128) * math.ceil(256 / 128) * math.ceil(1024 / 512)
    sin = math.ceil(256 * 1024 / TILE)
    cos = math.ceil(256 * 384 / TILE)
    assert MODEL.node_instructions(cond) == (matmul + sin) + (cos + matmul)


# -- the partitioner on graphs built here ----------------------------------------------------


def elementwise_chain(x):
    """Ten ops of one instruction each; `small` values are cheap to pass across a cut."""
    a = x * 2
    b = a + 1
    small = b.mean(-1, keepdim=True)
    c = (small * x).exp()
    d = c - 1
    e = d.sin()
    small_2 = e.mean(-1, keepdim=True)
    f = small_2 + x
    g = f.relu()
    return g.cos()


def traced(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs)


def crossing_bytes(order, position):
    """Brute force: bytes of values made before `position` and read at or after it."""
    later = set(order[position:])
    return sum(value_bytes(n) for n in order[:position] if any(u in later for u in n.users))


def test_fewest_partitions_and_the_cheapest_cut():
    x = torch.randn(8, TILE // 8)
    gm = traced(elementwise_chain, x)
    cost = MODEL.measure(gm).per_node
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    total = sum(cost[n] for n in order)
    budget = math.ceil(total / 2) + 2
    plan = plan_partitions(gm, cost, budget, refine=False)
    assert plan.count == 2 == math.ceil(total / budget)

    def fits(p):
        return sum(cost[n] for n in order[:p]) <= budget and sum(cost[n] for n in order[p:]) <= budget

    best = min(crossing_bytes(order, p) for p in range(1, len(order)) if fits(p))
    assert plan.cut_bytes == [best]
    assert best < value_bytes(order[0])  # a cheap cut exists: it passes a reduced value


def independent_branch(x, y):
    """`big` reads only an input and is read last: computed first, it would cross any cut."""
    big = torch.cat([y, y, y, y])  # 4 tiles
    a = x.sin()
    b = a.cos()
    c = b.exp()
    d = c.tanh()
    e = d.sigmoid()
    return e.sum() + big.sum()


def interleaved_chains(x, y):
    """Two independent chains written step by step in turn: any cut in this order crosses both."""
    a, b = x, y
    for _ in range(6):
        a = a.sin()
        b = b.cos()
    return a.sum() + b.sum()


@pytest.mark.parametrize("fn", [independent_branch, interleaved_chains])
def test_cuts_off_the_graph_order_carry_less(fn):
    """The planner also cuts "as late as possible" and depth-first orders of the same graph."""
    x, y = torch.randn(TILE), torch.randn(TILE)
    gm = traced(fn, x, y)
    cost = MODEL.measure(gm).per_node
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    budget = math.ceil(sum(cost.values()) / 2) + 1
    plan = plan_partitions(gm, cost, budget, refine=False)
    assert plan.count == 2 and all(i <= budget for i in plan.instructions)

    def fits(p):
        return sum(cost[n] for n in order[:p]) <= budget and sum(cost[n] for n in order[p:]) <= budget

    in_graph_order = min(crossing_bytes(order, p) for p in range(1, len(order)) if fits(p))
    assert plan.cut_bytes[0] < TILE * 4 <= in_graph_order  # a scalar crosses, not a tensor
    _assert_convex_and_ordered(gm, plan)
    torch.testing.assert_close(split_graph(gm, plan)(x, y), gm(x, y), rtol=0, atol=0)


def broadcast_before_the_cut(x):
    s = x.sin().sum(-1, keepdim=True)
    big = s.expand(x.shape) * 2.0  # a reduced value broadcast back: cheap to remake, dear to pass
    y = x.cos().exp()
    return (big + y).sum()


def test_min_cut_refinement_passes_the_reduced_value_instead_of_the_broadcast():
    x = torch.randn(4, TILE // 4)
    gm = traced(broadcast_before_the_cut, x)
    cost = MODEL.measure(gm).per_node
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    mul = next(n for n in order if n.target == torch.ops.aten.mul.Tensor)
    cut = order.index(mul) + 1  # the graph order's cut right after the broadcast
    part_of = {n: int(i >= cut) for i, n in enumerate(order)}
    budget = max(sum(cost[n] for n in order[:cut]), sum(cost[n] for n in order[cut:])) + 1
    assert crossing_bytes(order, cut) == value_bytes(mul)

    partition._refine_boundary(order, part_of, cost, budget, 0)
    refined = partition._summarise(order, part_of, cost, 2)
    reduced = next(n for n in order if n.target == torch.ops.aten.sum.dim_IntList)
    assert part_of[mul] == 1 and refined.cut_bytes == [value_bytes(reduced)]  # the [4, 1] sum, not [4, C]
    assert all(i <= budget for i in refined.instructions)
    _assert_convex_and_ordered(gm, refined)
    torch.testing.assert_close(split_graph(gm, refined)(x), gm(x), rtol=0, atol=0)


def random_graph(seed):
    """Elementwise ops, reductions broadcast back, concatenations, wired at random."""
    rng = random.Random(seed)

    def f(x):
        values = [x]
        for _ in range(14):
            a, b = rng.choice(values), rng.choice(values)
            op = rng.choice(["add", "reduce", "cat", "unary"])
            if op == "add" and a.shape == b.shape:
                values.append(a + b)
            elif op == "reduce":
                values.append(a.sum(-1, keepdim=True).expand(a.shape) * 1.5)
            elif op == "cat" and a.numel() <= 2 * TILE:
                values.append(torch.cat([a, a]))
            else:
                values.append(a.cos())
        return sum(v.sum() for v in values[-4:])

    return f


@pytest.mark.parametrize("seed", range(8))
def test_refinement_never_costs_bytes_budget_or_order(seed):
    x = torch.randn(TILE)
    gm = traced(random_graph(seed), x)
    cost = MODEL.measure(gm).per_node
    total = sum(cost.values())
    for budget in range(max(cost.values()), total, max(1, total // 4)):
        plain = plan_partitions(gm, cost, budget, refine=False)
        refined = plan_partitions(gm, cost, budget, refine=True)
        assert refined.count == plain.count
        assert sum(refined.cut_bytes) <= sum(plain.cut_bytes)
        assert all(i <= budget for i in refined.instructions)
        _assert_convex_and_ordered(gm, refined)
        torch.testing.assert_close(split_graph(gm, refined)(x), gm(x), rtol=0, atol=0)


def _assert_convex_and_ordered(gm, plan):
    for node, part in plan.part_of.items():
        for producer in node.all_input_nodes:
            assert plan.part_of.get(producer, 0) <= part, f"{node} reads {producer} from a later partition"


def test_tuple_results_stay_with_their_getitems():
    def f(x):
        y = x.exp()
        values, indices = torch.max(y, dim=-1)
        return (values * 2).sum() + indices.float().sum(), y.cos()

    gm = traced(f, torch.randn(4, TILE))
    cost = MODEL.measure(gm).per_node
    (tuple_node,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.max.dim]
    for budget in range(max(cost.values()), sum(cost.values())):
        plan = plan_partitions(gm, cost, budget)
        readers = [u for u in tuple_node.users if u.target is operator.getitem]
        assert {plan.part_of[u] for u in readers} == {plan.part_of[tuple_node]}


def test_split_graph_runs_the_partitions_in_order_with_identical_results():
    x = torch.randn(8, TILE // 8)
    gm = traced(elementwise_chain, x)
    cost = MODEL.measure(gm)
    outcome = FitGraphToBudget(cost.instructions // 4 + 1, MODEL, "backward")(gm)
    driver = outcome.graph_module
    driver.graph.lint()
    assert outcome.modified and len(partition_calls(driver)) == len(outcome.size.partitions) >= 4
    assert torch.equal(driver(x)[0], gm(x)[0])
    FileCheck().check("laplace_partition_0").check("laplace_partition_1").run(driver.code)


def test_a_node_over_the_budget_alone_is_declined_with_the_reason():
    gm = traced(lambda a, b: torch.mm(a, b).relu(), torch.randn(1024, 1024), torch.randn(1024, 1024))
    outcome = FitGraphToBudget(10, MODEL, "forward")(gm)
    assert not outcome.modified and outcome.graph_module is gm
    (reason,) = outcome.declined
    assert "node mm" in reason and "over the budget of 10" in reason and "no cut can make it fit" in reason
    assert outcome.size.note == f"over budget, not cut: {reason}"


@pytest.mark.parametrize("bad", [0, -5, 2.5, "many", True])
def test_budget_option_is_validated(bad):
    with pytest.raises(ValueError, match=r"max_graph_instructions must be a positive int or None, got"):
        laplace_passes.compile(lambda x: x, max_graph_instructions=bad)


def test_no_budget_means_no_partitions():
    model = model_zoo.build("tiny", device="meta")
    ids = torch.zeros(1, 256, dtype=torch.long, device="meta")
    report = laplace_passes.inspect(model, ids, target="trn2", max_graph_instructions=None)
    size = report.graph_record("backward_0").size
    assert size.budget is None and size.partitions == [] and size.instructions > 0


def first_and_last_read_a_view_of_the_input(big, x):
    """`big` is read, through a view, at the start and at the end: like a backward's logits gradient."""
    flat = big.view(-1)
    y = x * flat[: x.numel()].view_as(x)
    for _ in range(6):
        y = y.exp().cos()
    return y * flat[-x.numel():].view_as(x), big.t()


def test_views_of_graph_inputs_do_not_cross_cuts():
    big, x = torch.randn(64, TILE), torch.randn(4, TILE // 4)
    gm = traced(first_and_last_read_a_view_of_the_input, big, x)
    cost = MODEL.measure(gm).per_node
    plan = plan_partitions(gm, cost, sum(cost.values()) // 3 + 1)
    assert plan.count >= 3
    # Only the running value y crosses each cut, never the 32 MB input behind the views.
    assert plan.cut_bytes == [x.numel() * 4] * (plan.count - 1)
    driver = split_graph(gm, plan)
    driver.graph.lint()
    # The first and the last partition read the input itself and make their own views of it.
    calls = partition_calls(driver)
    for call in (calls[0], calls[-1]):
        assert "big_1" in [a.name for a in call.args] and "aten.view.default(big_1" in driver.get_submodule(call.target).code
    assert all("big_1" not in str(call.args) for call in calls[1:-1])
    for got, expected in zip(driver(big, x), gm(big, x), strict=True):
        assert torch.equal(got, expected)


def test_inductor_compiles_each_partition_with_unchanged_results():
    """Inductor sees each partition as a graph of its own: no output strides or donated inputs of the whole graph."""

    def f(x, w):
        a = (x @ w).sin()
        b = a * 2 + x.cos()
        return (b / b.exp().sum(-1, keepdim=True)).relu() @ w.t()

    x = torch.randn(256, 512)

    def run(fn):
        w = torch.randn(512, 512, generator=torch.Generator().manual_seed(0)).requires_grad_()
        out = fn(x, w)
        (grad,) = torch.autograd.grad(out.sum(), w)
        return out.detach(), grad

    compiled = laplace_passes.compile(f, target="trn2", inner="inductor", max_graph_instructions=12)
    (out, grad), (expected_out, expected_grad) = run(compiled), run(f)
    sizes = {g.name: len(g.size.partitions) for g in compiled.laplace_report.graphs if g.size is not None}
    assert sizes["forward_0"] >= 2 and sizes["backward_0"] >= 2, sizes
    torch.testing.assert_close(out, expected_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-4)


def test_as_late_as_possible_moves_work_to_just_before_its_reader():
    def f(x, w):
        grad_w = w.t() @ w  # read only by the output: goes last
        y = x.exp()
        z = y.cos() + w.sum()  # w.sum() placed just before the add
        return z.sin(), grad_w

    gm = traced(f, torch.randn(4, 4), torch.randn(4, 4))
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    late = partition._as_late_as_possible(order)
    names = [n.name for n in late]
    assert sorted(names) == sorted(n.name for n in order)
    assert all(names.index(a.name) < names.index(n.name) for n in late for a in n.all_input_nodes if a in order)
    assert names[-2:] == ["mm", "sin"]  # what only the output reads, last
    assert names.index("t") > names.index("cos")  # the weight gradient's input, after the other chain's work
    assert late != order
