"""What neuronx-cc receives: Neuron-clean StableHLO, the preflight's checks on it, the neuronx-cc command.

The exports are parsed back (IREE's own MLIR parser, not the one that wrote
them) and every value's type is read: no f64, no complex, no `?` dimension,
no op outside StableHLO, and i64 only where it comes from an i64 input.
"""


import pytest
import torch
from torch.testing import FileCheck

import laplace_passes
import model_zoo
from laplace_passes.lowering.hlo_checks import check_stablehlo, peak_memory, scan_stablehlo
from laplace_passes.lowering.neuron import neuronx_cc_command
from laplace_passes.lowering.stablehlo import lower_to_stablehlo
from laplace_passes.infra.targets import CPU, TRN1, TRN2, runtime_target
from tests.lm_cases import tokens
from tests.neuron_clean import assert_neuron_clean

for module in ("torch_mlir", "iree.compiler", "iree.runtime"):
    pytest.importorskip(module, reason="the lowering extra: pip install -e '.[lowering]'")

SEQ_LEN = 64  # one (padded) chunk on trn2: the graphs have every kind of op, and lower quickly


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


def test_exports_have_no_f64_arith_dynamic_iota_or_dynamic_dims(tmp_path):
    """The small model (one layer); tiny and fla-gla-tiny: tests/test_lowering.py and tests/test_fla_model.py."""
    torch.manual_seed(0)
    model = model_zoo.build("small", num_layers=1)
    exported = laplace_passes.export_stablehlo(model, tokens(SEQ_LEN), target="trn2", out_dir=tmp_path)
    assert sorted(g["kind"] for g in exported.manifest["graphs"]) == ["backward", "forward"]
    for entry in exported.manifest["graphs"]:
        assert_neuron_clean(tmp_path / entry["file"])
        # The bytecode is the same module: it parses back to the text.
        from torch_mlir import ir
        from torch_mlir._mlir_libs import _stablehlo

        context = ir.Context()
        _stablehlo.register_dialect(context)
        parsed = ir.Module.parse((tmp_path / entry["bytecode"]).read_bytes(), context)
        assert str(parsed) == (tmp_path / entry["file"]).read_text()
    folds = [p for p in exported.report.passes if p.name == "fold_index_constants"]
    assert folds and all(p.summary.split()[0].isdigit() for p in folds)  # GLA's masks were folded


def scalars_and_index_math(x, n):
    """Python float scalars, arange // 4, a negative integer floor division, clamp: what torch-mlir puts f64 into."""
    pos = torch.arange(x.shape[-1], device=x.device)
    decay = torch.exp(-0.25 * pos.to(x.dtype)) + (pos // 4).to(x.dtype)
    floor = torch.div(n - 7, 4, rounding_mode="floor").to(x.dtype)  # n - 7 < 0 for n < 7
    y = torch.clamp(x * decay + 1e-6, min=-30.0) / 16.0
    return y.sum(-1) + floor.sum()


def test_iree_equals_eager_after_the_legalisation():
    x = torch.randn(4, 16)
    n = torch.arange(-20, 12, dtype=torch.int64)
    expected = scalars_and_index_math(x, n)
    got = laplace_passes.compile(scalars_and_index_math, target="cpu", inner="iree")(x, n)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(scalars_and_index_math, tracing_mode="fake")(x, n)
    text = lower_to_stablehlo(gm).text
    for forbidden in ("f64", "arith.", "dynamic_iota"):
        assert forbidden not in text
    # The floor division is integer arithmetic now: truncating divide and remainder, corrected below zero.
    FileCheck().check("stablehlo.divide").check("stablehlo.remainder").check("LT,").run(text)


# -- the preflight's StableHLO checks ---------------------------------------------------------------

F64_CONSTANT = """
func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  %cst = stablehlo.constant dense<2.5> : tensor<4xf64>
  %0 = stablehlo.convert %cst : (tensor<4xf64>) -> tensor<4xf32>
  %1 = stablehlo.add %arg0, %0 : tensor<4xf32>
  return %1 : tensor<4xf32>
}
"""
DYNAMIC_DIM = """
func.func @main(%arg0: tensor<4x8xf32>, %arg1: tensor<1xi64>) -> tensor<?xf32> {
  %0 = stablehlo.dynamic_iota %arg1, dim = 0 : (tensor<1xi64>) -> tensor<?xf32>
  return %0 : tensor<?xf32>
}
"""
# 1024 x 1024 f32 = 4 MiB per value; the input, then two intermediates live together: 12 MiB at %1.
THREE_BUFFERS = """
func.func @main(%arg0: tensor<1024x1024xf32>) -> tensor<1024xf32> {
  %0 = stablehlo.multiply %arg0, %arg0 : tensor<1024x1024xf32>
  %1 = stablehlo.add %0, %arg0 : tensor<1024x1024xf32>
  %2 = stablehlo.reduce(%1 init: %cst) applies stablehlo.add across dimensions = [1] : (tensor<1024x1024xf32>, tensor<f32>) -> tensor<1024xf32>
  return %2 : tensor<1024xf32>
}
"""
MIB = 2**20


def test_an_f64_constant_is_a_stablehlo_finding():
    (finding,) = check_stablehlo(F64_CONSTANT, TRN2, "forward_0")
    assert (finding.check, finding.graph, finding.node, finding.op) == (
        "stablehlo-dtype", "forward_0", "%cst", "stablehlo.constant")
    assert "produces tensor<4xf64>; no NeuronCore has f64 or complex types" in finding.message
    assert finding.fix.startswith("compute in float32 or bfloat16")


def test_a_dynamic_dimension_is_a_stablehlo_finding():
    (finding,) = check_stablehlo(DYNAMIC_DIM, TRN2, "g")
    assert (finding.check, finding.node, finding.op) == ("stablehlo-dynamic", "%0", "stablehlo.dynamic_iota")
    assert "static shapes" in finding.fix


def test_peak_memory_counts_inputs_and_live_intermediates():
    arguments, peak, at_peak = peak_memory(scan_stablehlo(THREE_BUFFERS))
    assert (arguments, peak, at_peak.result) == (4 * MIB, 8 * MIB, "%1")  # %0 dies after %1 reads it
    assert check_stablehlo(THREE_BUFFERS, TRN2.with_overrides(hbm_bytes_per_core=12 * MIB)) == []
    (finding,) = check_stablehlo(THREE_BUFFERS, TRN2.with_overrides(hbm_bytes_per_core=12 * MIB - 1), "backward_0")
    assert (finding.check, finding.graph, finding.node, finding.op) == ("hbm-estimate", "backward_0", "%1", "stablehlo.add")
    assert "inputs of 4.00 MiB plus a peak of 8.00 MiB" in finding.message and "NCC_EOOM001" in finding.message


def test_a_graph_over_the_hbm_estimate_through_the_preflight():
    def big(x):
        return (x @ x.T).exp().sum()

    x = torch.randn(512, 512)
    assert laplace_passes.preflight(big, x, target=TRN2).ok
    report = laplace_passes.preflight(big, x, target=TRN2.with_overrides(hbm_bytes_per_core=2 * MIB))
    (finding,) = report.findings
    assert finding.check == "hbm-estimate" and finding.graph == "inference_0"
    assert "pass trn2's 2.00 MiB of HBM per logical core" in finding.message


def test_the_hbm_estimate_follows_the_runtimes_logical_core_config(monkeypatch):
    """NEURON_LOGICAL_NC_CONFIG=1 on trn2: one physical core per logical core, half the HBM of the default 2."""
    def big(x):
        return (x @ x.T).exp().sum()

    x, target = torch.randn(512, 512), TRN2.with_overrides(hbm_bytes_per_core=4 * MIB)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert laplace_passes.preflight(big, x, target=target).ok
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    (finding,) = laplace_passes.preflight(big, x, target=target).findings
    assert finding.check == "hbm-estimate"
    assert "pass trn2's 2.00 MiB of HBM per logical core at --lnc 1" in finding.message


def test_other_stablehlo_findings():
    text = """
func.func @main(%arg0: tensor<4x4xi32>) -> tensor<4x4xi32> {
  %0 = stablehlo.dot_general %arg0, %arg0, contracting_dims = [1] x [0] : (tensor<4x4xi32>, tensor<4x4xi32>) -> tensor<4x4xi32>
  %1 = stablehlo.custom_call @my_kernel(%0) : (tensor<4x4xi32>) -> tensor<4x4xi32>
  %2 = stablehlo.custom_call @AwsNeuronSoftmax(%1) : (tensor<4x4xi32>) -> tensor<4x4xi32>
  %3 = arith.addi %2, %2 : tensor<4x4xi32>
  return %3 : tensor<4x4xi32>
}
"""
    checks = [(f.check, f.node) for f in check_stablehlo(text, TRN2)]
    assert checks == [("stablehlo-integer-dot", "%0"), ("stablehlo-custom-call", "%1"), ("stablehlo-op", "%3")]


def test_a_case_and_an_if_are_control_flow_findings():
    text = """
func.func @main(%arg0: tensor<i32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
  %0 = "stablehlo.case"(%arg0) ({
    stablehlo.return %arg1 : tensor<4xf32>
  }, {
    stablehlo.return %arg1 : tensor<4xf32>
  }) : (tensor<i32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""
    (finding,) = check_stablehlo(text, TRN2, "g")
    assert (finding.check, finding.node, finding.op) == ("stablehlo-control-flow", "%0", "stablehlo.case")
    assert "does not implement control flow" in finding.message and "select" in finding.fix


# -- the neuronx-cc command -------------------------------------------------------------------------


def test_neuronx_cc_command_for_trn1_and_trn2(monkeypatch):
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    assert neuronx_cc_command("out/forward_0.mlirbc", target="trn2") == [
        "neuronx-cc", "compile", "out/forward_0.mlirbc", "--framework", "XLA", "--target", "trn2", "--lnc", "2",
        "-O2", "--model-type", "transformer", "--auto-cast=none", "--output", "out/forward_0.neff",
    ]
    trn1 = neuronx_cc_command("g.mlirbc", target="trn1")
    assert trn1[trn1.index("--target"):trn1.index("--target") + 4] == ["--target", "trn1", "--lnc", "1"]
    assert TRN1.logical_cores == 1 and TRN2.logical_cores == 2


def test_neuronx_cc_command_follows_the_runtimes_logical_core_config(monkeypatch):
    """A NEFF loads only at the runtime's LNC: NEURON_LOGICAL_NC_CONFIG sets --lnc, as in TorchNeuron."""
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    command = neuronx_cc_command("g.mlirbc", target="trn2")
    assert command[command.index("--lnc"):command.index("--lnc") + 2] == ["--lnc", "1"]
    assert runtime_target("trn2").hbm_bytes_per_core == TRN2.hbm_bytes_per_core // 2
    assert runtime_target("cpu") is CPU  # not a Neuron target: unchanged
    explicit = neuronx_cc_command("g.mlirbc", target="trn2", env={"NEURON_LOGICAL_NC_CONFIG": "2"})
    assert explicit[explicit.index("--lnc") + 1] == "2"
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(ValueError, match=r"NEURON_LOGICAL_NC_CONFIG='2': trn1 takes a logical NeuronCore "
                                         r"config \(--lnc\) of 1, not 2"):
        neuronx_cc_command("g.mlirbc", target="trn1")
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG='two'"):
        runtime_target("trn2", env={"NEURON_LOGICAL_NC_CONFIG": "two"})


def test_neuron_cc_flags_come_last(monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", "--auto-cast=matmult  --verbose 'info level'")
    command = neuronx_cc_command("g.mlirbc", target="trn2", extra_flags=("-O1",))
    assert command[-7:] == ["--auto-cast=none", "-O1", "--auto-cast=matmult", "--verbose", "info level",
                            "--output", "g.neff"]


def test_input_independent_masks_are_folded_into_constants():
    from torch.fx.experimental.proxy_tensor import make_fx

    from laplace_passes.lowering.fold_constants import FoldIndexConstants

    def masked(scores):  # an index mask: which 4-column block comes before each row's block
        earlier = (torch.arange(16) // 4)[None, :] < torch.arange(4)[:, None]
        return torch.where(earlier, scores, 0.0) + torch.eye(4, 16)

    x = torch.randn(4, 16)
    gm = make_fx(masked, tracing_mode="fake")(x)
    outcome = FoldIndexConstants()(gm)
    assert outcome.modified and outcome.summary.startswith("2 input-independent subgraph(s)")
    FileCheck().check_not("iota").check_not("arange").check("_folded_").check("aten.where").run(gm.code)
    assert torch.equal(gm(x), masked(x))


def test_tensor_engine_use_counts_whole_tiles_and_small_products():
    from torch.fx.experimental.proxy_tensor import make_fx

    from laplace_passes.unroll.tiles import tile_use

    def two_products(a, b, c, d):
        return (a @ b).sum() + torch.bmm(c, d).sum()

    shapes = [(256, 128), (128, 64), (4, 16, 32), (4, 32, 128)]
    gm = make_fx(two_products, tracing_mode="fake")(*(torch.randn(s) for s in shapes))
    use = tile_use(gm)
    whole = 2 * 256 * 128 * 64  # K = 128 and max(M, N) = 256: whole tiles
    small = 2 * 4 * 16 * 32 * 128  # K = 32: every product small
    assert (use.matmul_flops, use.whole_tile_flops, use.small_products, use.products) == (whole + small, whole, 4, 5)
    assert use.whole_tile_share == whole / (whole + small)
    report = laplace_passes.inspect(two_products, *(torch.randn(s) for s in shapes), target="trn2")
    assert report.graph_record("inference_0").size.small_products == 4
    assert "whole-tile mm" in str(report) and f"{whole / (whole + small):.0%}" in str(report)
