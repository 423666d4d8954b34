"""Static unrolling: GLA chunk loops and user scan / while_loop become straight-line code.

Checked on the graph code (FileCheck), against eager execution (outputs and
gradients), and at the pass level on graphs built here (lint, numerics equal
to the untransformed graph, the reason when a loop is declined).
"""

import pytest
import torch
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import laplace_passes
from laplace_passes.ops.chunked import chunked_gla_op
from laplace_passes.unroll import UnrollLoops
from tests.gla_cases import make_inputs, output_cotangents, relative_rmse
from tests.lm_cases import capture_inner


def assert_straight_line(code: str) -> None:
    """No loop of any kind a graph can hold: scan, while_loop, a GLA chunk-loop op."""
    FileCheck().check_not("higher_order.scan").check_not("while_loop").check_not("chunked_gla").run(code)


def loops_of(report, graph_name):
    return [(r.kind, r.trip_count, r.status) for r in report.graph_record(graph_name).loops]


# -- GLA chunk loops ------------------------------------------------------------------


def test_unrolled_gla_at_2048_tokens_matches_eager_with_gradients():
    """16 chunks of 128: the forward and the explicit backward reach the inner compiler unrolled."""
    q, k, v, gk, h0 = make_inputs(1, 2048, 2, 32, 48, gate_divisor=1.0)

    def f(q, k, v, gk, h0):
        return laplace_passes.gla(q, k, v, gk, initial_state=h0, output_final_state=True)

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, gk, h0)]
        o, state = fn(*leaves)
        do, dstate = output_cotangents(1, 2048, 2, 32, 48)
        return [o, state, *torch.autograd.grad((o * do).sum() + (state * dstate).sum(), leaves)]

    capture, seen = capture_inner()
    compiled = laplace_passes.compile(f, target="trn2", inner=capture)
    actual, expected = run(compiled), run(f)
    for name, a, e in zip(["o", "state", "dq", "dk", "dv", "dgk", "dh0"], actual, expected):
        assert relative_rmse(a, e) < 1e-4, name

    report = compiled.laplace_report
    assert loops_of(report, "forward_0") == [("laplace.chunked_gla", 16, "unrolled")]
    assert loops_of(report, "backward_0") == [("laplace.chunked_gla_backward", 16, "unrolled")]
    assert len(seen) == 2
    for gm in seen:
        assert_straight_line(gm.code)
    # One state per chunk, stacked: 16 entering states in the forward; in the
    # backward the 16 recomputed ones and the 16 state gradients of the reverse loop.
    def is_state(x):
        return x.meta["val"].shape == h0.shape  # [B, H, K, V]

    stacked = [[len(n.args[0]) for n in gm.graph.nodes if n.target == torch.ops.aten.stack.default
                and is_state(n.args[0][0])] for gm in seen]
    assert stacked == [[16], [16, 16]]


def test_cpu_keeps_the_state_recurrence_one_op_so_its_graphs_do_not_grow_with_T():
    """cpu: laplace::chunk_recurrence in place of one state update per chunk; same nodes at 4 and 11 chunks; eager's numbers."""
    def f(q, k, v, gk, h0):
        return laplace_passes.gla(q, k, v, gk, initial_state=h0, output_final_state=True)

    node_counts = []
    for T in (200, 700):  # 4 and 11 chunks of 64
        q, k, v, gk, h0 = make_inputs(1, T, 2, 8, 6, gate_divisor=0.5)
        do, dstate = output_cotangents(1, T, 2, 8, 6)

        def run(fn):
            leaves = [x.clone().requires_grad_() for x in (q, k, v, gk, h0)]
            o, state = fn(*leaves)
            return [o, state, *torch.autograd.grad((o * do).sum() + (state * dstate).sum(), leaves)]

        capture, seen = capture_inner()
        compiled = laplace_passes.compile(f, target="cpu", inner=capture)
        for name, a, e in zip(["o", "state", "dq", "dk", "dv", "dgk", "dh0"], run(compiled), run(f)):
            assert relative_rmse(a, e) < 1e-5, name
        assert [n for gm in seen for n in gm.graph.nodes
                if n.target == torch.ops.laplace.chunk_recurrence.default] != []
        for gm in seen:
            assert_straight_line(gm.code)
        node_counts.append([len(gm.graph.nodes) for gm in seen])
    assert node_counts[0] == node_counts[1]


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("start", [None, "fp32", "bf16"])
@pytest.mark.parametrize("n_chunks,layout", [(5, "contiguous"), (5, "strided"), (1, "contiguous")])
def test_chunk_recurrence_op_is_the_python_loop_bit_for_bit(reverse, start, n_chunks, layout):
    """The op writes each state into its slot in place: the loop's values and dtypes, whatever the chunks or strides."""
    from laplace_passes.ops.chunked import chunk_recurrence_op
    from laplace_passes.ops.chunked_forward import chunk_recurrence

    gen = torch.Generator().manual_seed(1)
    terms, decay = torch.randn(2, 3, n_chunks, 4, 6, generator=gen), torch.rand(2, 3, n_chunks, 4, 1, generator=gen)
    if layout == "strided":  # as a transposed matmul output would arrive
        terms = torch.randn(2, 3, n_chunks, 6, 4, generator=gen).transpose(-1, -2)
    h0 = None if start is None else torch.randn(2, 3, 4, 6, generator=gen).to(getattr(torch, {"fp32": "float32"}.get(start, "bfloat16")))
    got_all, expected_all = chunk_recurrence_op(terms, decay, h0, reverse), chunk_recurrence(terms, decay, h0, reverse)
    for got, expected in zip(got_all, expected_all):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert h0 is None or got_all[1].data_ptr() != h0.data_ptr()  # no output aliases an input


def test_compilers_that_lower_and_the_neuron_targets_get_the_recurrence_unrolled():
    from laplace_passes.driver.config import CompileConfig
    from laplace_passes.driver.pipeline import Build, _unroll, graph_context
    from laplace_passes.infra.inner import InnerCompiler

    class Lowering(InnerCompiler):  # what stablehlo, iree and neuron declare
        legalizes = True

    def unroll(target, inner):
        config = CompileConfig.from_options({"target": target, "inner": inner})
        build = Build(config, graph_context(config, "forward_0", "forward"), torch.fx.GraphModule({}, torch.fx.Graph()))
        return _unroll(build)

    def recurrence(target, inner):
        return unroll(target, inner).chunk_loops.recurrence

    assert recurrence("cpu", "eager") == recurrence("cpu", "inductor") == "op"
    assert recurrence("cpu", Lowering()) == "unrolled"
    assert recurrence("trn2", "inductor") == recurrence("trn1", "eager") == "unrolled"
    # Only Inductor on a target keeping the recurrence whole compiles each chunk-loop body once (compiled_bodies).
    assert unroll("cpu", "inductor").compile_bodies
    assert not any(unroll(t, i).compile_bodies for t, i in (("cpu", "eager"), ("cpu", Lowering()), ("trn2", "inductor")))
    with pytest.raises(ValueError, match="compile_bodies needs chunk_recurrence='op'"):
        UnrollLoops("aten", compile_bodies=True)


def test_chunk_loop_op_pass_level():
    """UnrollLoops on a graph holding the op: same numbers, linted, the trip count recorded."""
    q, k, v, gk, h0 = make_inputs(1, 300, 2, 8, 6, gate_divisor=0.5)

    def f(q, k, v, gk, h0):
        return chunked_gla_op(q, k, v, gk, h0, 0.3, 64, 16, False)

    gm = make_fx(f, tracing_mode="fake")(q, k, v, gk, h0)
    FileCheck().check("laplace.chunked_gla.default").run(gm.code)
    expected = gm(q, k, v, gk, h0)
    outcome = UnrollLoops("aten")(gm)
    outcome.graph_module.graph.lint()
    outcome.graph_module.recompile()
    assert_straight_line(outcome.graph_module.code)
    assert [(r.kind, r.trip_count, r.status) for r in outcome.loops] == [("laplace.chunked_gla", 5, "unrolled")]
    for a, e in zip(outcome.graph_module(q, k, v, gk, h0), expected):
        torch.testing.assert_close(a, e)
    assert all("val" in n.meta for n in outcome.graph_module.graph.nodes if n.op == "call_function")


def test_a_trace_is_shared_within_a_fake_mode_reused_across_modes_and_made_again_for_another_layout(monkeypatch):
    """NOTE [traces shared within a fake mode]: a backward passed through the passes twice (sent to the
    helper, then compiled) traces its body once. NOTE [traces reused across fake modes]: a graph of another
    fake mode takes a copy of that trace, its values that mode's own; inputs laid out otherwise trace their
    own. Each graph computes what the op does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from laplace_passes.infra.fx_helpers import GraphsAcrossModes
    from laplace_passes.unroll import chunk_loops

    traces = []
    trace_here = chunk_loops.ChunkLoopExpander._traced
    monkeypatch.setattr(chunk_loops.ChunkLoopExpander, "_traced",
                        lambda self, *args: traces.append(1) or trace_here(self, *args))
    monkeypatch.setattr(chunk_loops, "_ACROSS_MODES", GraphsAcrossModes(4))  # none from earlier tests
    q, k, v, gk, h0 = make_inputs(1, 300, 2, 8, 6, gate_divisor=0.5)
    k_strided = k.transpose(1, 2).contiguous().transpose(1, 2)  # the same values and shape, other strides

    def f(q, k, v, gk, h0):
        return chunked_gla_op(q, k, v, gk, h0, 0.3, 64, 16, False)

    def unrolled_in(mode, keys):
        gm = make_fx(f, tracing_mode="fake")(*(mode.from_tensor(x) for x in (q, keys, v, gk, h0)))
        outcome = UnrollLoops("aten")(gm)
        assert [r.status for r in outcome.loops] == ["unrolled"]
        outcome.graph_module.recompile()
        assert_straight_line(outcome.graph_module.code)
        for a, e in zip(outcome.graph_module(q, keys, v, gk, h0), f(q, keys, v, gk, h0)):
            torch.testing.assert_close(a, e)
        values = [n.meta["val"] for n in outcome.graph_module.graph.nodes if n.op == "call_function"]
        assert all(t.fake_mode is mode for value in values for t in pytree_tensors(value))
        return outcome.graph_module.code

    mode, other_mode = FakeTensorMode(), FakeTensorMode()
    first = unrolled_in(mode, k)
    assert unrolled_in(mode, k) == first and len(traces) == 1  # the second pass took the first's trace
    assert unrolled_in(other_mode, k) == first and len(traces) == 1  # a copy, its values other_mode's
    unrolled_in(mode, k_strided)
    assert len(traces) == 2


def pytree_tensors(value) -> list:
    from torch.utils import _pytree as pytree

    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def test_graphs_kept_across_modes_hold_no_fake_value_and_each_taker_gets_its_own_copy():
    """GraphsAcrossModes: what it keeps holds no fake tensor (no mode kept alive: make_fx's `eager_input_vals`
    on a custom op included); a taker's copy has values of its inputs' mode, with tensor_meta and
    eager_input_vals as make_fx leaves them; a change to one copy reaches no other; a graph with constants
    is not kept; the least recently used goes first."""
    import gc
    import weakref

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils import _pytree as pytree

    from laplace_passes.infra.fx_helpers import GraphsAcrossModes
    from laplace_passes.ops.chunked import chunk_recurrence_op

    def f(x, d):
        states, final = chunk_recurrence_op(x * 2, d, None, False)  # an op whose trace keeps eager_input_vals
        return states.relu() + x.sum(), final

    def fakes(mode, *tensors):
        return [mode.from_tensor(t) for t in tensors]

    shapes = torch.randn(1, 2, 3, 4, 5), torch.rand(1, 2, 3, 4, 1)
    store = GraphsAcrossModes(2)
    first_mode = FakeTensorMode()
    traced = make_fx(f, tracing_mode="fake")(*fakes(first_mode, *shapes))
    assert any("eager_input_vals" in n.meta for n in traced.graph.nodes)
    store.put("f", traced)
    kept = store._graphs["f"][0]
    assert not any(isinstance(leaf, FakeTensor) for n in kept.graph.nodes for leaf in pytree.tree_leaves(n.meta))
    alive = weakref.ref(first_mode)
    del traced, first_mode
    gc.collect()
    assert alive() is None
    mode = FakeTensorMode()
    inputs = fakes(mode, *shapes)
    copy = store.get("f", inputs)
    computed = [n for n in copy.graph.nodes if n.op == "call_function"]
    values = [leaf for n in computed for name in ("val", "eager_input_vals") for leaf in pytree.tree_leaves(n.meta.get(name))
              if isinstance(leaf, torch.Tensor)]
    assert values and all(isinstance(v, FakeTensor) and v.fake_mode is mode for v in values)
    assert all(n.meta["tensor_meta"].shape == n.meta["val"].shape for n in computed if isinstance(n.meta["val"], torch.Tensor))
    (recurrence,) = [n for n in computed if n.target is torch.ops.laplace.chunk_recurrence.default]
    decay = [n for n in copy.graph.nodes if n.op == "placeholder"][1]
    assert recurrence.meta["eager_input_vals"][0][1] is decay.meta["val"]  # its arguments' values, this mode's
    x, d = shapes
    for a, e in zip(copy(x, d), f(x, d)):
        torch.testing.assert_close(a, e)
    computed[0].meta["changed"] = True
    with copy.graph.inserting_after(computed[0]):
        copy.graph.call_function(torch.ops.aten.neg.default, (computed[0],))
    again = [n for n in store.get("f", inputs).graph.nodes if n.op == "call_function"]
    assert len(again) == len(computed) and "changed" not in again[0].meta

    constant = torch.fx.symbolic_trace(torch.nn.Linear(4, 2))  # reads its weight through get_attr
    store.put("constant", constant)
    assert store.get("constant", inputs[:1]) is None
    store.put("g", copy)
    store.get("f", inputs)  # f used after g was put: g is the least recently used
    store.put("h", copy)
    assert sorted(store._graphs) == ["f", "h"]


def test_inspect_then_compile_gives_the_graphs_a_compile_alone_gives(monkeypatch):
    """`inspect` traces a backward's body with AOT's Python dispatcher on (views recorded as `view`), a compile
    with it off (`_unsafe_view`): a compile after an inspect of the same shapes traces its own, not inspect's."""
    from laplace_passes.infra.fx_helpers import GraphsAcrossModes
    from laplace_passes.unroll import chunk_loops

    q, k, v, gk, h0 = make_inputs(1, 40, 2, 8, 6, gate_divisor=1.0)

    def f(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    def compiled_graphs():
        torch._dynamo.reset()
        capture, seen = capture_inner()
        leaves = [x.clone().requires_grad_() for x in (q, k, v, gk)]
        laplace_passes.compile(f, target="trn2", chunk_size=16, inner=capture)(*leaves).sum().backward()
        return [gm.code for gm in seen]

    monkeypatch.setattr(chunk_loops, "_ACROSS_MODES", GraphsAcrossModes(4))
    alone = compiled_graphs()
    monkeypatch.setattr(chunk_loops, "_ACROSS_MODES", GraphsAcrossModes(4))
    torch._dynamo.reset()
    laplace_passes.inspect(f, *[x.clone().requires_grad_() for x in (q, k, v, gk)], target="trn2", chunk_size=16)
    assert compiled_graphs() == alone
    torch._dynamo.reset()


def test_a_second_compile_of_the_same_shapes_traces_no_body_and_computes_the_same(monkeypatch):
    """After `torch._dynamo.reset()` (a new fake mode), a GLA of the same shapes compiles again with the
    traces of the first compile, outputs and gradients equal to the first's."""
    from laplace_passes.infra.fx_helpers import GraphsAcrossModes
    from laplace_passes.unroll import chunk_loops

    traces = []
    trace_here = chunk_loops.ChunkLoopExpander._traced
    monkeypatch.setattr(chunk_loops.ChunkLoopExpander, "_traced",
                        lambda self, *args: traces.append(1) or trace_here(self, *args))
    monkeypatch.setattr(chunk_loops, "_ACROSS_MODES", GraphsAcrossModes(4))
    q, k, v, gk, h0 = make_inputs(1, 200, 2, 8, 6, gate_divisor=1.0)

    def f(q, k, v, gk, h0):
        return laplace_passes.gla(q, k, v, gk, initial_state=h0, output_final_state=True)

    def compiled_run():
        torch._dynamo.reset()
        leaves = [x.clone().requires_grad_() for x in (q, k, v, gk, h0)]
        o, state = laplace_passes.compile(f, target="trn2", chunk_size=64)(*leaves)
        return [o, state, *torch.autograd.grad(o.sum() + state.sum(), leaves)]

    first = compiled_run()
    assert len(traces) == 2  # the forward's body and the backward's
    second = compiled_run()
    assert len(traces) == 2
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    torch._dynamo.reset()


def test_two_sites_of_one_graph_laid_out_otherwise_trace_their_own(monkeypatch):
    """A trace records the views and copies its inputs' layout calls for: within one graph too, a site
    whose inputs have the same shapes but other strides traces its own body, and both compute the op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from laplace_passes.unroll import chunk_loops

    traces = []
    trace_here = chunk_loops.ChunkLoopExpander._traced
    monkeypatch.setattr(chunk_loops.ChunkLoopExpander, "_traced",
                        lambda self, *args: traces.append(1) or trace_here(self, *args))
    monkeypatch.setattr(chunk_loops, "_ACROSS_MODES", chunk_loops.GraphsAcrossModes(4))  # none from earlier tests
    q, k, v, gk, h0 = make_inputs(1, 300, 2, 8, 6, gate_divisor=0.5)
    k_strided = k.transpose(1, 2).contiguous().transpose(1, 2)

    def f(q, k, k_strided, v, gk, h0):
        return (*chunked_gla_op(q, k, v, gk, h0, 0.3, 64, 16, False),
                *chunked_gla_op(q, k_strided, v, gk, h0, 0.3, 64, 16, False))

    inputs = (q, k, k_strided, v, gk, h0)
    mode = FakeTensorMode()
    gm = make_fx(f, tracing_mode="fake")(*(mode.from_tensor(x) for x in inputs))
    outcome = UnrollLoops("aten")(gm)
    assert [r.status for r in outcome.loops] == ["unrolled", "unrolled"]
    assert len(traces) == 2
    outcome.graph_module.recompile()
    for a, e in zip(outcome.graph_module(*inputs), f(*inputs)):
        torch.testing.assert_close(a, e)


def test_dynamic_chunk_loop_is_declined_and_still_runs():
    q, k, v, gk, _ = make_inputs(1, 40, 1, 4, 4)

    def f(q, k, v, gk):
        return chunked_gla_op(q, k, v, gk, None, 0.5, 16, 4, False)[0]

    gm = make_fx(f, tracing_mode="symbolic")(q, k, v, gk)
    outcome = UnrollLoops("aten")(gm)
    (loop,) = outcome.loops
    assert loop.status == "declined" and loop.reason.startswith("kept as a runtime loop: T is dynamic (s")
    assert outcome.declined == [f"{loop.node} (laplace.chunked_gla): {loop.reason}"]
    FileCheck().check("laplace.chunked_gla").run(outcome.graph_module.code)
    torch.testing.assert_close(outcome.graph_module(q, k, v, gk), f(q, k, v, gk))


# -- user scan -------------------------------------------------------------------------

WEIGHT = torch.linspace(0.5, 1.5, 6)


def cumulative_recurrence(dim, reverse, weight):
    """c_t = tanh(w * c_{t-1} + x_t), y_t = c_t * x_t: scanned along `dim`, a captured weight."""

    def f(x, init):
        def step(c, x_t):
            c = torch.tanh(weight * c + x_t)
            return c, c * x_t

        return scan(step, init, x, dim=dim, reverse=reverse)

    return f


@pytest.mark.parametrize("dim,reverse", [(0, False), (1, False), (1, True)])
def test_user_scan_compiles_unrolled_and_matches_eager(dim, reverse):
    weight = WEIGHT.clone().requires_grad_()
    f = cumulative_recurrence(dim, reverse, weight)
    shape = [7, 3, 6] if dim == 0 else [3, 7, 6]
    gen = torch.Generator().manual_seed(dim + 2 * reverse)
    x, init = torch.randn(shape, generator=gen), torch.randn(3, 6, generator=gen)

    def run(fn):
        leaves = [x.clone().requires_grad_(), init.clone().requires_grad_(), weight]
        c, ys = fn(*leaves[:2])
        loss = (c * c).sum() + (ys * torch.arange(ys.numel()).view_as(ys)).sum()
        return [c, ys, *torch.autograd.grad(loss, leaves)]

    capture, seen = capture_inner()
    compiled = laplace_passes.compile(f, target="trn2", inner=capture)
    for a, e in zip(run(compiled), run(f)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)

    report = compiled.laplace_report
    FileCheck().check("higher_order.scan").run(report.graph("before").code)
    assert loops_of(report, "dynamo_0") == [("scan", 7, "unrolled")]
    assert [g.kind for g in report.graphs] == ["dynamo", "forward", "backward"]
    for gm in seen:
        assert_straight_line(gm.code)
    assert "scan" in str(report) and "unrolled 1 loop (1 x scan, 7 trips)" in str(report)


def test_scan_in_an_aten_graph_is_unrolled_by_the_pass():
    """The ATen-level pass unrolls a scan too (e.g. one reaching an inference graph)."""

    def f(x, init, weight):
        return cumulative_recurrence(0, False, weight)(x, init)

    x, init = torch.randn(5, 2, 6), torch.randn(2, 6)
    gm = make_fx(f, tracing_mode="fake")(x, init, WEIGHT)
    FileCheck().check("torch.ops.higher_order.scan").run(gm.code)
    outcome = UnrollLoops("aten")(gm)
    out = outcome.graph_module
    out.graph.lint()
    out.recompile()
    assert_straight_line(out.code)
    assert [(r.kind, r.trip_count) for r in outcome.loops] == [("scan", 5)]
    for a, e in zip(out(x, init, WEIGHT), f(x, init, WEIGHT)):
        torch.testing.assert_close(a, e)


# -- user while_loop -----------------------------------------------------------------------


def doubling_loop(x):
    i = torch.tensor(0)
    return while_loop(lambda i, x: i < 5, lambda i, x: (i + 1, x * 2 + 1), (i, x))


def python_counter_loop(x):
    return while_loop(lambda i, x: i < 4, lambda i, x: (i + 1, torch.sin(x)), (0, x))


def tensor_method_loop(x):
    """Dynamo keeps i.lt(3) and i.add(1) as call_method nodes."""
    return while_loop(lambda i, x: i.lt(3), lambda i, x: (i.add(1), x.mul(2)), (torch.tensor(0), x))


@pytest.mark.parametrize("fn,trips", [(doubling_loop, 5), (python_counter_loop, 4), (tensor_method_loop, 3)])
def test_static_while_loop_is_unrolled(fn, trips):
    x = torch.randn(3)
    capture, seen = capture_inner()
    compiled = laplace_passes.compile(fn, target="trn2", inner=capture, fullgraph=True)
    got, expected = compiled(x), fn(x)
    assert int(got[0]) == int(expected[0]) == trips
    torch.testing.assert_close(got[1], expected[1])
    assert loops_of(compiled.laplace_report, "dynamo_0") == [("while_loop", trips, "unrolled")]
    for gm in seen:
        assert_straight_line(gm.code)


def test_data_dependent_while_loop_is_declined_and_still_runs():
    def bounded_by_input(x, n):
        return while_loop(lambda i, x: i < n, lambda i, x: (i + 1, x * 2), (torch.zeros((), dtype=torch.int64), x))

    x, n = torch.randn(3), torch.tensor(3)
    compiled = laplace_passes.compile(bounded_by_input, target="trn2", fullgraph=True)
    got = compiled(x, n)
    assert int(got[0]) == 3
    torch.testing.assert_close(got[1], x * 8)
    report = compiled.laplace_report
    for graph in ("dynamo_0", "inference_0"):
        (loop,) = report.graph_record(graph).loops
        assert loop.status == "declined" and loop.trip_count is None
        assert "trip count is data-dependent" in loop.reason and "which is a graph input" in loop.reason
    assert "declined" in str(report)
    FileCheck().check("while_loop").run(report.graph("after", "inference_0").code)


def test_gla_inside_a_scan_body_is_unrolled_then_retiled():
    """A site in a loop body becomes one site per trip when the scan is unrolled, each re-tiled."""
    q, k, v, gk, _ = make_inputs(1, 96, 2, 8, 6, gate_divisor=0.5, initial_state=False)

    def f(q, k, v, gk):
        def step(total, scale):
            o, _ = laplace_passes.gla(q * scale, k, v, gk)
            return total + o.sum(), o

        return scan(step, torch.zeros(()), torch.arange(1.0, 4.0))

    capture, seen = capture_inner()
    compiled = laplace_passes.compile(f, target="cpu", inner=capture, fullgraph=True)
    (total, outputs), (expected_total, expected_outputs) = compiled(q, k, v, gk), f(q, k, v, gk)
    assert relative_rmse(outputs, expected_outputs) < 1e-5 and relative_rmse(total, expected_total) < 1e-5

    report = compiled.laplace_report
    assert [(s.node, s.status) for s in report.sites] == [(f"gla_default{i}", "retiled") for i in ("", "_1", "_2")]
    assert loops_of(report, "dynamo_0") == [("scan", 3, "unrolled")]
    assert loops_of(report, "inference_0") == [("laplace.chunked_gla", 2, "unrolled")] * 3
    (graph,) = seen
    assert_straight_line(graph.code)
    FileCheck().check_not("laplace.gla").run(graph.code)
    # The snapshot taken before the passes still shows the body as the user wrote it.
    body = report.graph("before").get_submodule("scan_combine_fn_0")
    FileCheck().check("laplace.gla.default").run(body.code)
