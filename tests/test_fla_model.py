"""flash-linear-attention's GLAForCausalLM, default flags, through backend="laplace" on the CPU.

Everything is checked against the same weights run eagerly in plain PyTorch
(tests/fla_reference.py): logits, loss and every parameter gradient, training
step by step, greedy generation token by token, StableHLO export and IREE.
"""

import pytest
import torch

import laplace_passes
from tests import fla_reference as reference
from tests.gla_cases import make_inputs, relative_rmse

fla_models = pytest.importorskip("fla.models")
naive = pytest.importorskip("fla.ops.gla.naive")

MAX_RELATIVE_RMSE = 1e-5  # fp32


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo keeps at most 8 compiles per code object (fla's forward methods), across model instances."""
    torch._dynamo.reset()
TINY = dict(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=128)


def fla_model(seed=0, **flags):
    torch.manual_seed(seed)
    return fla_models.GLAForCausalLM(fla_models.GLAConfig(**TINY, **flags))


def tokens(B, T, seed=0):
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def compiled_run(model, ids, target="trn2"):
    """(compiled model, logits, loss, gradients) of one training step through the laplace backend."""
    model.zero_grad(set_to_none=True)
    compiled = laplace_passes.compile(model, target=target)
    out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    return compiled, out.logits.detach(), out.loss.detach(), _grads(model)


def reference_run(model, ids):
    model.zero_grad(set_to_none=True)
    logits, _ = reference.forward(model, ids)
    loss = reference.cross_entropy(logits, ids)
    loss.backward()
    return logits.detach(), loss.detach(), _grads(model)


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_close(actual, expected):
    logits, loss, grads = actual
    ref_logits, ref_loss, ref_grads = expected
    assert relative_rmse(logits, ref_logits) <= MAX_RELATIVE_RMSE
    assert relative_rmse(loss, ref_loss) <= MAX_RELATIVE_RMSE
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert relative_rmse(grads[name], ref_grads[name]) <= MAX_RELATIVE_RMSE, name


def test_reference_gla_is_fla_naive_recurrent_gla():
    """The reference's out-of-place loop is fla's naive_recurrent_gla: outputs, states, gradients."""
    inputs = make_inputs(2, 48, 2, 16, 8, gate_divisor=0.5)
    results = []
    for fn in (lambda q, k, v, g, h: naive.naive_recurrent_gla(q, k, v, g, h, output_final_state=True),
               reference.gla):
        leaves = [x.clone().requires_grad_() for x in inputs]
        o, state = fn(*leaves)
        grads = torch.autograd.grad(o.square().sum() + state.sin().sum(), leaves)
        results.append([o, state, *grads])
    for actual, expected in zip(*results):
        assert relative_rmse(actual, expected) < 1e-6


@pytest.mark.parametrize("T", [256, 1000])
def test_default_flags_both_modes_match_the_reference(T):
    """Logits, loss and every gradient, attn_mode chunk and fused_recurrent, B = 2 (2 chunks, and 8 with padding)."""
    ids = tokens(2, T)
    model = fla_model()
    expected = reference_run(model, ids)
    for mode in ("chunk", "fused_recurrent"):
        model.config.attn_mode = mode
        for layer in model.model.layers:
            layer.attn.mode = mode
        compiled, *actual = compiled_run(model, ids)
        assert_close(actual, expected)
        report = compiled.laplace_report
        assert [s.origin for s in report.sites] == [f"fla.{mode}_gla"] * 2
        assert all(s.status == "retiled" and s.form.startswith("chunked") for s in report.sites)
        # fla's gates, logsigmoid(x) / gate_logit_normalizer, are <= 0 by construction: no run-time check.
        assert {s.gates for s in report.sites} == {"<= 0 by construction: logsigmoid / 16"}
        (fla_calls,) = [p for p in report.passes if p.name == "fla_calls"]
        assert fla_calls.declined == [] and fla_calls.summary == "no fla call left to fla"


def test_other_flags_match_the_reference():
    """Short convolutions, unfused norm and SwiGLU, fused linear cross entropy: the other kernels fla can call."""
    model = fla_model(use_short_conv=True, fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False,
                      fuse_linear_cross_entropy=True)
    ids = tokens(2, 200, seed=1)
    expected = reference_run(model, ids)
    model.zero_grad(set_to_none=True)
    compiled = laplace_passes.compile(model, target="cpu")
    loss = compiled(input_ids=ids, labels=ids).loss  # fused linear cross entropy returns no logits
    loss.backward()
    assert relative_rmse(loss, expected[1]) <= MAX_RELATIVE_RMSE
    for name, grad in _grads(model).items():
        assert relative_rmse(grad, expected[2][name]) <= MAX_RELATIVE_RMSE, name


def test_training_matches_the_reference_step_by_step():
    ids = tokens(2, 128, seed=2)
    models = [fla_model(seed=3), fla_model(seed=3)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    compiled = laplace_passes.compile(models[0], target="cpu")
    losses = []
    for _ in range(24):
        step_losses = []
        for model, run, optimizer in zip(models, (compiled, None), optimizers):
            optimizer.zero_grad(set_to_none=True)
            if run is None:
                loss = reference.cross_entropy(reference.forward(model, ids)[0], ids)
            else:
                loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
    for step, (laplace_loss, reference_loss) in enumerate(losses):
        assert abs(laplace_loss - reference_loss) <= 1e-5 * abs(reference_loss), step
    assert losses[-1][0] < 0.8 * losses[0][0]
    # AdamW divides each gradient by its running RMS, so 1e-6 gradient differences of entries whose
    # gradients are near zero grow into larger weight differences over the steps.
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert relative_rmse(p, q) <= 1e-4, name


def test_greedy_generate_gives_the_reference_tokens_and_decodes_recurrently():
    model = fla_model(seed=4).eval()
    prompt = tokens(2, 40, seed=5)
    report = laplace_passes.Report()
    laplace_passes.fla.install(import_fla=True)
    model.compile(backend="laplace", options={"target": "trn2", "report": report})
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, do_sample=False)
        expected = reference.greedy_generate(model, prompt, 8)
    assert torch.equal(out, expected)
    decode = [s for s in report.sites if s.plan["T"] == 1]
    assert decode and all(s.form.startswith("recurrent") and s.plan["padding"] == 0 for s in decode)
    prefill = [s for s in report.sites if s.plan["T"] == 40]
    assert prefill and all(s.form.startswith("chunked") for s in prefill)
    # No padded chunk in the decode graphs: the chunk-loop op never reaches them.
    decode_graphs = {s.graph for s in decode}
    for name in decode_graphs:
        targets = {str(n.target) for n in report.graph("after", name).graph.nodes}
        assert not any("chunked_gla" in t for t in targets), targets


def test_auto_classes_build_a_model_that_compiles():
    transformers = pytest.importorskip("transformers")
    config = fla_models.GLAConfig(**TINY)
    torch.manual_seed(6)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "GLAForCausalLM"
    ids = tokens(1, 96, seed=7)
    with torch.no_grad():
        logits = laplace_passes.compile(model, target="cpu")(input_ids=ids).logits
        expected, _ = reference.forward(model, ids)
    assert relative_rmse(logits, expected) <= MAX_RELATIVE_RMSE


def test_stablehlo_export_has_no_custom_call_and_no_loop(tmp_path):
    pytest.importorskip("torch_mlir")
    pytest.importorskip("iree.compiler")  # parses the files back
    from tests.neuron_clean import assert_neuron_clean

    model = fla_model(seed=8)
    exported = laplace_passes.export_stablehlo(model, tokens(1, 256, seed=9), target="trn2", out_dir=tmp_path)
    kinds = sorted(entry["kind"] for entry in exported.manifest["graphs"])
    assert kinds == ["backward", "forward"]
    for entry in exported.manifest["graphs"]:
        text = (tmp_path / entry["file"]).read_text()
        assert "stablehlo.custom_call" not in text and "stablehlo.while" not in text, entry["file"]
        assert_neuron_clean(tmp_path / entry["file"])  # no f64, arith, dynamic_iota, ?; i64 from the ids only


def test_iree_runs_the_fla_model_like_eager():
    """The inference graph (logits and loss) as StableHLO compiled and run by IREE."""
    pytest.importorskip("iree.runtime")
    model = fla_model(seed=10)
    ids = tokens(1, 96, seed=11)
    with torch.no_grad():
        out = laplace_passes.compile(model, target="cpu", inner="iree")(input_ids=ids, labels=ids)
        logits, _ = reference.forward(model, ids)
    assert relative_rmse(out.logits, logits) <= 1e-5
    assert relative_rmse(out.loss, reference.cross_entropy(logits, ids)) <= 1e-5
