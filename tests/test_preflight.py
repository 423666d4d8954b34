"""The Neuron preflight: one graph per finding, built to trigger it, and a clean model with none."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import laplace_passes
import model_zoo
from laplace_passes.lowering.checks import check_graph
from laplace_passes.infra.targets import TRN2, HardwareTarget

pytest.importorskip("torch_mlir", reason="the preflight tries torch-mlir's lowering: pip install -e '.[lowering]'")


def findings_of(gm, target=TRN2):
    return check_graph(gm, target, graph_name="g")


def only(findings, check):
    assert [f.check for f in findings] == [check], [str(f) for f in findings]
    return findings[0]


def test_dynamic_shape_is_named_with_its_symbol():
    gm = make_fx(lambda x: (x * 2).sum(0), tracing_mode="symbolic")(torch.randn(4, 3))
    (placeholder,) = gm.graph.find_nodes(op="placeholder")
    finding = only(findings_of(gm), "dynamic-shape")
    assert finding.node == placeholder.name and finding.op == "input"
    symbols = [str(s) for s in placeholder.meta["val"].shape]
    assert finding.message.startswith(f"has symbolic shape [{symbols[0]}, {symbols[1]}]; neuronx-cc compiles static")
    assert "dynamic=False" in finding.fix
    assert str(finding).startswith(f"[dynamic-shape] g: node {placeholder.name} (input): has symbolic shape")


def test_dynamic_dimension_through_the_public_function():
    """A dimension marked dynamic is named; the graphs checked are those compiled per shape, all static."""
    x = torch.randn(6, 3)
    torch._dynamo.mark_dynamic(x, 0)
    report = laplace_passes.preflight(lambda x: (x * 2).sum(0), x)
    assert report.ok, str(report)
    (dim,) = report.dynamic_dims
    assert dim.endswith(" dim 0 = " + dim.split(" = ")[1]) and dim.split(" = ")[1].startswith("s")
    assert f"dynamic dimensions: {dim}" in str(report) and "seq_buckets" in str(report)


def test_loop_left_in_the_graph():
    def count_up(x):
        loop = torch._higher_order_ops.while_loop
        return loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), (torch.tensor(0), x))[1]

    gm = make_fx(count_up, tracing_mode="fake")(torch.randn(4))
    finding = only(findings_of(gm), "loop")
    assert finding.op == "higher_order.while_loop" and finding.node.startswith("while_loop")
    assert "a while_loop loop is left in the graph" in finding.message
    assert "static trip count" in finding.message and "range(n)" in finding.fix


def test_float64_is_flagged_where_it_enters_the_graph():
    def mixed(x, y):
        return (x.double() * 2 + y).sum()

    gm = make_fx(mixed, tracing_mode="fake")(torch.randn(4), torch.randn(4, dtype=torch.float64))
    findings = findings_of(gm)
    assert [f.check for f in findings] == ["f64", "f64"]
    # The f64 input and the cast; the ops downstream only carry it on.
    assert [(f.node, f.op) for f in findings] == [("y_1", "input"), ("_to_copy", "aten._to_copy.default")]
    assert findings[1].message.startswith("produces torch.float64 [4]; Trainium has no f64 arithmetic")
    assert "float32" in findings[1].fix


def test_float64_constant_is_flagged():
    def with_f64_constant(x):
        return (x.sum() + torch.tensor([1.0, 2.0], dtype=torch.float64)).float()

    gm = make_fx(with_f64_constant, tracing_mode="fake")(torch.randn(4))
    findings = findings_of(gm)
    assert [(f.check, f.op) for f in findings] == [("f64", "constant")], findings
    assert findings[0].message.startswith("produces torch.float64 [2]; Trainium has no f64 arithmetic")


F64_FIX = "cast the model to float32/bfloat16"


def test_float64_model_is_a_finding_that_names_its_parameters():
    """laplace's GLA refuses float64 while tracing: the preflight still returns, with the finding and its fix."""
    model = model_zoo.build("tiny").double()
    ids = torch.randint(0, 128, (1, 16))
    report = laplace_passes.preflight(model, ids)
    finding = only(report.findings, "f64")
    count = sum(1 for p in model.parameters() if p.dtype == torch.float64)
    assert (finding.node, finding.op) == ("embeddings.weight", "parameter")
    assert finding.message.startswith(f"float64: {count} parameter(s) (embeddings.weight, layers.0.")
    assert "neuronx-cc has no FP64" in finding.message and finding.fix.startswith(F64_FIX)
    assert not report.ok and report.graphs == []
    assert "graphs not checked: tracing stopped at TypeError: q must have dtype" in str(report)
    # Token ids cast with the model are named too; the model's own refusal is kept in the report.
    with_f64_ids = laplace_passes.preflight(model, ids.double())
    assert [(f.check, f.node) for f in with_f64_ids.findings] == [("f64", "embeddings.weight"), ("f64", "input[0]")]
    assert "token ids stay integer: .long()" in with_f64_ids.findings[1].fix
    assert "input_ids must be [batch, seq_len] integer token ids" in with_f64_ids.not_checked


def test_float64_inputs_of_a_plain_gla_layer_are_findings():
    q, gk = torch.randn(1, 8, 2, 4, dtype=torch.float64), -torch.rand(1, 8, 2, 4, dtype=torch.float64)
    report = laplace_passes.preflight(lambda q, k, v, gk: laplace_passes.gla(q, k, v, gk)[0], q, q, q, gk)
    assert [(f.check, f.node, f.op) for f in report.findings] == [("f64", f"input[{i}]", "input") for i in range(4)]
    assert report.findings[0].message.startswith("float64: input[0] torch.float64 [1, 8, 2, 4]; neuronx-cc has no FP64")
    assert report.to_dict()["not_checked"].startswith("graphs not checked: tracing stopped at TypeError")


def test_float64_made_inside_the_model_is_a_finding_at_the_op_that_refuses_it():
    def casts_to_f64(x):
        x = x.double()
        return laplace_passes.gla(x, x, x, -x.abs())[0]

    report = laplace_passes.preflight(casts_to_f64, torch.randn(1, 8, 2, 4))
    finding = only(report.findings, "f64")
    assert finding.message.startswith("float64: an op refused a float64 tensor computed inside the model (q must")
    assert finding.fix.startswith(F64_FIX)


def test_float64_without_a_refusing_op_names_the_parameter_once():
    """The graphs are checked; their f64 placeholders are the parameters the first finding names."""
    report = laplace_passes.preflight(torch.nn.Linear(4, 2).double(), torch.randn(3, 4).float().double())
    assert [(f.node, f.op) for f in report.findings[:2]] == [("weight", "parameter"), ("input[0]", "input")]
    assert report.graphs and not report.not_checked
    assert not [f for f in report.findings if f.op == "input" and f.graph], str(report)


def test_estimated_instructions_over_the_budget():
    gm = make_fx(lambda a, b: a @ b, tracing_mode="fake")(torch.randn(256, 128), torch.randn(128, 1024))
    assert findings_of(gm, TRN2) == []
    # 128 x 512 tiles: ceil(256/128) * ceil(1024/512) * ceil(128/128) = 4 instructions, budget 3.
    small = HardwareTarget(name="small", partitions=128, sub_chunk_size=16, max_graph_instructions=3)
    finding = only(findings_of(gm, small), "instruction-budget")
    assert finding.node == "mm"
    assert finding.message == (
        "the graph's estimated 4 instructions pass small's budget of 3 (neuronx-cc: [XTP002] Number of "
        "instructions is over the threshold) and the budget pass is off (max_graph_instructions=None), so it "
        "is compiled whole; largest: mm 4"
    )
    assert "cut the graph" in finding.fix
    # With the budget pass on, a single op over the budget still cannot be cut.
    (finding,) = check_graph(gm, small, partition_budget=3)
    assert finding.message.endswith(
        "and no cut fits it: node mm (aten.mm.default) alone needs about 4 instructions, over the budget of 3: "
        "no cut can make it fit; largest: mm 4"
    )


def test_graph_the_budget_pass_can_cut_is_no_finding():
    # Two matmuls of 2 instructions each: 4 in all, over 3, but one per partition fits.
    a, b, c = torch.randn(128, 128), torch.randn(128, 1024), torch.randn(128, 1024)
    gm = make_fx(lambda a, b, c: (a @ b, a @ c), tracing_mode="fake")(a, b, c)
    small = HardwareTarget(name="small", partitions=128, sub_chunk_size=16, max_graph_instructions=3)
    assert [f.check for f in check_graph(gm, small)] == ["instruction-budget"]
    assert check_graph(gm, small, partition_budget=3) == []


def all_to_all_graph(input_splits, output_splits):
    """x -> all_to_all_single(x, output_splits, input_splits, group) -> wait_tensor."""
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with mode:
        value = torch.empty(8, 4)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = value
    exchange = graph.call_function(
        torch.ops._c10d_functional.all_to_all_single.default, (x, output_splits, input_splits, "muon_group")
    )
    exchange.meta["val"] = value
    done = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (exchange,))
    done.meta["val"] = value
    graph.output((done,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("input_splits,output_splits,which", [
    ([1, 3, 2, 2], [2, 2, 2, 2], "input split sizes [1, 3, 2, 2]"),
    ([2, 2, 2, 2], [1, 3, 2, 2], "output split sizes [1, 3, 2, 2]"),
])
def test_all_to_all_with_unequal_splits(input_splits, output_splits, which):
    finding = only(findings_of(all_to_all_graph(input_splits, output_splits)), "all-to-all-splits")
    assert finding.node == "all_to_all_single_default"
    assert finding.message == f"{which} are unequal; trn2's all-to-all accepts equal splits only"
    assert "pad every shard" in finding.fix


def test_all_to_all_with_an_unsupported_group_size():
    finding = only(findings_of(all_to_all_graph([2] * 6, [2] * 6)), "collective-group-size")
    assert finding.message == (
        "the all_to_all_single spans a group of 6 ranks; trn2 supports groups of 4, 8, 16 or a multiple of 32"
    )
    # Equal splits over a supported group: clean.
    assert findings_of(all_to_all_graph([1] * 8, [1] * 8)) == []


def collective_graph(op, *args):
    """x -> op(x, *args) -> wait_tensor, shapes given by the op's fake kernel."""
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with mode:
        value = torch.empty(8, 4)
        out = op(value, *args)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = value
    called = graph.call_function(op, (x, *args))
    called.meta["val"] = out
    done = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (called,))
    done.meta["val"] = out
    graph.output((done,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_other_collectives_have_their_group_size_checked():
    c10d = torch.ops._c10d_functional
    finding = only(findings_of(collective_graph(c10d.all_gather_into_tensor.default, 6, "g6")), "collective-group-size")
    assert finding.message.startswith("the all_gather_into_tensor spans a group of 6 ranks")
    finding = only(findings_of(collective_graph(c10d.reduce_scatter_tensor.default, "sum", 3, "g3")),
                   "collective-group-size")
    assert finding.message.startswith("the reduce_scatter_tensor spans a group of 3 ranks")
    assert findings_of(collective_graph(c10d.all_gather_into_tensor.default, 4, "g4")) == []


def test_a_collective_without_a_stablehlo_form_is_named():
    finding = only(findings_of(collective_graph(torch.ops._c10d_functional.broadcast.default, 0, "g")), "collective")
    assert finding.node == "broadcast_default" and "no StableHLO form for broadcast" in finding.message


def test_a_cond_is_control_flow_on_trn2_and_nothing_on_cpu():
    def pick(x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))

    gm = make_fx(pick, tracing_mode="fake")(torch.randn(4))
    finding = only(findings_of(gm), "control-flow")
    assert finding.node == "cond" and "does not implement control flow" in finding.message
    assert "torch.where" in finding.fix
    report = laplace_passes.preflight(pick, torch.randn(4), target="trn2")  # through Dynamo: no crash either
    assert [f.check for f in report.findings] == ["control-flow"]


@pytest.mark.parametrize("op", ["nonzero", "repeat_interleave", "masked_select"])
def test_a_data_dependent_size_is_named_at_its_node(op):
    def data_dependent(x, r):
        if op == "nonzero":
            return torch.nonzero(x > 0).float().sum(0)
        if op == "repeat_interleave":
            return torch.repeat_interleave(x, r, dim=0).sum(0)
        return torch.masked_select(x, x > 0).sum()

    gm = make_fx(data_dependent, tracing_mode="fake")(torch.randn(4, 3), torch.tensor([1, 2, 0, 1]))
    dynamic = [f for f in findings_of(gm) if f.check == "dynamic-shape"]
    assert [f.node for f in dynamic] == [op] and "data-dependent shape [u" in dynamic[0].message
    assert "mask" in dynamic[0].fix
    assert not [f for f in findings_of(gm) if f.check == "internal-error"]


def test_a_check_that_fails_inside_is_a_finding_naming_it(monkeypatch):
    from laplace_passes.lowering import checks

    def broken(gm, target):
        raise ValueError("planted")

    monkeypatch.setattr(checks, "check_collectives", broken)
    monkeypatch.delenv("LAPLACE_PASSES_STRICT", raising=False)
    finding = only(findings_of(all_to_all_graph([1] * 8, [1] * 8)), "internal-error")
    assert finding.op == "broken" and "ValueError: planted" in finding.message
    monkeypatch.setenv("LAPLACE_PASSES_STRICT", "1")
    with pytest.raises(ValueError, match="planted"):
        findings_of(all_to_all_graph([1] * 8, [1] * 8))


def test_op_torch_mlir_cannot_lower_is_named():
    gm = make_fx(lambda x: torch.linalg.eigh(x)[0] * 2, tracing_mode="fake")(torch.randn(4, 4))
    finding = only(findings_of(gm), "unlowerable-op")
    assert (finding.node, finding.op) == ("_linalg_eigh", "aten._linalg_eigh.default")
    assert finding.message == (
        "torch-mlir cannot lower this op (error: failed to legalize operation 'torch.operator' "
        "that was explicitly marked illegal)"
    )
    assert "decomposition" in finding.fix


def gla_inputs(T=40):
    gen = torch.Generator().manual_seed(0)
    q, k, v, gk = (torch.randn(1, T, 2, 8, generator=gen) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v, torch.nn.functional.logsigmoid(gk).detach())]


def test_declined_gla_site_is_an_unlowerable_op_with_its_fix():
    def attention(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0].sum()

    report = laplace_passes.preflight(attention, *gla_inputs(), retile_gla=False)
    found = {(f.graph, f.op) for f in report.by_check("unlowerable-op")}
    assert found == {("forward_0", "laplace.gla.default"), ("backward_0", "laplace.gla_backward.default")}
    assert all("the re-tiling pass declined this GLA site" in f.fix for f in report.findings)
    assert "2 finding(s)" in str(report) and "[unlowerable-op] forward_0: node gla" in str(report)


def test_clean_model_has_no_finding_and_the_report_shows_the_preflight():
    torch.manual_seed(0)
    report = laplace_passes.preflight(model_zoo.build("tiny"), torch.randint(0, 128, (1, 256)), target="trn2")
    assert report.ok, str(report)
    assert report.findings == [] and report.graphs == ["forward_0", "backward_0"]
    assert str(report) == "Neuron preflight (trn2): 2 graph(s) checked, no finding"
    preflight_runs = [p for p in report.report.passes if p.name == "neuron_preflight"]
    assert [p.graph for p in preflight_runs] == ["forward_0", "backward_0"]
    assert all(p.summary.startswith("no finding") for p in preflight_runs)
    # The graphs checked are the ones TorchNeuron would get. tiny's gates are <= 0 by construction, so
    # they have no gate check; with gate_checks="always" the check is there, already a clamp.
    FileCheck().check_not("laplace.check_gates").check_not("aten.clamp.default(div").run(
        report.report.graph("after", "forward_0").code
    )
    checked = laplace_passes.preflight(model_zoo.build("tiny"), torch.randint(0, 128, (1, 256)), target="trn2",
                                       gate_checks="always")
    assert checked.ok, str(checked)
    FileCheck().check_not("laplace.check_gates").check("aten.clamp.default(div").run(
        checked.report.graph("after", "forward_0").code
    )


def _branch_on_a_value(x):
    y = x * 2
    if y.sum() > 0:  # data-dependent: Dynamo splits the function here
        return y + 1
    return y - 1


def _nonzero_between(x):
    return torch.nonzero(x > 0).float().sum() + x.sum()


@pytest.mark.parametrize("fn, reason", [
    (_branch_on_a_value, "Data-dependent branching (test_preflight.py, line "),
    (_nonzero_between, "Dynamic shape operator (aten.nonzero.default)"),
])
def test_a_graph_break_is_named_by_preflight_export_and_inspect(fn, reason, tmp_path):
    """Each graph reaches the compiler alone: the code between them (the branch the example took, an op run
    eagerly) is in none of them, and every entry point says where the function was split (they had said nothing:
    'no finding', manifest notes [])."""
    x = torch.ones(4, 4)
    report = laplace_passes.inspect(fn, x)
    assert [g.kind for g in report.graphs].count("dynamo") == 2
    (found,) = report.graph_breaks
    assert found.startswith(reason), found
    assert f"graph break (the Python around it runs in no graph): {found}" in str(report)
    (finding,) = laplace_passes.preflight(fn, x).findings
    assert finding.check == "graph-break" and reason in finding.message and "torch.where" in finding.fix
    manifest = laplace_passes.export_stablehlo(fn, x, out_dir=tmp_path / "out").manifest
    assert any(note.startswith(f"Dynamo compiled the function as 2 graphs, with code outside them at 1 kind(s) of "
                               f"graph break: {found}") for note in manifest["notes"]), manifest["notes"]
    assert [f.split("]")[0] for f in manifest["neuron_preflight"]] == ["[graph-break"]


def _two_branches(x):
    y = x * 2
    if y.sum() > 0:
        y = y + 1
    if y.mean() > 0:  # met in the frame Dynamo resumes after the first break
        y = y * 3
    return y


def test_a_break_in_the_frame_resumed_after_a_break_is_named_too():
    report = laplace_passes.inspect(_two_branches, torch.ones(4, 4))
    assert [g.kind for g in report.graphs].count("dynamo") == 3
    first, second = report.graph_breaks
    assert first.startswith("Data-dependent branching (test_preflight.py, line ") and "if y.sum() > 0:" in first
    assert second.startswith("Data-dependent branching (test_preflight.py, line ") and "if y.mean() > 0:" in second


def _branch_in_a_loop(x):
    y = x * 2
    for i in range(2):
        if y.sum() > i:  # Dynamo skips the whole frame at this break
            y = y + 1
    return y


def test_a_function_dynamo_skips_at_a_graph_break_says_which():
    with pytest.raises(RuntimeError, match=r"captured no graph: Dynamo ran the function without compiling it; it "
                                           r"skipped the function at a graph break: Data-dependent branching "
                                           r"\(test_preflight.py, line \d+: if y.sum\(\) > i:"):
        laplace_passes.inspect(_branch_in_a_loop, torch.ones(4, 4))


def test_a_function_in_one_graph_has_no_graph_break():
    report = laplace_passes.inspect(lambda x: torch.where(x.sum() > 0, x * 2 + 1, x * 2 - 1), torch.ones(4, 4))
    assert report.graph_breaks == [] and "graph break" not in str(report)
