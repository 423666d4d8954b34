"""fla's GLA-family models (HGRN2, RetNet, RWKV6, GSA, LightNet) train and generate on the CPU, Triton-free.

Each tiny model (model_zoo's `fla-*-tiny`, fla's default flags) is compiled with backend="laplace" and
checked against the same weights run eagerly on fla's own reference code (`fla_family_oracle`): logits,
loss and every parameter gradient, at a length that takes fla's chunk path (80 > 64) and one that takes
its fused-recurrent path (24); greedy `generate` with fla's cache, token by token; a few training steps
lowering the loss on the trn2 target; and every recurrence a re-tiled site in the report.
"""

import pytest
import torch

import laplace_passes
import model_zoo
from tests.gla_cases import relative_rmse

pytest.importorskip("fla.models")
from tests.fla_family_oracle import reference_kernels  # noqa: E402

FAMILY = {  # model -> the origin of its sites
    "fla-hgrn2-tiny": "fla.chunk_gla",
    "fla-retnet-tiny": "fla.chunk_retention",
    "fla-rwkv6-tiny": "fla.chunk_rwkv6",
    "fla-gsa-tiny": "fla.chunk_gsa",
    "fla-lightnet-tiny": "fla.chunk_lightnet",
}


@pytest.fixture(autouse=True)
def fresh():
    laplace_passes.fla.install(import_fla=True)
    torch._dynamo.reset()


def build(name, seed=0):
    torch.manual_seed(seed)
    return model_zoo.build(name)


def tokens(B, T, seed=1):
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))


def training_step(model, ids, run):
    model.zero_grad(set_to_none=True)
    out = run(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                     if p.grad is not None}


@pytest.mark.parametrize("T", [80, 24])
@pytest.mark.parametrize("name", sorted(FAMILY))
def test_a_training_step_equals_fla_s_reference_code(name, T):
    model, ids = build(name), tokens(2, T)
    report = laplace_passes.Report()
    compiled = torch.compile(model, backend="laplace", options={"target": "cpu", "report": report})
    logits, loss, grads = training_step(model, ids, compiled)
    with reference_kernels():
        ref_logits, ref_loss, ref_grads = training_step(model, ids, model)
    assert relative_rmse(logits, ref_logits) < 1e-5
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for key in grads:
        assert relative_rmse(grads[key], ref_grads[key]) < 1e-4, key
    origins = {s.origin.split("[")[0] for s in report.sites}
    assert report.sites and all(s.status == "retiled" for s in report.sites)
    assert origins <= {FAMILY[name], FAMILY[name].replace("chunk_", "fused_recurrent_")}, origins


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_greedy_generate_with_fla_s_cache_gives_the_reference_tokens(name):
    model, prompt = build(name, seed=2).eval(), tokens(2, 12, seed=3)
    with torch.no_grad(), reference_kernels():
        expected = model.generate(prompt, max_new_tokens=5, do_sample=False)
    report = laplace_passes.Report()
    model.compile(backend="laplace", options={"target": "cpu", "report": report})
    with torch.no_grad():
        found = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(found, expected)
    assert {s.plan["T"] for s in report.sites} >= {1}  # the decode steps are sites too, recurrent form
    assert all(s.status == "retiled" for s in report.sites)


@pytest.mark.parametrize("T", [80, 24])
def test_fla_s_simple_gla_layer_with_its_short_convolution(T):
    """fla.layers.simple_gla.SimpleGatedLinearAttention, default flags (a short convolution, per-head gates):
    once FlaCallNotReplaced on chunk_local_cumsum."""
    from fla.layers.simple_gla import SimpleGatedLinearAttention

    torch.manual_seed(0)
    layer = SimpleGatedLinearAttention(hidden_size=64, num_heads=2)
    x = torch.randn(2, T, 64, requires_grad=True)
    report = laplace_passes.Report()
    compiled = torch.compile(layer, backend="laplace", options={"target": "cpu", "report": report})
    found = compiled(x)[0]
    found_grad = torch.autograd.grad(found.square().sum(), x)[0]
    with reference_kernels():
        expected = layer(x)[0]
        expected_grad = torch.autograd.grad(expected.square().sum(), x)[0]
    assert relative_rmse(found, expected) < 1e-5 and relative_rmse(found_grad, expected_grad) < 1e-4
    (site,) = report.sites
    assert site.status == "retiled" and site.origin.endswith("simple_gla")


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_command_that_crashed_each_model_now_trains(name):
    """Each model once crashed on this machine under exactly this command (FlaCallNotReplaced on
    rms_norm_linear, chunk_local_cumsum, rotary_embedding_fwdbwd, fused_additive_gate; Triton's "0 active
    drivers" from token_shift_fwd): now its loss and gradients are fla's reference's."""
    model, ids = build(name, seed=6), tokens(2, 80, seed=7)
    report = laplace_passes.Report()
    compiled = torch.compile(model, backend="laplace", options={"target": "trn2", "report": report})
    _, loss, grads = training_step(model, ids, compiled)
    with reference_kernels():
        _, ref_loss, ref_grads = training_step(model, ids, model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert max(relative_rmse(grads[key], ref_grads[key]) for key in grads) < 1e-4
    assert report.sites and all(s.status == "retiled" and s.plan["chunk_size"] == 128 for s in report.sites)
    # Training goes on through the same compiled graphs, which read the updated weights.
    assert train(model, compiled, ids, steps=4) < float(loss) - 0.1


def train(model, compiled, ids, steps: int) -> float:
    """The loss after `steps` AdamW steps of `compiled` on `ids`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        compiled(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return compiled(input_ids=ids, labels=ids).loss.item()
