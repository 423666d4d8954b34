"""`inspect` and the report: what users read and what machines parse."""

import json
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
    retile = report.passes[0]
    assert retile.name == "retile_gla" and retile.modified
    assert retile.nodes_after > retile.nodes_before
    assert [s.plan["n_chunks"] for s in report.sites] == [16, 16]
    assert report.sites[0].shape == {"B": 1, "H": 2, "K": 16, "V": 32, "dtype": "float32"}


def test_to_dict_is_json_and_matches_the_records(report):
    data = json.loads(report.to_json())  # the README's to_json(): to_dict() as JSON text
    assert data == json.loads(json.dumps(report.to_dict()))
    assert data["target"] == "trn2" and data["inner"] == "eager"
    assert {"graphs", "passes", "sites", "notes"} <= set(data)
    assert data["sites"][0]["plan"] == {"T": 2048, "chunk_size": 128, "n_chunks": 16, "padding": 0}
    assert data["passes"][0]["nodes_before"] == len(report.graph("before").graph.nodes)
    assert data["graphs"][0]["passes"][0] == "retile_gla"


def test_text_summary(report):
    text = str(report)
    assert "target=trn2" in text
    assert "retile_gla" in text and "2 of 2 GLA sites re-tiled at chunk 128" in text
    # Each site's row: T, chunk, chunks, padding (K is 16 too, so the columns are matched together).
    assert len(re.findall(r"\bretiled\s+2048\s+128\s+16\s+0\s", text)) == 2, text


def test_the_readme_example_of_the_rewrite_is_tiny_at_2048(report):
    """README, "What the re-tiling pass does": the scale is K ** -0.5 for tiny's K = 16, chunks of 128 and 16."""
    K = report.sites[0].shape["K"]
    assert K**-0.5 == 0.25
    before, after = report.graph("before").code, report.graph("after").code
    assert re.search(r"torch\.ops\.laplace\.gla\.default\(\w+, \w+, \w+, \w+, None, 0\.25, 'laplace\.gla'\)", before)
    FileCheck().check("torch.ops.laplace.check_gates.default(").check(
        "torch.ops.laplace.chunked_gla.default(").check(", None, 0.25, 128, 16)").run(after)


def test_graph_before_and_after_are_distinct_snapshots(report):
    before, after = report.graph("before"), report.graph("after")
    assert any(n.target == torch.ops.laplace.gla.default for n in before.graph.nodes)
    assert not any(n.target == torch.ops.laplace.gla.default for n in after.graph.nodes)
    assert report.graph("after", "backward_0") is report.graph_record("backward_0").after
    with pytest.raises(ValueError, match="stage must be one of"):
        report.graph("during")
    with pytest.raises(LookupError, match="no graph named 'forward_9'"):
        report.graph("after", "forward_9")


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
