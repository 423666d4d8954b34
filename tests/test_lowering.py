"""Lowering: StableHLO export, execution through IREE on the CPU, the hand-off to TorchNeuron.

The IREE tests run the tiny GLA model's forward and backward ATen graphs as
StableHLO compiled by IREE and compare with eager PyTorch (the token-by-token
recurrence): outputs, gradients and one optimizer step.
"""

import copy
import json
import re
import sys
import types
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import laplace_passes
import model_zoo
from laplace_passes.lowering import _deps, neuron
from laplace_passes.lowering.calibrate import stablehlo_instructions
from laplace_passes.lowering.diagnose import LoweringError
from laplace_passes.lowering.legalize import BoundSliceScatter, ClampGateChecks, DiagonalAsStridedSlice
from laplace_passes.lowering.neuron import NO_FALLBACK_ENV, NeuronUnavailableError, neuron_compiler, neuronx_cc_command
from laplace_passes.lowering.stablehlo import lower_to_stablehlo, torch_mlir_decompositions
from laplace_passes.ops.gla import gla_recurrence
from laplace_passes.infra.targets import TRN2
from laplace_passes.unroll import SizeModel
from tests.gla_cases import relative_rmse
from tests.lm_cases import lm_loss, loss_and_grads, tokens
from tests.neuron_clean import assert_neuron_clean

for module in ("torch_mlir", "iree.compiler", "iree.runtime"):
    pytest.importorskip(module, reason="the lowering extra: pip install -e '.[lowering]'")

# fp32 throughout; the lowered graph only reorders sums.
MAX_RELATIVE_RMSE = 1e-4
# Small enough that the budget pass cuts a 16-token GLA call (the recurrent form: no gradient) into a few
# partitions, 3 at this writing: each is its own IREE compile (15 of them at 64 tokens took 30 s).
PARTITION_BUDGET = 40


def assert_matches_eager(model, compiled, ids):
    expected_logits, expected_grads = loss_and_grads(model, ids)
    logits, grads = loss_and_grads(model, ids, compiled)
    assert relative_rmse(logits, expected_logits) <= MAX_RELATIVE_RMSE
    errors = {name: relative_rmse(grads[name], expected_grads[name]) for name in expected_grads}
    assert max(errors.values()) <= MAX_RELATIVE_RMSE, errors


def assert_report_shows_lowering(report):
    assert report.inner == "iree"
    lowered = [p for p in report.passes if p.name == "lower_to_stablehlo"]
    assert [p.graph for p in lowered] == ["forward_0", "backward_0"]
    assert all(re.fullmatch(r"\d+ StableHLO ops \(.*\); 0 while, 0 custom_call", p.summary) for p in lowered)


@pytest.fixture(scope="module")
def iree_tiny_256():
    """The tiny model and its inner="iree" compile at T=256, 2 chunks (IREE compiles once per module; at 4 chunks
    its compile took twice as long, for the same state passed between chunks)."""
    torch.manual_seed(1)
    model = model_zoo.build("tiny")
    return model, laplace_passes.compile(model, target="trn2", inner="iree")


def test_iree_matches_eager_at_256_tokens(iree_tiny_256):
    model, compiled = iree_tiny_256
    assert_matches_eager(model, compiled, tokens(256, seed=1))
    assert_report_shows_lowering(compiled.laplace_report)
    assert [s.plan["n_chunks"] for s in compiled.laplace_report.sites] == [2, 2]


def test_one_training_step_through_iree_equals_one_eager_step(iree_tiny_256):
    model, compiled = iree_tiny_256
    reference = copy.deepcopy(model)
    ids = tokens(256, seed=2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    def step(module, run):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(run(ids), ids)
        loss.backward()
        optimizer.step()
        return loss.detach()

    iree_loss, eager_loss = step(model, compiled), step(reference, reference)
    assert relative_rmse(iree_loss, eager_loss) <= MAX_RELATIVE_RMSE
    for name, p in reference.named_parameters():
        eager_update = p.detach() - before[name]
        iree_update = dict(model.named_parameters())[name].detach() - before[name]
        assert eager_update.abs().max() > 0, name  # every parameter trains
        assert relative_rmse(iree_update, eager_update) <= MAX_RELATIVE_RMSE, name


def test_positive_gates_are_clamped_in_lowered_graphs():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen) for _ in range(3))
    gk = torch.randn(1, 16, 2, 8, generator=gen)  # about half positive: invalid gates

    def attention(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    with pytest.raises(ValueError, match="gk must be <= 0 everywhere"):
        attention(q, k, v, gk)  # eagerly refused
    compiled = laplace_passes.compile(attention, target="cpu", inner="iree")
    with torch.no_grad():
        got = compiled(q, k, v, gk)
    expected = attention(q, k, v, gk.clamp(max=0))
    assert relative_rmse(got, expected) <= MAX_RELATIVE_RMSE
    (clamp,) = [p for p in compiled.laplace_report.passes if p.name == "clamp_gate_checks"]
    assert clamp.modified and clamp.summary.startswith("1 gate check(s) replaced by clamp(max=0)")


def _decay_loop(decay_of):
    """A linear recurrence written from the equations with the decay `decay_of(x)`: recognised as a GLA loop, its
    gates log(decay) not proven <= 0."""
    def loop(q, k, v, x):
        decay = decay_of(x)
        state, outputs = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3]), []
        for t in range(q.shape[1]):
            state = decay[:, t, :, :, None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
            outputs.append((q[:, t, :, :, None] * state).sum(-2))
        return torch.stack(outputs, 1)
    return loop


@pytest.mark.parametrize("decay_of", [lambda x: 1.5 * torch.sigmoid(x), torch.tanh], ids=["above_1", "below_0"])
def test_a_recognised_loop_whose_decay_leaves_0_1_keeps_its_numbers_when_lowered(decay_of):
    """A lowered graph cannot refuse a positive gate (its check becomes a clamp: a decay above 1 was clamped to 1)
    and the log of a negative decay is NaN: such a loop is kept as written, declined with the reason. Outputs and
    gradients are the loop's, where the clamp changed them or gave NaN."""
    loop = _decay_loop(decay_of)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, 12, 2, 4, generator=gen, requires_grad=True) for _ in range(4)]
    compiled = laplace_passes.compile(loop, target="trn2", inner="stablehlo")
    found = compiled(*inputs)
    found_grads = torch.autograd.grad(found.square().sum(), inputs)
    expected = loop(*inputs)
    expected_grads = torch.autograd.grad(expected.square().sum(), inputs)
    assert relative_rmse(found, expected) <= MAX_RELATIVE_RMSE
    assert all(relative_rmse(f, e) <= MAX_RELATIVE_RMSE for f, e in zip(found_grads, expected_grads))
    assert not compiled.laplace_report.sites
    (row,) = compiled.laplace_report.recurrences
    assert row.status == "declined" and "the inner compiler lowers, where a gate check becomes a clamp" in row.reason
    assert row.reason.endswith("kept as written"), row.reason


def test_a_site_of_another_recognised_form_with_unproven_gates_keeps_its_token_steps_when_lowered():
    """The re-tiling pass's own guard (a site whose origin is a recognised form, not a call): the token
    recurrence, unchecked, for the gates as they are; declined with the reason."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen) for _ in range(3))
    gk = 0.1 * torch.randn(1, 16, 2, 8, generator=gen)  # some gates positive

    def site(q, k, v, gk):
        return torch.ops.laplace.gla.default(q, k, v, gk, None, 8 ** -0.5, "chunked loop, written by hand")[0]

    compiled = laplace_passes.compile(site, target="trn2", inner="stablehlo")
    with torch.no_grad():
        found = compiled(q, k, v, gk)
    expected = gla_recurrence(q, k, v, gk, None, 8 ** -0.5)[0]
    assert relative_rmse(found, expected) <= MAX_RELATIVE_RMSE
    (record,) = compiled.laplace_report.sites
    assert record.status == "declined" and "a lowered graph cannot refuse a positive one" in record.reason
    assert record.form == "the loop's 16 token steps, unchecked"


@pytest.mark.parametrize("origin", ["laplace.gla", "fla.chunk_gla[cu_seqlens]", "fla.chunk_gsa[slots]"])
def test_a_gla_call_keeps_its_clamp_when_lowered_whatever_its_origin_says(origin):
    """A call of a GLA function, fla's with what it was made of in brackets, is re-tiled with its check lowered
    as a clamp (gates <= 0 are its contract): only a recognised loop keeps its token steps."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen) for _ in range(3))
    gk = -torch.rand(1, 16, 2, 8, generator=gen)  # valid, but an input: not proven <= 0

    def call(q, k, v, gk):
        return torch.ops.laplace.gla.default(q, k, v, gk, None, 8 ** -0.5, origin)[0]

    compiled = laplace_passes.compile(call, target="trn2", inner="stablehlo")
    with torch.no_grad():
        assert relative_rmse(compiled(q, k, v, gk), call(q, k, v, gk)) <= MAX_RELATIVE_RMSE
    (site,) = compiled.laplace_report.sites
    assert site.status == "retiled" and site.gates.startswith("checked at run time"), (site.status, site.gates)
    (clamp,) = [p for p in compiled.laplace_report.passes if p.name == "clamp_gate_checks"]
    assert clamp.summary.startswith("1 gate check(s) replaced by clamp(max=0)")


# -- export ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    out_dir = tmp_path_factory.mktemp("stablehlo")
    return laplace_passes.export_stablehlo(model_zoo.build("tiny"), tokens(256), target="trn2", out_dir=out_dir)


def parse_with_iree(path):
    """The exported file parsed by IREE's own MLIR (not torch-mlir's, which wrote it)."""
    from iree.compiler import ir

    return ir.Module.parse(path.read_text(), ir.Context())


def test_export_writes_one_file_per_graph_and_a_manifest(exported):
    manifest = json.loads((exported.out_dir / "manifest.json").read_text())
    assert manifest == exported.manifest
    assert [(g["name"], g["kind"], g["file"]) for g in manifest["graphs"]] == [
        ("forward_0", "forward", "forward_0.mlir"), ("backward_0", "backward", "backward_0.mlir"),
    ]
    assert sorted(p.name for p in exported.out_dir.iterdir()) == [
        "backward_0.mlir", "backward_0.mlirbc", "forward_0.mlir", "forward_0.mlirbc", "manifest.json"]
    assert manifest["target"] == "trn2" and manifest["versions"]["torch-mlir"] == "20261001"
    checked_gates = any(s.gates.startswith("checked at run time") for s in exported.report.sites)
    assert any("clamp(gk, max=0)" in note for note in manifest["notes"]) == checked_gates
    assert manifest["graphs"][0]["bytecode"] == "forward_0.mlirbc"
    assert manifest["graphs"][0]["neuronx_cc"] == (
        "neuronx-cc compile forward_0.mlirbc --framework XLA --target trn2 --lnc 2 -O2 --model-type transformer "
        "--auto-cast=none --output forward_0.neff"
    )


def test_an_export_for_neuron_carries_the_preflight_s_findings(tmp_path):
    """The Neuron preflight's checks run on the exported graphs: the same findings as a separate
    `laplace_passes.preflight` of the same model (float64 here), in the manifest and on the export; a clean
    model gets an empty list; a target that is not Neuron's gets no such entry."""
    torch.manual_seed(0)
    in_double = torch.nn.Linear(4, 4).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    exported = laplace_passes.export_stablehlo(in_double, x, target="trn2", out_dir=tmp_path / "double")
    separate = laplace_passes.preflight(in_double, x, target="trn2")
    # Its graphs' own findings (its list also names the float64 parameters and inputs the model is given).
    graph_checks = [(f.check, f.graph, f.node) for record in separate.report.passes
                    if record.name == "neuron_preflight" for f in record.findings]
    assert graph_checks and [(f.check, f.graph, f.node) for f in exported.findings] == graph_checks
    assert exported.manifest["neuron_preflight"] == [str(f) for f in exported.findings]
    clean = laplace_passes.export_stablehlo(torch.nn.Linear(4, 4), torch.randn(3, 4), target="trn2",
                                            out_dir=tmp_path / "clean")
    assert clean.findings == [] and clean.manifest["neuron_preflight"] == []
    cpu = laplace_passes.export_stablehlo(torch.nn.Linear(4, 4), torch.randn(3, 4), target="cpu",
                                          out_dir=tmp_path / "cpu")
    assert "neuron_preflight" not in cpu.manifest and cpu.findings == []


def test_the_manifest_notes_only_what_applies_to_its_modules(tmp_path):
    """A model computing in float64 is noted (neuronx-cc has no FP64); a model without GLA gets no gate note;
    a GLA site whose gates are checked at run time gets the note that the lowering clamps them."""
    torch.manual_seed(0)
    in_double = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).double().eval()
    notes = laplace_passes.export_stablehlo(in_double, torch.randn(3, 4, dtype=torch.float64), target="trn2",
                                            out_dir=tmp_path / "double").manifest["notes"]
    assert len(notes) == 1 and notes[0].startswith("forward_0, backward_0 compute in float64") and "no FP64" in notes[0]
    plain = torch.nn.Linear(4, 4).eval()
    assert laplace_passes.export_stablehlo(plain, torch.randn(3, 4), target="trn2",
                                           out_dir=tmp_path / "plain").manifest["notes"] == []

    def gla_layer(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    inputs = [torch.randn(1, 16, 1, 4), torch.randn(1, 16, 1, 4), torch.randn(1, 16, 1, 4), -torch.rand(1, 16, 1, 4)]
    notes = laplace_passes.export_stablehlo(gla_layer, *inputs, target="trn2", out_dir=tmp_path / "gla").manifest["notes"]
    assert len(notes) == 1 and "clamp(gk, max=0)" in notes[0]


def test_exported_stablehlo_has_no_while_and_no_gla_custom_call(exported):
    for entry in exported.manifest["graphs"]:
        assert_neuron_clean(exported.path(entry["name"]))  # no f64, arith, dynamic_iota, ?; i64 from the ids only
        text = exported.path(entry["name"]).read_text()
        FileCheck().check("func.func @main").check("stablehlo.dot_general").run(text)
        FileCheck().check_not("stablehlo.while").run(text)
        FileCheck().check_not("custom_call").run(text)
        FileCheck().check_not("gla").run(text)


def test_manifest_op_counts_match_the_files(exported):
    for entry in exported.manifest["graphs"]:
        generic = parse_with_iree(exported.path(entry["name"])).operation.get_asm(print_generic_op_form=True)
        counts = Counter(re.findall(r'"([a-z_]+\.[a-z_0-9.]+)"\(', generic))
        del counts["builtin.module"]
        assert entry["op_counts"] == dict(sorted(counts.items()))
        assert entry["total_ops"] == sum(counts.values())
        assert counts["stablehlo.dot_general"] > 0 and "stablehlo.while" not in counts


def test_manifest_inputs_and_outputs_match_the_files_and_graphs(exported):
    from iree.compiler import ir

    element = {"f32": "float32", "i64": "int64", "i1": "bool"}
    for entry in exported.manifest["graphs"]:
        module = parse_with_iree(exported.path(entry["name"]))
        (main,) = [op for op in module.body.operations if op.operation.name == "func.func"]
        signature = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        for specs, types_ in ((entry["inputs"], signature.inputs), (entry["outputs"], signature.results)):
            files = [(list(ir.RankedTensorType(t).shape), element[str(ir.RankedTensorType(t).element_type)])
                     for t in types_]
            assert files == [(s["shape"], s["dtype"]) for s in specs]
        graph = exported.report.graph("after", entry["name"])
        assert [s["name"] for s in entry["inputs"]] == [n.name for n in graph.graph.find_nodes(op="placeholder")]
    forward_inputs = exported.manifest["graphs"][0]["inputs"]
    # The token ids, named as the user passed them; every other input a parameter by its module path.
    (ids,) = [s for s in forward_inputs if s["source"] == "args[0]"]
    assert (ids["shape"], ids["dtype"]) == ([1, 256], "int64")
    model_names = {f"module.{name}" for name, _ in model_zoo.build("tiny", device="meta").named_parameters()}
    assert {s["source"] for s in forward_inputs} - {"args[0]"} <= model_names
    assert all("source" not in s for s in exported.manifest["graphs"][1]["inputs"])  # a backward: no user names


def test_size_estimate_agrees_with_the_same_formula_on_the_stablehlo(exported):
    """The budget's estimate is made on ATen graphs; neuronx-cc gets their StableHLO (calibration, unroll/size.py)."""
    model = SizeModel.for_target(TRN2)
    for entry in exported.manifest["graphs"]:
        aten_estimate = model.measure(exported.report.graph("after", entry["name"])).instructions
        hlo_estimate = stablehlo_instructions(exported.path(entry["name"]).read_text(), model)
        assert abs(aten_estimate - hlo_estimate) <= 0.05 * hlo_estimate, (entry["name"], aten_estimate, hlo_estimate)


def test_stablehlo_tile_formula_on_each_kind_of_op():
    text = """
    %0 = stablehlo.constant dense<1.0> : tensor<256x1024xf32>
    %1 = stablehlo.reshape %arg0 : (tensor<4x256x1024xf32>) -> tensor<1024x1024xf32>
    %2 = stablehlo.dot_general %a, %b, batching_dims = [0] x [0], contracting_dims = [2] x [1] : (tensor<3x200x300xf32>, tensor<3x300x1000xf32>) -> tensor<3x200x1000xf32>
    %3 = stablehlo.multiply %1, %1 : tensor<1024x1024xf32>
    %4 = stablehlo.reduce(%3 init: %c) applies stablehlo.add across dimensions = [1] : (tensor<1024x1024xf32>, tensor<f32>) -> tensor<1024xf32>
    %5 = stablehlo.add %x, %y : tensor<f32>
    return %4 : tensor<1024xf32>
    """
    # dot_general: 3 batches * ceil(300/128) * ceil(200/128) * ceil(1000/512) = 3 * 3 * 2 * 2;
    # multiply and reduce: 2^20 elements = 16 tiles of 128 x 512 each; a scalar add: 1; layout ops: 0.
    assert stablehlo_instructions(text, SizeModel(128, 512)) == 36 + 16 + 16 + 1


def test_manifest_outputs_say_what_each_one_is(exported):
    """tiny's training step: the forward returns the logits to the user and the rest to the backward, whose
    outputs are gradients of the forward's inputs, each of its input's shape."""
    forward, backward = exported.manifest["graphs"][:2]
    roles = [o["role"] for o in forward["outputs"]]
    assert roles[0] == "graph output" and forward["outputs"][0]["shape"] == [1, 256, 128]  # the logits
    assert set(roles[1:]) == {"saved for backward"}
    assert len(roles) - 1 == len(backward["inputs"]) - 1  # all of them the backward's, beside its tangent
    for output in backward["outputs"]:
        assert output["role"] == "gradient"
        assert output["shape"] == forward["inputs"][output["of_forward_input"]]["shape"]
        assert forward["inputs"][output["of_forward_input"]]["source"].startswith("module.")  # a parameter's


class _Counting(torch.nn.Module):
    """A buffer updated in place by the forward, and a reassigned attribute's value Dynamo returns."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        self.calls += 1
        return self.linear(x) * 2


def test_manifest_outputs_name_the_input_each_update_is_the_new_value_of(tmp_path):
    """The leading outputs of a module that updates inputs in place are their new values (the graph's output
    list named the same node twice, with nothing to tell which was the buffer's)."""
    with torch.no_grad():
        exported = laplace_passes.export_stablehlo(_Counting(), torch.randn(2, 4), out_dir=tmp_path)
    (entry,) = exported.manifest["graphs"]
    update, result = entry["outputs"][:2]
    (updated,) = [s for s in entry["inputs"] if s["name"] == update["updates_input"]]
    assert update["role"] == "updated input" and updated["source"] == "module.calls"
    assert (result["role"], result["index"], result["shape"]) == ("graph output", 0, [2, 3])


def test_export_writes_every_partition_of_a_graph_over_the_budget(tmp_path):
    torch.manual_seed(0)
    exported = laplace_passes.export_stablehlo(
        model_zoo.build("tiny"), tokens(256), target="trn2", out_dir=tmp_path, max_graph_instructions=800
    )
    expected = []
    for record in exported.report.graphs[1:]:
        parts = record.size.partitions
        expected += [f"{record.name}_partition_{p.index}" for p in parts] if parts else [record.name]
    assert [g["name"] for g in exported.manifest["graphs"]] == expected
    assert len(expected) > 2 and "forward_0" in expected  # the forward fits, the backward is cut
    for entry in exported.manifest["graphs"]:
        text = exported.path(entry["name"]).read_text()
        FileCheck().check("func.func @main").check_not("stablehlo.while").run(text)
        assert entry["total_ops"] == sum(entry["op_counts"].values()) > 0


def test_iree_keeps_a_float64_model_in_float64():
    """IREE demotes f64 to f32 unless told not to: the module then refused the float64 inputs it was made for
    ("element type mismatch"), and would have computed in f32."""
    gen = torch.Generator().manual_seed(6)
    layer = torch.nn.Linear(8, 5).double()
    x = torch.randn(3, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    compiled = laplace_passes.compile(layer, target="cpu", inner="iree")
    got = compiled(x)
    got_grad, = torch.autograd.grad(got.square().sum(), x)
    expected = layer(x)
    expected_grad, = torch.autograd.grad(expected.square().sum(), x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)  # f64 arithmetic, not f32's 1e-7
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-12, atol=1e-12)


def test_iree_keeps_float64_math_inside_a_float32_graph():
    """float64 used inside for its precision (1e8 added and taken away): demoted to f32 it gives 0s."""
    x = torch.randn(5)

    def f(x):
        return ((x.double() + 1e8) - 1e8).float() * 3

    with torch.no_grad():
        got = laplace_passes.compile(f, target="cpu", inner="iree")(x)
    torch.testing.assert_close(got, f(x), rtol=0, atol=0)


def test_float64_math_iree_cannot_link_runs_demoted_with_a_warning():
    """A float32 model computing a tanh in float64 (its saved tensor for the backward is float64 too): IREE's CPU
    backend has no float64 tanh, so that graph is compiled demoted, said in a warning, and still equals eager."""
    x = torch.randn(3, 5, requires_grad=True)

    def f(x):
        return torch.tanh(x.double()).float() * 2

    compiled = laplace_passes.compile(f, target="cpu", inner="iree")
    with pytest.warns(UserWarning, match=r"IREE's CPU backend has no float64 tanh: this graph's float64 math is "
                                         r"compiled demoted to float32"):
        got = compiled(x)
    got_grad, = torch.autograd.grad(got.sum(), x)
    expected = f(x)
    expected_grad, = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_grad, expected_grad)


def test_iree_runs_a_graph_cut_into_partitions():
    gen = torch.Generator().manual_seed(5)
    q, k, v, gk = (torch.randn(1, 16, 2, 8, generator=gen) for _ in range(4))

    def attention(q, k, v, gk):
        return laplace_passes.gla(q, k, v, F.logsigmoid(gk))[0]

    compiled = laplace_passes.compile(attention, target="cpu", inner="iree", max_graph_instructions=PARTITION_BUDGET)
    with torch.no_grad():
        got = compiled(q, k, v, gk)
    assert relative_rmse(got, attention(q, k, v, gk)) <= MAX_RELATIVE_RMSE
    (record,) = [g for g in compiled.laplace_report.graphs if g.kind == "inference"]
    assert len(record.size.partitions) >= 2


def test_lowering_error_names_the_op():
    q, k, v, gk = (torch.randn(1, 40, 2, 8) for _ in range(4))

    def attention(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    compiled = laplace_passes.compile(attention, inner="stablehlo", retile_gla=False)
    with pytest.raises(Exception, match=r"torch-mlir cannot lower 1 node\(s\): node gla \(laplace\.gla\.default\)") \
            as error:
        compiled(q, k, v, -gk.abs())
    # Both the error and the site's row say why the op is there: the re-tiling was turned off.
    assert "laplace.gla is a GLA site the re-tiling pass did not re-tile" in str(error.value)
    (site,) = compiled.laplace_report.sites
    assert site.reason.endswith("the inner compiler lowers the graph and has no lowering of laplace::gla, so the "
                                "compile fails at this site (keep retile_gla on to lower it)"), site.reason


def test_missing_lowering_package_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_mlir.fx", None)
    with pytest.raises(_deps.LoweringDependencyError) as error:
        torch_mlir_decompositions()
    message = str(error.value)
    assert message.startswith("decomposing ATen graphs for torch-mlir needs the package 'torch-mlir'")
    assert 'pip install "laplace_passes[lowering]"' in message and "torch-mlir==20261001" in message


@pytest.mark.parametrize("inner,package", [("stablehlo", "torch-mlir"), ("iree", "iree-base-runtime")])
def test_lowering_inner_compiler_without_its_package_fails_before_tracing(inner, package, monkeypatch):
    module = {"torch-mlir": "torch_mlir.fx", "iree-base-runtime": "iree.runtime"}[package]
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(_deps.LoweringDependencyError) as error:
        laplace_passes.compile(lambda x: x + 1, inner=inner)
    assert str(error.value).startswith(f'inner="{inner}" needs the package \'{package}\'')
    assert 'pip install "laplace_passes[lowering]"' in str(error.value)


# -- the legalization passes ----------------------------------------------------------------------

INT64_MAX = 2**63 - 1


def test_bound_slice_scatter_writes_static_bounds():
    def scatter_last_row(base, row):
        return torch.ops.aten.slice_scatter.default(base, row, 3, -1, INT64_MAX)

    base, row = torch.zeros(1, 2, 3, 16, 4), torch.randn(1, 2, 3, 1, 4)
    gm = make_fx(scatter_last_row, tracing_mode="fake")(base, row)
    outcome = BoundSliceScatter()(gm)
    gm.graph.lint()
    gm.recompile()
    assert outcome.modified and outcome.summary == "1 slice_scatter bound(s) made static"
    FileCheck().check("slice_scatter.default(base_1, row_1, 3, 15, 16, 1)").run(gm.code)
    torch.testing.assert_close(gm(base, row), scatter_last_row(base, row), rtol=0, atol=0)
    # torch-mlir lowers it now (before, it ran out of memory materialising the INT64_MAX end).
    assert lower_to_stablehlo(gm).op_counts["stablehlo.scatter"] == 1


def test_bound_slice_scatter_declines_symbolic_sizes():
    gm = make_fx(lambda base, row: torch.ops.aten.slice_scatter.default(base, row, 0, 1), tracing_mode="symbolic")(
        torch.zeros(6, 4), torch.randn(5, 4)
    )
    outcome = BoundSliceScatter()(gm)
    assert not outcome.modified
    (reason,) = outcome.declined
    assert re.fullmatch(r"slice_scatter: dimension 0 has symbolic size s\d+; torch-mlir needs static bounds", reason)


@pytest.mark.parametrize("offset, dim1, dim2", [(0, -4, -2), (2, 1, 3), (-3, 3, 2), (9, 2, 3)])
def test_diagonal_becomes_a_strided_slice_torch_mlir_lowers(offset, dim1, dim2):
    def diagonal(x):
        return torch.ops.aten.diagonal.default(x, offset, dim1, dim2) * 2

    x = torch.randn(2, 8, 5, 7, 3)
    gm = make_fx(diagonal, tracing_mode="fake")(x)
    with pytest.raises(LoweringError, match=r"node diagonal \(aten\.diagonal\.default\)"):
        lower_to_stablehlo(gm)
    outcome = DiagonalAsStridedSlice()(gm)
    gm.graph.lint()
    gm.recompile()
    assert outcome.summary == "1 diagonal(s) rewritten as strided slices"
    FileCheck().check_not("aten.diagonal").check("aten.permute.default").check("aten.clone.default") \
        .check("aten.view.default").check("aten.slice.Tensor(diagonal_flat, -1").run(gm.code)
    torch.testing.assert_close(gm(x), diagonal(x), rtol=0, atol=0)
    assert lower_to_stablehlo(gm).total_ops > 0


@pytest.mark.parametrize("origin", [(), ("token loop, 20 steps",)], ids=["a call", "a recognised loop"])
def test_clamp_gate_checks_replaces_the_python_check(origin):
    """A recognised loop's check carries the loop's origin (for its error's words): replaced all the same."""
    from laplace_passes.ops.gla import check_gates

    gm = make_fx(lambda gk: check_gates(gk, *origin) * 2, tracing_mode="fake")(torch.randn(3, 4))
    FileCheck().check("laplace.check_gates.default(gk_1" + "".join(f", '{o}'" for o in origin) + ")").run(gm.code)
    outcome = ClampGateChecks()(gm)
    gm.graph.lint()
    gm.recompile()
    assert outcome.modified
    FileCheck().check_not("check_gates").check("aten.clamp.default(gk_1, None, 0.0)").run(gm.code)
    gates = torch.tensor([[-1.0, 0.0, 2.0, -3.0]])
    torch.testing.assert_close(gm(gates), torch.tensor([[-2.0, 0.0, 0.0, -6.0]]))


# -- TorchNeuron ----------------------------------------------------------------------------------


def gla_loss(q, k, v, gk):
    return laplace_passes.gla(q, k, v, F.logsigmoid(gk))[0].square().sum()


def gla_inputs():
    gen = torch.Generator().manual_seed(4)
    return [torch.randn(1, 40, 2, 8, generator=gen, requires_grad=True) for _ in range(4)]


def test_neuron_without_torch_neuronx_says_what_to_install_and_where():
    if _importable("torch_neuronx"):
        pytest.skip("torch-neuronx is installed here")
    with pytest.raises(NeuronUnavailableError) as direct:
        neuron.resolve_torch_neuronx()
    message = str(direct.value)
    for phrase in (
        "inner='neuron' hands the ATen graphs to TorchNeuron (the torch-neuronx package), which is not "
        "installed here (No module named 'torch_neuronx')",
        "the AWS Neuron SDK's own pip repository",
        "run on Trainium instances (trn1, trn2)",
        "inner='stablehlo' or inner='iree', laplace_passes.export_stablehlo(...) and laplace_passes.preflight(...)",
        "laplace_passes never falls back to another compiler",
    ):
        assert phrase in message
    compiled = laplace_passes.compile(gla_loss, inner="neuron")
    with pytest.raises(Exception, match=re.escape("which is not installed here (No module named 'torch_neuronx')")):
        compiled(*gla_inputs())


def _importable(name):
    try:
        __import__(name)
        return True
    except ImportError:
        return False


@pytest.fixture
def fake_torch_neuronx(monkeypatch):
    """torch-neuronx's two entry points, recording what they are handed (the real one needs Trainium)."""
    handed = []

    def neuron_backend_fx_compiler(gm, example_inputs, pre_processing_analysis_info=None, options=None):
        handed.append((gm, options))
        return make_boxed_func(gm.forward)

    modules = {
        "torch_neuronx": types.ModuleType("torch_neuronx"),
        "torch_neuronx.neuron_dynamo_backend": types.ModuleType("torch_neuronx.neuron_dynamo_backend"),
        "torch_neuronx.neuron_dynamo_backend.backend": types.SimpleNamespace(
            neuron_backend_fx_compiler=neuron_backend_fx_compiler),
        "torch_neuronx.neuron_dynamo_backend.decompositions": types.SimpleNamespace(
            get_compile_decomposition_table=torch_mlir_decompositions),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv(NO_FALLBACK_ENV, "unset")
    monkeypatch.delenv(NO_FALLBACK_ENV)
    return handed


def test_neuron_gets_each_aten_graph_after_the_preflight(fake_torch_neuronx):
    inputs = gla_inputs()
    expected = gla_loss(*inputs)
    expected_grads = torch.autograd.grad(expected, inputs)
    compiled = laplace_passes.compile(gla_loss, target="trn2", inner=neuron_compiler({"model_name": "gla"}))
    got = compiled(*inputs)
    grads = torch.autograd.grad(got, inputs)
    assert relative_rmse(got, expected) <= MAX_RELATIVE_RMSE
    assert max(relative_rmse(g, e) for g, e in zip(grads, expected_grads, strict=True)) <= MAX_RELATIVE_RMSE

    assert [options for _, options in fake_torch_neuronx] == [{"model_name": "gla", "dynamic": False}] * 2
    for gm, _ in fake_torch_neuronx:
        FileCheck().check_not("laplace.check_gates").check_not("laplace.gla").run(gm.code)
    report = compiled.laplace_report
    preflight_runs = [(p.name, p.graph, p.summary.split(":")[0]) for p in report.passes if "preflight" in p.name]
    assert preflight_runs == [
        ("neuron_preflight", "forward_0", "no finding"), ("require_clean_preflight", "forward_0", "preflight clean"),
        ("neuron_preflight", "backward_0", "no finding"), ("require_clean_preflight", "backward_0", "preflight clean"),
    ]
    import os

    assert os.environ[NO_FALLBACK_ENV] == "1"  # TorchNeuron may not fall back to eager execution


class StepCounter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(3))

    def forward(self, x):
        self.steps.add_(1.0)
        return x * self.steps


def test_neuron_gets_buffer_updates_in_the_graph(fake_torch_neuronx):
    """keep_inference_input_mutations=True, as TorchNeuron's own backend: the update is a copy_ in the graph."""
    model = StepCounter()
    compiled = laplace_passes.compile(model, inner="neuron")
    with torch.no_grad():
        first = compiled(torch.ones(3))
        second = compiled(torch.ones(3))
    assert torch.equal(first, torch.ones(3)) and torch.equal(second, torch.full((3,), 2.0))
    assert torch.equal(model.steps, torch.full((3,), 2.0))  # updated once per call, not copied back twice
    ((gm, _),) = fake_torch_neuronx
    FileCheck().check("torch.ops.aten.add.Tensor").check("torch.ops.aten.copy_.default").run(gm.code)
    preflight = [p.summary for p in compiled.laplace_report.passes if p.name == "neuron_preflight"]
    assert preflight and preflight[0].startswith("no finding")  # the copy_ is lowered as TorchNeuron does


def test_preflight_findings_stop_the_hand_off(fake_torch_neuronx):
    def in_double(x):
        return (x.double() * 2).sum()

    compiled = laplace_passes.compile(in_double, inner="neuron")
    stopped = r"Neuron preflight: 1 finding\(s\)(.|\n)*\[f64\] inference_0: node convert_element_type \(prims"
    with pytest.raises(Exception, match=stopped):
        compiled(torch.randn(4))
    assert fake_torch_neuronx == []  # nothing reached TorchNeuron
    report = laplace_passes.last_report()
    (run,) = [p for p in report.passes if p.name == "neuron_preflight"]
    assert run.summary == "1 finding(s) for trn2: f64 x1" and run.declined[0].startswith("[f64] inference_0")
    lenient = laplace_passes.compile(in_double, inner=neuron_compiler(strict_preflight=False))
    assert lenient(torch.ones(4)) == 8.0
    assert len(fake_torch_neuronx) == 1


def test_neuron_entry_point_missing_is_named(fake_torch_neuronx, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_neuronx.neuron_dynamo_backend.backend", types.SimpleNamespace())
    with pytest.raises(NeuronUnavailableError, match=(
        r"torch-neuronx unknown version is installed but has no "
        r"torch_neuronx\.neuron_dynamo_backend\.backend\.neuron_backend_fx_compiler"
    )):
        neuron.resolve_torch_neuronx()


def test_neuron_options_keep_its_constraints():
    static_only = r"TorchNeuron compiles static shapes only: options\['dynamic'\] must be False"
    with pytest.raises(ValueError, match=static_only):
        neuron_compiler({"dynamic": True})
    with pytest.raises(ValueError, match="TorchNeuron supports mode='default' only, got mode='max-autotune'"):
        neuron_compiler({"mode": "max-autotune"})


def test_neuronx_cc_command_line(monkeypatch):
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    assert neuronx_cc_command("out/backward_0.mlirbc") == [
        "neuronx-cc", "compile", "out/backward_0.mlirbc", "--framework", "XLA", "--target", "trn2",
        "--lnc", "2", "-O2", "--model-type", "transformer", "--auto-cast=none", "--output", "out/backward_0.neff",
    ]
    assert neuronx_cc_command("g.mlir", output="g.neff", extra_flags=("--verbose", "info"))[-4:] == [
        "--verbose", "info", "--output", "g.neff",
    ]
    with pytest.raises(ValueError, match=r"neuronx-cc compiles for Trainium targets \('trn1', 'trn2'\), not 'cpu'"):
        neuronx_cc_command("g.mlir", target="cpu")


def test_bf16_matmuls_and_sums_accumulate_in_f32_and_their_scalars_are_bf16_constants():
    """torch sums bf16 products in f32 and rounds once: the module says so, whatever its consumer's default."""
    def bf16_math(x, w):
        y = (x.bfloat16() @ w.bfloat16()) * 0.1
        return y / (y.float().norm() + 1e-7), y.sum()

    gm = make_fx(bf16_math, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 4))
    text = lower_to_stablehlo(gm).text
    FileCheck().check("stablehlo.dot_general").check("-> tensor<8x4xf32>").check("stablehlo.convert").run(text)
    FileCheck().check("stablehlo.reduce").check("tensor<f32>").run(text)
    assert "f64" not in text and "(tensor<8x4xbf16>, tensor<bf16>) -> tensor<bf16>" not in text


def test_walk_ops_lists_nested_ops_in_the_order_they_appear():
    """An op before the ops of its regions, then the next op; the module itself is not listed."""
    from torch_mlir import ir

    from laplace_passes.lowering.clean_stablehlo import walk_ops

    context = ir.Context()
    context.allow_unregistered_dialects = True
    module = ir.Module.parse('"t.outer"() ({\n  "t.inner"() ({\n    "t.innermost"() : () -> ()\n  }) : () -> ()\n'
                             '  "t.second"() : () -> ()\n}) : () -> ()\n"t.after"() : () -> ()', context)
    names = [op.name for op in walk_ops(module, lambda op: True)]
    assert names == ["t.outer", "t.inner", "t.innermost", "t.second", "t.after"]
    assert [op.name for op in walk_ops(module, lambda op: op.name.endswith("er"))] == ["t.outer", "t.inner", "t.after"]
