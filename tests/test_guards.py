"""The passes add no guards to a dynamic graph (NOTE [passes add no guards] in laplace_passes/infra/guards.py).

Each test compiles a small function whose batch is marked dynamic with a backend that runs the code under
test on Dynamo's graph while its ShapeEnv is live, then counts the ShapeEnv's guards: what a pass decided
must hold for every batch, so a comparison that needs a guard must be refused, never answered.
"""

import pytest
import torch
import torch._dynamo
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError, guard_or_false

import laplace_passes
import model_zoo
from laplace_passes.infra.guards import (
    WouldSpecialise,
    refusing_new_guards,
    same_shape,
    same_size,
    shape_env_of,
)
from laplace_passes.infra.inductor_passes import InductorPass
from laplace_passes.infra.pass_base import GraphPass, PassResult, run_passes
from laplace_passes.infra.report import Report

WIDTH = 8


def batch_of(x):
    return torch.relu(x) * 2


def tensor_input(gm):
    """The fake tensor of the graph's tensor input (Dynamo also passes the batch's symbol as an input; a
    post-grad graph keeps it under "val")."""
    values = [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")]
    (x,) = [v for v in values if isinstance(v, torch.Tensor)]
    return x


def compile_with(inside):
    """Compile `batch_of` on a [64, WIDTH] input, the batch marked dynamic, calling `inside(gm, env, x)` on
    Dynamo's graph (x: the placeholder's fake tensor); returns what `inside` returned and the guards it added."""
    seen = {}

    def backend(gm, example_inputs):
        env = shape_env_of(gm)
        before = len(env.guards)
        x = tensor_input(gm)
        seen["result"] = inside(gm, env, x)
        seen["added"] = env.guards[before:]
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(64, WIDTH)
    torch._dynamo.mark_dynamic(x, 0)
    out = torch.compile(batch_of, backend=backend)(x)
    torch.testing.assert_close(out, batch_of(x))
    return seen["result"], seen["added"]


def test_sizes_compare_without_guards():
    def inside(gm, env, x):
        b, width = x.shape
        return (same_size(b, 64), same_size(b, b), same_size(width, WIDTH), same_shape(x.shape, (64, WIDTH)),
                same_shape(x.shape, x.shape), same_shape(x.shape, None))

    result, added = compile_with(inside)
    assert result == (False, True, True, False, True, False)
    assert added == []


def test_a_plain_comparison_specialises_the_batch():
    """Why the helpers exist: `==` on a symbolic size answers with this call's size and records a guard,
    and a batch marked dynamic then fails the compile."""
    def inside(gm, env, x):
        return bool(x.shape[0] == 64)

    with pytest.raises(ConstraintViolationError, match="specialized it to be a constant"):
        compile_with(inside)


def test_refusing_new_guards_raises_where_a_guard_would_be_needed():
    def inside(gm, env, x):
        b = x.shape[0]
        with refusing_new_guards(env):
            with pytest.raises(WouldSpecialise) as refused:
                bool(b == 64)
            answers = (guard_or_false(b == 64), bool(b >= 2), bool(b == b), bool(x.shape[1] == WIDTH))
        return refused.value, answers, "evaluate_expr" in vars(env)

    (refused, answers, still_patched), added = compile_with(inside)
    assert "Eq(s" in str(refused) and ", 64)" in str(refused) and "= 64 in this call" in str(refused)
    assert answers == (False, True, True, True)  # the fallback; the range a dynamic batch has; static facts
    assert not still_patched and added == []


def test_refusing_new_guards_without_symbols_changes_nothing():
    torch._dynamo.reset()
    gm = torch.fx.symbolic_trace(batch_of)
    assert shape_env_of(gm) is None
    with refusing_new_guards(None):
        assert gm(torch.ones(2, WIDTH)).sum() == 2 * 2 * WIDTH


class AsksForTheBatch(GraphPass):
    """A pass that compares the batch with 64 before it would rewrite (here: an unconditional relu -> sigmoid)."""

    name = "asks_for_the_batch"

    def call(self, gm):
        x = tensor_input(gm)
        if x.shape[0] == 64:
            for node in gm.graph.nodes:
                if node.target is torch.relu:
                    node.target = torch.sigmoid
        return PassResult(gm, True, summary="rewritten")


@pytest.mark.parametrize("strict", [False, True])
def test_a_pass_that_would_specialise_declines(strict):
    report = Report()

    def inside(gm, env, x):
        record = report.new_graph("dynamo", gm)
        return run_passes(gm, [AsksForTheBatch()], record, report, strict=strict)

    if strict:
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="WouldSpecialise: the pass asked whether Eq"):
            compile_with(inside)
        return
    gm, added = compile_with(inside)  # compile_with checks the output against eager: the relu is kept
    assert added == []
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(torch.relu) == 1
    (record,) = report.passes
    assert not record.modified and record.summary.startswith("failed and skipped: WouldSpecialise")
    assert "would specialise the graph to this call's sizes" in record.declined[0]


class RewritesThenAsks(AsksForTheBatch):
    """Changes the graph (relu -> sigmoid), then asks about the batch: too late to decline."""

    name = "rewrites_then_asks"

    def call(self, gm):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "relu" in str(node.target):
                node.target = torch.ops.aten.sigmoid.default
        return super().call(gm)


def test_a_pass_in_a_user_s_inductor_compile_declines_or_raises():
    """Inside a user's own Inductor compile (`InductorPass`), a pass that would specialise declines if it
    had not changed the graph yet; one that had raises, as Inductor would compile a half-rewritten graph."""
    asks = InductorPass(AsksForTheBatch())
    x = torch.randn(64, WIDTH)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=asks, fx_graph_cache=False):
        torch.testing.assert_close(torch.compile(batch_of, backend="inductor")(x), batch_of(x))
    (result,) = asks.results
    assert not result.modified and "WouldSpecialise" in result.declined[0]

    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=InductorPass(RewritesThenAsks()),
                                      fx_graph_cache=False):
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="WouldSpecialise"):
            torch.compile(batch_of, backend="inductor")(x)


@pytest.mark.parametrize("sequences", [64, 128])
def test_generate_at_a_batch_equal_to_a_model_size(sequences):
    """tiny is 64 wide with a vocabulary of 128: at these batches the decode step's recognition pass
    compared the batch with them (a ConstraintViolationError before). Tokens equal the eager loop's, and
    a later batch of another size in its class (NOTE [batch classes] in model_zoo/decode.py) reuses the
    step's graph."""
    torch.manual_seed(0)
    model = model_zoo.build("tiny").eval()
    prompt = torch.randint(0, 128, (sequences, 6), generator=torch.Generator().manual_seed(1))
    compiled = model.generate(prompt, 4)
    eager = model.generate(prompt, 4, prefill="eager", decode="eager")
    assert torch.equal(compiled.tokens, eager.tokens)
    model.generate(torch.cat([prompt, prompt[:1]]), 4)
    step = model.ahead_of_time_step  # generate's default step (model_zoo/generate.py)
    assert step.graphs_compiled() == 1
    assert not [d for p in step.report.passes for d in p.declined if "WouldSpecialise" in d]


def test_a_dynamic_batch_of_a_model_size_trains_unspecialised():
    """torch.compile(dynamic=True) at a batch equal to tiny's width: no pass specialises it, the loss and
    gradients equal eager's, and a batch of another size runs without a recompile."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = model_zoo.build("tiny")
    report = laplace_passes.Report()
    compiled = torch.compile(model, backend="laplace", dynamic=True, options={"target": "cpu", "report": report})
    for batch in (64, 5):
        ids = torch.randint(0, 128, (batch, 16), generator=torch.Generator().manual_seed(batch))
        grads = []
        for run in (compiled, model):
            model.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(run(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            grads.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not [d for p in report.passes for d in p.declined if "WouldSpecialise" in d]
