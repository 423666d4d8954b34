"""Shapes that change: plain torch.compile(backend="laplace") over many B and T, mark_dynamic, seq_buckets.

Every compiled result is checked against the same model run eagerly (the
token recurrence), and the graphs the inner compiler receives are captured
to check what runs: never the token recurrence; on trn2 every chunk loop
unrolled at a static shape.
"""

import json
import warnings

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import laplace_passes
import model_zoo
from laplace_passes.driver.buckets import IGNORE_INDEX, SeqBuckets, check_buckets
from laplace_passes.infra.fx_helpers import is_static
from laplace_passes.infra.op_facts import op_name
from laplace_passes.unroll import FitGraphToBudget, SizeModel
from laplace_passes.infra.pass_base import run_pass
from tests.lm_cases import capture_inner, loss_and_grads, tokens

TOL = {"rtol": 1e-4, "atol": 1e-4}
# (B, T): T below one chunk (chunk 64 on cpu, 128 on trn2), and T not a multiple of the chunk.
CALLS = [(1, 20), (2, 130), (3, 48)]
TOKEN_RECURRENCE = ("laplace.gla.default", "laplace.gla_backward.default")
CHUNK_LOOPS = ("laplace.chunked_gla.default", "laplace.chunked_gla_backward.default")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's cache and its limit of 8 compiles per code object span model instances."""
    torch._dynamo.reset()


def one_layer_tiny(seed=0):
    torch.manual_seed(seed)
    return model_zoo.build("tiny", num_layers=1)


def assert_equals_eager(model, compiled, calls):
    """Logits and every parameter gradient of `compiled` equal the model's own, call by call ((B, T) each)."""
    for B, T in calls:
        ids = tokens(T, batch=B, seed=T)
        expected_logits, expected_grads = loss_and_grads(model, ids)
        logits, grads = loss_and_grads(model, ids, compiled)
        torch.testing.assert_close(logits, expected_logits, **TOL)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], **TOL, msg=name)


def ops_of(graphs) -> set[str]:
    return {op_name(n) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("target", ["cpu", "trn2"])
@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic_true"])
def test_tiny_over_changing_batch_and_length_equals_eager(target, dynamic):
    model = one_layer_tiny()
    inner, seen = capture_inner()
    report = laplace_passes.Report()
    compiled = torch.compile(model, backend="laplace", dynamic=dynamic,
                             options={"target": target, "inner": inner, "report": report})
    assert_equals_eager(model, compiled, CALLS)

    assert not ops_of(seen) & set(TOKEN_RECURRENCE)
    assert report.dynamic_dims and all("l_input_ids_ dim" in d for d in report.dynamic_dims)
    json.dumps(report.to_dict())  # nothing symbolic left in the records
    text = str(report)
    if target == "trn2":
        # Every shape compiled statically: chunk loops unrolled, no symbolic size anywhere.
        specialised = len(CALLS) - (1 if dynamic is None else 0)  # automatic: the first call is static
        assert len(report.specialised) == specialised
        assert f"{specialised} shapes specialised" in text and "seq_buckets" in text
        assert not ops_of(seen) & set(CHUNK_LOOPS)
        assert all(is_static(n.meta["val"]) for gm in seen for n in gm.graph.find_nodes(op="placeholder"))
    else:
        # One graph for every later shape: the chunk loop runs at run time.
        assert report.specialised == []
        assert ops_of(seen) >= set(CHUNK_LOOPS)
        dynamic_sites = [s for s in report.sites if isinstance(s.plan["T"], str)]
        assert dynamic_sites and all("kept as a runtime loop: T is dynamic" in s.form for s in dynamic_sites)
        assert "kept as a runtime loop: T is dynamic" in text


def test_inspect_and_preflight_name_a_dimension_marked_dynamic():
    model = one_layer_tiny()
    ids = tokens(40, batch=2)
    torch._dynamo.mark_dynamic(ids, 1)
    report = laplace_passes.inspect(model, ids, target="trn2")
    assert len(report.dynamic_dims) == 1 and "dim 1" in report.dynamic_dims[0]
    assert f"dynamic dimensions: {report.dynamic_dims[0]}" in str(report)
    assert len(report.specialised) == 1 and [s.plan["T"] for s in report.sites] == [40]

    ids = tokens(40, batch=2)
    torch._dynamo.mark_dynamic(ids, 1)
    checked = laplace_passes.preflight(model, ids, target="trn2")
    assert checked.ok, str(checked)
    assert len(checked.dynamic_dims) == 1 and "dim 1" in checked.dynamic_dims[0]
    assert "dynamic dimensions" in str(checked) and "seq_buckets" in str(checked)
    assert checked.to_dict()["dynamic_dims"] == checked.dynamic_dims


def test_lowering_inner_compiler_gets_one_static_graph_per_shape():
    """inner="stablehlo" takes static shapes only, even on the cpu target."""
    report = laplace_passes.Report()

    def fn(x, w):
        return torch.tanh(x @ w).sum(-1)

    compiled = torch.compile(fn, backend="laplace", dynamic=True,
                             options={"target": "cpu", "inner": "stablehlo", "report": report})
    w = torch.randn(8, 4)
    for rows in (3, 5, 3):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(compiled(x, w), fn(x, w))
    assert len(report.specialised) == 2  # 3 rows compiled once
    assert not any("Neuron" in n for n in report.notes)


def test_budget_pass_measures_a_symbolic_graph_and_declines_to_cut_it():
    def fn(x, w):
        return torch.relu(x @ w) @ w.t()

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(256, 512), torch.randn(512, 512))
    model = SizeModel()
    outcome = run_pass(FitGraphToBudget(1, model, "inference"), gm)
    # At the traced example's sizes: two matmuls, one relu, the transpose free.
    expected = 2 * model.matmul_instructions(1, 256, 512, 512) + model.elementwise_instructions(256 * 512)
    assert type(outcome.size.instructions) is int and outcome.size.instructions == expected
    (reason,) = outcome.declined
    assert "its sizes are dynamic" in reason and "dim 0" in reason


def test_seq_buckets_training_loop_compiles_once_per_bucket_and_equals_eager():
    models = [one_layer_tiny(seed=1), one_layer_tiny(seed=1)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    compiled = laplace_passes.compile(models[0], target="cpu", seq_buckets=[64, 160])
    for step, T in enumerate([10, 64, 33, 150, 100, 7]):
        ids = tokens(T, batch=2, seed=step)
        logits, grads = loss_and_grads(models[0], ids, compiled)
        expected_logits, expected_grads = loss_and_grads(models[1], ids)
        assert logits.shape == (2, T, 128)
        torch.testing.assert_close(logits, expected_logits, **TOL)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], **TOL, msg=name)
        for optimizer in optimizers:
            optimizer.step()
    dynamo_graphs = [g for g in compiled.laplace_report.graphs if g.kind == "dynamo"]
    assert len(dynamo_graphs) == 2
    assert sorted(s.plan["T"] for s in compiled.laplace_report.sites) == [64, 160]


def test_seq_buckets_on_fla_gla_tiny_equal_unpadded_eager():
    pytest.importorskip("fla.models")
    from tests import fla_reference as reference

    model = model_zoo.build("fla-gla-tiny")
    ids = tokens(50, batch=2, seed=3)
    logits, _ = reference.forward(model, ids)
    expected_loss = reference.cross_entropy(logits, ids)
    expected_loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    compiled = laplace_passes.compile(model, target="cpu", seq_buckets=[64])
    out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.logits.shape == (2, 50, 128) and compiled.laplace_report.sites[0].plan["T"] == 64
    torch.testing.assert_close(out.logits, logits, **TOL)
    torch.testing.assert_close(out.loss, expected_loss, **TOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], **TOL, msg=name)


def test_seq_buckets_padding_and_slicing():
    seen = []

    def fn(ids, labels=None):
        seen.append((ids, labels))
        return {"logits": ids[..., None].float() * 2, "count": ids.shape[1], "sum": ids.sum()}

    run = SeqBuckets(fn, [4, 8])
    out = run(torch.tensor([[1, 2, 3, 4, 5]]), labels=torch.tensor([[7, 7, 7, 7, 7]]))
    ids, labels = seen[-1]
    assert ids.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert labels.tolist() == [[7] * 5 + [IGNORE_INDEX] * 3]
    assert out["logits"].shape == (1, 5, 1) and out["count"] == 8 and out["sum"].item() == 15


def test_seq_buckets_length_at_a_bucket_runs_at_that_bucket_and_above_the_largest_is_refused():
    seen = []

    def fn(ids):
        seen.append(ids.shape[1])
        return ids[..., None] * 2

    run = SeqBuckets(fn, [4, 8])
    for length, bucket in [(4, 4), (5, 8), (8, 8), (1, 4)]:  # 8: the largest bucket itself is accepted
        ids = torch.arange(1, length + 1)[None]
        assert torch.equal(run(ids), ids[..., None] * 2)
        assert seen[-1] == bucket, (length, seen)
    with pytest.raises(ValueError, match=r"sequence length 9 is longer than the largest of seq_buckets \[4, 8\]: "
                                         r"add a larger bucket"):
        run(torch.zeros(1, 9))
    assert len(seen) == 4  # refused before the call


class LossLM(torch.nn.Module):
    """The tiny model with its loss inside, as a training script often writes it: forward(input_ids, labels)."""

    def __init__(self):
        super().__init__()
        self.lm = one_layer_tiny(seed=2)

    def forward(self, input_ids, labels):
        logits = self.lm(input_ids)
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def test_seq_buckets_labels_by_position_equal_labels_by_keyword_and_unpadded_eager():
    model = LossLM()
    ids, labels = tokens(10, batch=2, seed=4), tokens(10, batch=2, seed=5)
    with torch.no_grad():
        expected = model(ids, labels)
        compiled = laplace_passes.compile(model, target="cpu", seq_buckets=[16])
        by_position = compiled(ids, labels)
        by_keyword = compiled(input_ids=ids, labels=labels)
    for out in (by_position, by_keyword):
        torch.testing.assert_close(out["loss"], expected["loss"], **TOL)
        torch.testing.assert_close(out["logits"], expected["logits"], **TOL)
    assert compiled.laplace_report.sites[0].plan["T"] == 16


def test_seq_buckets_other_spellings_of_labels_and_states():
    def loss_of(ids, targets):  # a loss whose labels go by another common name, by position
        return torch.nn.functional.cross_entropy(torch.nn.functional.one_hot(ids, 8).float().flatten(0, 1),
                                                 targets.flatten())

    ids, targets = tokens(5, batch=2, seed=6) % 8, tokens(5, batch=2, seed=7) % 8
    torch.testing.assert_close(SeqBuckets(loss_of, [8])(ids, targets), loss_of(ids, targets))

    def unknown(ids, y):  # labels by a name seq_buckets cannot know: its loss would count the padding
        return loss_of(ids, y)

    with pytest.raises(ValueError, match=r"output \(shape \(\)\) is not per position, so it includes the 3 "
                                         r"padding positions.*pass its targets as labels="):
        SeqBuckets(unknown, [8])(ids, targets)

    def scan(x, initial_state):  # a state carried in is [B, H, ...]: neither padded nor a length
        return x.cumsum(1) + initial_state.sum((1, 2))[:, None, None]

    x, state = torch.randn(2, 5, 3), torch.randn(2, 4, 6)
    torch.testing.assert_close(SeqBuckets(scan, [8])(x, initial_state=state), scan(x, state))
    torch.testing.assert_close(SeqBuckets(scan, [8])(x, state), scan(x, state))


def test_seq_buckets_attention_mask_and_an_empty_prompt_equal_unpadded_eager():
    model = one_layer_tiny(seed=3).eval()
    run = SeqBuckets(model, [8])
    with torch.no_grad():
        empty = run(tokens(0, batch=2))
        assert empty.shape == (2, 0, 128) and empty.shape == model(tokens(0, batch=2)).shape

    def masked(ids, attention_mask):  # padding masked out (0), as transformers' masks mean it
        return (ids * attention_mask)[..., None].float().cumsum(1)

    ids = tokens(5, batch=2, seed=8)
    torch.testing.assert_close(SeqBuckets(masked, [8])(ids, torch.ones_like(ids)), masked(ids, torch.ones_like(ids)))


def test_seq_buckets_errors():
    for bad in ([], [64, 64], [128, 64], [0, 8], [8.0], "64", None):
        with pytest.raises(ValueError, match="seq_buckets"):
            check_buckets(bad)
    with pytest.raises(ValueError, match="strictly increasing"):
        laplace_passes.compile(torch.nn.Identity(), seq_buckets=[256, 128])
    run = SeqBuckets(lambda *args, **kwargs: args[0], [4, 8])
    with pytest.raises(ValueError, match="share one length"):
        run(torch.zeros(1, 3), torch.zeros(1, 5))
    with pytest.raises(ValueError, match="has none"):
        run(torch.zeros(3))
    with_cache = SeqBuckets(lambda ids: {"logits": ids, "past_key_values": object()}, [4])
    with pytest.raises(ValueError, match="use_cache=False"):
        with_cache(torch.zeros(1, 3))
    assert with_cache(torch.zeros(1, 4))["logits"].shape == (1, 4)  # nothing padded: the cache is exact
    with pytest.raises(TypeError, match="seq_buckets: the call does not match the model's parameters"):
        SeqBuckets(lambda ids: ids, [4])(torch.zeros(1, 3), torch.zeros(1, 3))


def test_a_graph_specialised_past_the_recompile_limit_warns_once():
    """Each shape is a static compile of its own (a neuronx-cc run on Neuron): past Dynamo's limit, say so."""
    report = laplace_passes.Report()
    compiled = torch.compile(lambda x: (x * 2).sum(-1), backend="laplace", dynamic=True,
                             options={"target": "trn2", "report": report})
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for T in (3, 4, 5, 6):
            torch.testing.assert_close(compiled(torch.ones(2, T)), torch.full((2,), 2.0 * T))
    many = [str(w.message) for w in caught if "shapes, more than" in str(w.message)]
    assert len(many) == 1, many
    assert "compiled for 3 shapes" in many[0] and "recompile_limit (2)" in many[0]
    assert "target trn2 compiles static shapes only" in many[0] and "seq_buckets" in many[0]
    assert len(report.specialised) == 4 and many[0] in report.notes and many[0] in str(report)


def test_symbolic_batch_with_static_length_unrolls_one_graph_for_every_batch():
    """cpu, batch marked dynamic, T static: the chunk loops are traced with a symbolic batch, not kept as loops."""
    model = one_layer_tiny()
    inner, seen = capture_inner()
    report = laplace_passes.Report()
    compiled = torch.compile(model, backend="laplace", options={"target": "cpu", "inner": inner, "report": report})
    for B in (2, 3, 5):
        ids = tokens(130, batch=B, seed=B)  # 3 chunks of 64, the last padded
        torch._dynamo.mark_dynamic(ids, 0)
        expected_logits, expected_grads = loss_and_grads(model, ids)
        logits, grads = loss_and_grads(model, ids, compiled)
        torch.testing.assert_close(logits, expected_logits, **TOL)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], **TOL, msg=name)

    assert len(seen) == 2  # one forward and one backward graph for the three batches
    assert not ops_of(seen) & set(CHUNK_LOOPS + TOKEN_RECURRENCE)
    loops = [loop for g in report.graphs for loop in g.loops]
    assert [(loop.kind, loop.trip_count, loop.status) for loop in loops] == [
        ("laplace.chunked_gla", 3, "unrolled"), ("laplace.chunked_gla_backward", 3, "unrolled")]
    assert any(not is_static(n.meta["val"]) for n in seen[0].graph.find_nodes(op="placeholder"))


def _token_loop(q, k, v, a):
    """GLA written as a token loop: `range(T)` makes Dynamo fix T to the traced length of q."""
    B, T, K = q.shape
    S = q.new_zeros(B, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = a[:, t, :, None] * S + k[:, t, :, None] * v[:, t, None, :]
        outs.append((q[:, t, :, None] * S).sum(1))
    return torch.stack(outs, 1)


def test_a_size_dynamo_specialised_to_one_value_is_not_reported_dynamic():
    """A second length makes Dynamo trace T as a symbol, and the token loop's range(T) fixes q's to the traced
    value: the report lists the sizes that can still change (the other inputs' T, which only need to be as long),
    not "l_q_ dim 1 = 24"; the per-shape compile still runs, and the results are eager's."""
    torch._dynamo.reset()
    compiled = torch.compile(_token_loop, backend="laplace")
    for T in (20, 24):
        inputs = [torch.randn(2, T, 8), torch.randn(2, T, 8), torch.randn(2, T, 4), torch.rand(2, T, 8)]
        torch.testing.assert_close(compiled(*inputs), _token_loop(*inputs), **TOL)
    report = laplace_passes.last_report()
    assert report.dynamic_dims and not [d for d in report.dynamic_dims if d.startswith("l_q_")], report.dynamic_dims
    assert all(d.split(" = ")[1].startswith("s") for d in report.dynamic_dims), report.dynamic_dims
    assert report.specialised and "l_q_ [2, 24, 8]" in report.specialised[0]


def test_a_scan_over_a_changing_length_compiles_per_length_and_is_retiled():
    """plain-tiny scans over its tokens. Its second length makes Dynamo hand over a scan of symbolic
    length, which torch's AOT Autograd cannot trace (NOTE [scans over a dynamic length]): on the cpu
    target too, each shape gets a static compile, whose scan is recognised and re-tiled (chunked, with the
    gradients flowing through it), and the results equal eager."""
    torch.manual_seed(0)
    model = model_zoo.build("plain-tiny", num_layers=1)
    inner, seen = capture_inner()
    report = laplace_passes.Report()
    compiled = torch.compile(model, backend="laplace", options={"target": "cpu", "inner": inner, "report": report})
    calls = [(2, 20), (2, 70), (3, 48)]
    assert_equals_eager(model, compiled, calls)

    assert len(report.specialised) == len(calls) - 1  # the first call is static
    assert any("compiled once per shape" in note and "scans over a dynamic length" in note for note in report.notes)
    assert [r.status for r in report.recurrences] == ["GLA site"] * len(calls)
    assert [s.plan["T"] for s in report.sites] == [T for _, T in calls]
    assert all(s.form.startswith("chunked") for s in report.sites)
    assert "scan" not in {n.target.__name__ for gm in seen for n in gm.graph.nodes if n.op == "call_function"
                          and hasattr(n.target, "__name__")}


def test_a_shape_compiled_on_its_own_keeps_what_needs_gradients():
    """A static copy of a dynamic graph gets new fake values; the passes read from them whether gradients
    flow (on trn2 a site of at most 8 tokens takes the recurrent form only when none do). At T = 5 with
    gradients: chunked, as the first, static compile at T = 6 chose."""
    model = one_layer_tiny()
    report = laplace_passes.Report()
    compiled = torch.compile(model, backend="laplace", options={"target": "trn2", "report": report})
    for T in (6, 5):
        loss_and_grads(model, tokens(T, seed=T), compiled)
    assert len(report.specialised) == 1
    forms = [s.form for s in report.sites]
    assert len(forms) == 2 and all(f.startswith("chunked") and "gradients flow" in f for f in forms), forms


@pytest.mark.parametrize("marked", [False, True], ids=["batch_left_to_dynamo", "batch_marked_dynamic"])
def test_a_token_loop_over_a_changing_batch(marked):
    """NOTE [loops declined at symbolic sizes]: after a second batch, Dynamo makes the batch symbolic and
    recognition, which reads static sizes only, declines the loop. Left to Dynamo, the graph is compiled once
    per batch instead, each re-tiled, the first batch's included when it comes back; marked dynamic by the
    user, it stays one graph, the loop declined with the reason. Equal to eager either way."""
    report = laplace_passes.Report()
    compiled = torch.compile(_token_loop, backend="laplace", options={"target": "cpu", "report": report})
    for B in (4, 3, 4):
        gen = torch.Generator().manual_seed(B)
        inputs = [torch.randn(B, 20, 8, generator=gen), torch.randn(B, 20, 8, generator=gen),
                  torch.randn(B, 20, 4, generator=gen), torch.rand(B, 20, 8, generator=gen)]
        if marked and B == 3:
            torch._dynamo.mark_dynamic(inputs[0], 0)
        torch.testing.assert_close(compiled(*inputs), _token_loop(*inputs), **TOL)
    declined = [r for r in report.recurrences if r.status == "declined"]
    assert declined and all(": a symbolic size" in r.reason for r in declined)
    retiled = [s.shape["B"] for s in report.sites if s.status == "retiled"]
    if marked:
        assert retiled == [4] and report.specialised == []
        assert not [note for note in report.notes if "compiled once per shape" in note]
    else:
        assert retiled == [4, 3, 4] and len(report.specialised) == 2
        (note,) = [note for note in report.notes if "compiled once per shape" in note]
        assert "declined 1 loop(s)" in note and "after a second shape" in note


class ProjectedTokenLoop(torch.nn.Module):
    """GLA from the equations over projections of the input, each viewed as [B, T, H, K] with T read off x."""

    def __init__(self, D=16, H=2, K=8):
        super().__init__()
        self.H, self.K = H, K
        self.q, self.k, self.v, self.g = (torch.nn.Linear(D, H * K) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v, g = (p(x).view(B, T, self.H, self.K) for p in (self.q, self.k, self.v, self.g))
        g = F.logsigmoid(g)
        S, outs = x.new_zeros(B, self.H, self.K, self.K), []
        for t in range(T):
            S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append((q[:, t, :, :, None] * S).sum(-2))
        return torch.stack(outs, 1)


def test_a_token_loop_over_projections_is_retiled_at_every_length():
    """After a second length Dynamo traces T as a symbol, fixed again by the loop's range(T), and the views of
    the projections keep it: each step indexes a tensor of symbolic sizes. Recognition declines that graph
    saying so, and the driver compiles it once per length, each length's loop re-tiled, equal to eager."""
    torch.manual_seed(0)
    model = ProjectedTokenLoop()
    report = laplace_passes.Report()
    compiled = torch.compile(model, backend="laplace", options={"target": "cpu", "inner": "eager", "report": report})
    for T in (20, 30, 40):
        x = torch.randn(2, T, 16)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert sorted(s.plan["T"] for s in report.sites if s.status == "retiled") == [20, 30, 40]
    declined = [r for r in report.recurrences if r.status == "declined"]
    assert declined and all(r.reason.endswith("is not read as a position along k: a symbolic size")
                            for r in declined), [r.reason for r in declined]


def _dynamic_report(model):
    """`model` compiled with dynamic=True, equal to eager at one shape; its report."""
    compiled = laplace_passes.compile(model, target="cpu", inner="eager", dynamic=True)
    x = torch.randn(2, 12, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    return compiled.laplace_report


def test_a_dynamic_graph_whose_loop_is_not_found_says_why():
    """dynamic=True: the state's batch is a symbol and recognition finds no loop at all; its report entry says
    that a loop of symbolic sizes is not read, and which sizes are symbolic. Equal to eager."""
    torch.manual_seed(0)
    (entry,) = [p for p in _dynamic_report(ProjectedTokenLoop()).passes if p.name == "recognise_gla"]
    assert entry.summary.startswith("0 of 0 loops carrying a state rewritten as GLA sites; a loop whose state has "
                                    "symbolic sizes is not read as one (the graph's inputs have symbolic sizes: "
                                    "l_x_ dim 0 = s"), entry.summary


class TwoProjectedTokenLoops(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = ProjectedTokenLoop(), ProjectedTokenLoop()

    def forward(self, x):
        return self.second(self.first(x).flatten(2))


def test_a_dynamic_graph_with_a_loop_found_and_one_not_says_why_for_both():
    """dynamic=True, two loops: the second is found (a row, declined at a symbolic size), the first not at all
    (no row); the entry still says that a loop of symbolic sizes is not read (it had said only "0 of 1")."""
    torch.manual_seed(0)
    report = _dynamic_report(TwoProjectedTokenLoops())
    assert [r.status for r in report.recurrences] == ["declined"]
    (entry,) = [p for p in report.passes if p.name == "recognise_gla"]
    assert entry.summary.startswith("0 of 1 loops carrying a state rewritten as GLA sites; a loop whose state has "
                                    "symbolic sizes is not read as one (the graph's inputs have symbolic sizes: "), \
        entry.summary


class EmbeddedGLA(torch.nn.Module):
    """An embedding before a GLA call: under dynamic=True, Dynamo restarts its analysis of the frame once
    (specialising the embedding's float arguments) and compiles it again."""

    def __init__(self):
        super().__init__()
        self.embed, self.project = torch.nn.Embedding(32, 32), torch.nn.Linear(32, 4 * 32)

    def forward(self, ids):
        b, t = ids.shape
        q, k, v, g = self.project(self.embed(ids)).view(b, t, 4, 2, 16).unbind(2)
        return laplace_passes.gla(q, k, v, F.logsigmoid(g) / 8)[0]


def test_a_restarted_analysis_is_reported_once():
    """The report had kept the attempt Dynamo threw away: two Dynamo graphs and two sites for one gla call."""
    torch.manual_seed(0)
    model = EmbeddedGLA()
    compiled = torch.compile(model, backend="laplace", dynamic=True, options={"target": "cpu", "inner": "eager"})
    ids = torch.randint(0, 32, (4, 31))
    compiled(ids).sum().backward()
    torch.testing.assert_close(compiled(ids), model(ids), **TOL)
    report = laplace_passes.last_report()
    assert [g.kind for g in report.graphs] == ["dynamo", "forward", "backward"]
    assert [(s.graph, s.status) for s in report.sites] == [("dynamo_0", "retiled")]
    assert [p.graph for p in report.passes if p.name == "retile_gla"] == ["dynamo_0"]


def test_a_restart_after_a_reset_keeps_the_graphs_before_it():
    """torch._dynamo.reset() starts Dynamo's compile ids again: a restart of the new "0/0" must not take the
    earlier compile's "0/0" graphs with it (their names were then given twice)."""
    torch.manual_seed(0)
    model = EmbeddedGLA()
    compiled = laplace_passes.compile(model, target="cpu", inner="eager", dynamic=True)
    ids = torch.randint(0, 32, (4, 31))
    compiled(ids)
    torch._dynamo.reset()
    compiled(ids)
    names = [g.name for g in compiled.laplace_report.graphs]
    assert len(names) == len(set(names)) and [g.kind for g in compiled.laplace_report.graphs].count("dynamo") == 2
    assert [s.graph for s in compiled.laplace_report.sites] == ["dynamo_0", "dynamo_1"]
