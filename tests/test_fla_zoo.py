"""fla's GLAForCausalLM in model_zoo: built by name, inspected, exported and trained from the CLI."""

import json

import pytest
import torch

import laplace_passes
import model_zoo
from laplace_passes.tools.cli import main
from tests.gla_cases import relative_rmse

pytest.importorskip("fla.models")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo keeps at most 8 compiles per code object (fla's forward methods), across model instances."""
    torch._dynamo.reset()


def test_fla_configs_build_fla_models_and_the_1_3b_shape_lives_on_meta():
    tiny = model_zoo.build("fla-gla-tiny")
    assert type(tiny).__name__ == "GLAForCausalLM" and not tiny.config.use_short_conv
    assert (tiny.config.fuse_norm, tiny.config.fuse_swiglu, tiny.config.fuse_cross_entropy) == (True, True, True)
    big = model_zoo.build("fla-gla-1.3b")
    assert {p.device.type for p in big.parameters()} == {"meta"}
    assert 1.3e9 < sum(p.numel() for p in big.parameters()) < 1.4e9
    with pytest.raises(ValueError, match="fla's GLAForCausalLM"):
        model_zoo.config("fla-gla-tiny")


def test_inspect_the_1_3b_shape_on_meta():
    model = model_zoo.build("fla-gla-1.3b", num_hidden_layers=2)
    report = laplace_passes.inspect(model, torch.zeros(1, 256, dtype=torch.long, device="meta"))
    assert [(s.origin, s.status, s.plan["n_chunks"]) for s in report.sites] == [("fla.chunk_gla", "retiled", 2)] * 2
    assert [g.kind for g in report.graphs] == ["dynamo", "forward", "backward"]


def test_cli_inspect_and_export_fla_gla_tiny(tmp_path, capsys):
    assert main(["inspect", "fla-gla-tiny", "--seq-len", "128", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["origin"] for s in data["sites"]] == ["fla.chunk_gla"] * 2
    assert main(["export", "fla-gla-tiny", "--stablehlo", str(tmp_path), "--seq-len", "96", "--inference"]) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [g["kind"] for g in manifest["graphs"]] == ["inference"]


def test_demo_trains_the_fla_model_on_mqar(capsys):
    assert main(["demo", "--model", "fla-gla-tiny", "--steps", "20", "--batch", "16", "--no-progress", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    losses = result["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2
    assert {s["origin"] for s in result["report_dict"]["sites"]} == {"fla.fused_recurrent_gla"}  # T = 64: fla's rule


def test_cli_inspect_and_demo_fla_retnet_and_hgrn2(capsys):
    """Two of fla's GLA-family models by name from the CLI: their sites re-tiled, the demo's loss falling."""
    assert main(["inspect", "fla-hgrn2-tiny", "--seq-len", "128", "--json"]) == 0
    sites = json.loads(capsys.readouterr().out)["sites"]
    assert [(s["origin"], s["status"]) for s in sites] == [("fla.chunk_gla", "retiled")] * 2
    assert main(["demo", "--model", "fla-retnet-tiny", "--steps", "20", "--batch", "16", "--no-progress",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert sum(result["losses"][-5:]) / 5 < sum(result["losses"][:5]) / 5 - 0.2
    sites = result["report_dict"]["sites"]
    assert {s["origin"] for s in sites} <= {"fla.chunk_retention", "fla.fused_recurrent_retention"}
    assert sites and all(s["status"] == "retiled" for s in sites)


@pytest.mark.parametrize("name", ["tiny", "small", "laplace-3b"])
def test_the_model_zoo_mlp_has_flas_gated_mlp_weights(name):
    """README (model zoo): fla's layer structure with a SwiGLU MLP: the same parameter names and shapes as
    fla 0.6.0's GatedMLP at fla's default intermediate size (2/3 of hidden_ratio * d, rounded up to 256)."""
    from fla.modules import GatedMLP

    config = model_zoo.config(name)
    ours = model_zoo.build(name, num_layers=1, device="meta").layers[0].mlp
    with torch.device("meta"):
        theirs = GatedMLP(config.hidden_size, hidden_ratio=config.hidden_ratio)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


@pytest.mark.parametrize("fuse_swiglu", [True, False])
def test_the_model_zoo_mlp_computes_flas_gated_mlp(fuse_swiglu):
    """The tiny model's MLP, its weights loaded by name into fla's GatedMLP, gives fla's outputs and gradients.
    fla's module runs compiled (Dynamo), where its swiglu kernels are replaced (Triton cannot run here)."""
    from fla.modules import GatedMLP

    torch.manual_seed(0)
    config = model_zoo.config("tiny")
    ours = model_zoo.build("tiny", num_layers=1).layers[0].mlp
    theirs = GatedMLP(config.hidden_size, hidden_ratio=config.hidden_ratio, fuse_swiglu=fuse_swiglu)
    theirs.load_state_dict(ours.state_dict())
    laplace_passes.fla.install(import_fla=True)
    x = torch.randn(2, 5, config.hidden_size)
    results = []
    for module in (ours, torch.compile(theirs, backend="eager", fullgraph=True)):
        xs = x.clone().requires_grad_()
        out = module(xs)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        weights = [p.grad for p in (module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)]
        results.append([out.detach(), xs.grad, *weights])
    for what, a, e in zip(["out", "dx", "d gate_proj", "d up_proj", "d down_proj"], *results):
        assert relative_rmse(a, e) <= 1e-5, what
