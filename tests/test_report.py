"""`inspect` and the report: what users read and what machines parse."""

import json
import operator
import re

import pytest
import torch
from torch.testing import FileCheck

import laplace_passes
import model_zoo


@pytest.fixture(scope="module")
def report():
    torch.manual_seed(0)
    model = model_zoo.build("tiny")
    return laplace_passes.inspect(model, torch.randint(0, 128, (1, 2048)), target="trn2")


def test_report_lists_graphs_passes_and_sites(report):
    assert [g.kind for g in report.graphs] == ["dynamo", "forward", "backward"]
    retile = next(p for p in report.passes if p.name == "retile_gla")
    assert retile.modified
    # One chunk-loop op in place of each site; tiny's gates are <= 0 by construction, so no check node is added.
    assert retile.nodes_after == retile.nodes_before
    assert [s.plan["n_chunks"] for s in report.sites] == [16, 16]
    assert report.sites[0].shape == {"B": 1, "H": 2, "K": 16, "V": 32, "dtype": "float32"}


def test_to_dict_is_json_and_matches_the_records(report):
    data = json.loads(report.to_json())  # the README's to_json(): to_dict() as JSON text
    assert data == json.loads(json.dumps(report.to_dict()))
    assert data["target"] == "trn2" and data["inner"] == "eager"
    assert {"graphs", "passes", "sites", "notes"} <= set(data)
    assert data["sites"][0]["plan"] == {"T": 2048, "chunk_size": 128, "n_chunks": 16, "padding": 0}
    assert data["passes"][0]["nodes_before"] == len(report.graph("before").graph.nodes)
    assert data["graphs"][0]["passes"][:3] == ["unroll_loops", "recognise_gla", "retile_gla"]


def test_text_summary(report):
    text = str(report)
    assert "target=trn2" in text
    assert "retile_gla" in text and "2 of 2 GLA sites re-tiled at chunk 128" in text
    # Each site's row: T, chunk, chunks, padding (K is 16 too, so the columns are matched together).
    assert len(re.findall(r"\bretiled\s+2048\s+128\s+16\s+0\s", text)) == 2, text


def test_the_readme_example_of_the_rewrite_is_tiny_at_2048(report):
    """docs/passes.md, "What the re-tiling pass does": the scale is K ** -0.5 for tiny's K = 16, chunks of 128 and 16."""
    K = report.sites[0].shape["K"]
    assert K**-0.5 == 0.25
    before, after = report.graph("before").code, report.graph("after").code
    gates = re.search(r"(\w+) = (\w+) / 16\.0\b", before).group(1)  # tiny's gates: logsigmoid(...) / 16
    assert re.search(rf"torch\.ops\.laplace\.gla\.default\(\w+, \w+, \w+, {gates}, None, 0\.25, 'laplace\.gla'\)",
                     before)
    # Gates <= 0 by construction go to the op unchecked (NOTE [gates proven <= 0]).
    FileCheck().check_not("check_gates").check(
        "torch.ops.laplace.chunked_gla.default(").check(f", {gates}, None, 0.25, 128, 16, False)").run(after)
    assert {s.gates for s in report.sites} == {"<= 0 by construction: logsigmoid / 16.0"}


def test_graph_before_and_after_are_distinct_snapshots(report):
    before, after = report.graph("before"), report.graph("after")
    assert any(n.target == torch.ops.laplace.gla.default for n in before.graph.nodes)
    assert not any(n.target == torch.ops.laplace.gla.default for n in after.graph.nodes)
    assert report.graph("after", "backward_0") is report.graph_record("backward_0").after
    with pytest.raises(ValueError, match="stage must be one of"):
        report.graph("during")
    with pytest.raises(LookupError, match="no graph named 'forward_9'"):
        report.graph("after", "forward_9")


def test_a_pass_that_changed_nothing_shares_the_previous_snapshot(report):
    """Snapshots are copies, one per pass that changed the graph; the others share the copy before them."""
    dynamo = report.graph_record("dynamo_0")
    labels = [label for label, _ in dynamo.snapshots]
    assert labels == ["input", "unroll_loops", "recognise_gla", "retile_gla", "fla_calls"]
    by_label = dict(dynamo.snapshots)
    assert by_label["retile_gla"] is not by_label["input"]  # re-tiled: a copy of its own
    assert by_label["recognise_gla"] is by_label["unroll_loops"] is by_label["input"]  # nothing to change
    assert by_label["fla_calls"] is by_label["retile_gla"]  # reports only: nothing changed


def test_a_pass_that_says_unchanged_but_changed_the_graph_still_gets_a_copy():
    """`modified=False` is checked against the graph (node count, gm.meta), not taken on trust."""
    from laplace_passes.infra.pass_base import GraphPass, PassResult, run_passes
    from laplace_passes.infra.report import Report

    class Says(GraphPass):
        def __init__(self, name, change):
            self.name, self.change = name, change

        def call(self, gm):
            self.change(gm)
            return PassResult(gm, modified=False, summary="says nothing changed")

    def add_node(gm):
        x = next(iter(gm.graph.nodes))
        with gm.graph.inserting_after(x):
            gm.graph.call_function(torch.neg, (x,))

    def annotate(gm):
        gm.meta["finding"] = "noted"

    class Swaps(GraphPass):  # same node count, same meta: only its word says the graph changed
        name = "swaps"

        def call(self, gm):
            (add,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.add]
            add.target = operator.sub
            return PassResult(gm, modified=True, summary="add -> sub")

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    report = Report()
    record = report.new_graph("dynamo", gm)
    run_passes(gm, [Says("quiet", lambda gm: None), Says("adds", add_node), Says("notes", annotate), Swaps()],
               record, report)
    snapshots = dict(record.snapshots)
    assert snapshots["quiet"] is snapshots["input"]
    assert snapshots["adds"] is not snapshots["quiet"] and "neg" in snapshots["adds"].code
    assert snapshots["notes"] is not snapshots["adds"] and snapshots["notes"].meta["finding"] == "noted"
    assert "finding" not in snapshots["adds"].meta
    assert "x - 1" in snapshots["swaps"].code and "x + 1" in snapshots["notes"].code


def test_inspect_leaves_gradients_alone_and_can_repeat():
    torch.manual_seed(0)
    model = model_zoo.build("tiny")
    ids = torch.randint(0, 128, (1, 64))
    first = laplace_passes.inspect(model, ids, target="cpu")
    second = laplace_passes.inspect(model, ids, target="trn2")
    assert all(p.grad is None for p in model.parameters())
    assert first.sites[0].plan["chunk_size"] == 64 and second.sites[0].plan["chunk_size"] == 128


def test_last_report_follows_torch_compile():
    def f(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    q = torch.randn(1, 10, 1, 4)
    torch.compile(f, backend="laplace", options={"target": "cpu"})(q, q, q, -q.abs())
    assert laplace_passes.last_report().sites[0].plan["T"] == 10


def test_the_text_explains_the_columns_of_the_tables_it_shows(report):
    """One legend line per explained column, only for the tables present: tiny's report has GLA sites and graph
    sizes, no Muon traffic."""
    from laplace_passes.infra.report import COLUMNS

    text = str(report)
    legend = text[text.index("\ncolumns:\n"):].splitlines()[2:]
    explained = {line.split("  ")[1].strip(): line for line in legend if line.startswith("  ")}
    for column in ("whole-tile mm", "small mm", "padding", "saved for bwd", "chunk", "budget"):
        assert column in explained and COLUMNS[column] in explained[column], column
    assert "whole 128 x 128 TensorEngine tiles" in explained["whole-tile mm"]
    assert not {"received before", "NS GFLOP after", "lower bound"} & set(explained)  # no Muon table here
    assert len(legend) == len(explained)  # one line each


def test_a_report_without_tables_has_no_legend():
    assert "columns:" not in str(laplace_passes.Report(target="cpu", inner="eager"))


def test_a_call_past_dynamo_s_recompile_limit_is_noted_on_the_latest_report():
    """Past the limit the call runs uncompiled and no laplace compile happens: the report says so, once."""
    torch._dynamo.reset()

    def doubled(x):
        return x * 2

    compiled = torch.compile(doubled, backend="laplace", options={"target": "cpu"}, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled(torch.ones(2))
        report = laplace_passes.last_report()
        assert not report.notes
        for size in (3, 4):  # each over the limit: eager, and Dynamo warns once
            assert compiled(torch.ones(size)).tolist() == [2.0] * size
    assert laplace_passes.last_report() is report
    (note,) = report.notes
    assert note.startswith("'doubled' (") and "a later call ran uncompiled, as will every call after it" in note
    assert "Dynamo hit config.recompile_limit (1)" in note and note in str(report)
