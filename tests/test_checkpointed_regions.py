"""GLA in regions Dynamo gives a body of their own: activation checkpointing, nested compile regions.

Dynamo puts a checkpointed region into a body graph that a higher-order op
calls once (NOTE [run-once bodies] in `laplace_passes.infra.fx_helpers`).
The loop is there, not in the graph: without looking into bodies, a token
loop went through un-tiled with an empty "recurrences" table, and a
`while_loop` or `scan` under checkpointing failed in AOT Autograd (as it does
with torch's own `aot_eager`). Each case is compared with the same loop run
eagerly (outputs and every input or parameter gradient); the report must
name the body the loop was found in.

A `torch.compiler.nested_compile_region` is a body called at every use:
the `inline_regions` pass copies it in at each call (NOTE [nested compile
regions: before and after] in `laplace_passes.unroll.regions`), so that
recognition finds its loops and, on trn2, each site's chunk loop is
unrolled and counted in the graph's size.
"""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

import laplace_passes
import model_zoo
from model_zoo.gla_lm import GatedLinearAttention, GLALM
from tests import recognise_cases as cases
from laplace_passes.infra.pass_base import run_pass
from laplace_passes.unroll import InlineRegions
from tests.test_recognise import (
    assert_close, case_inputs, compiled, compiled_equal_to, dynamo_graph, outputs_and_grads,
)


def checkpointed(fn, use_reentrant=False):
    def run(*args):
        return checkpoint.checkpoint(fn, *args, use_reentrant=use_reentrant)

    return run


# name -> the eager reference: torch 2.13's eager scan fails under checkpointing and its eager while_loop gives
# wrong input gradients, so those two are compared with the same loop written elementwise.
CASES = {
    "elementwise": cases.elementwise,
    "while_looped": cases.elementwise,
    "scanned": cases.elementwise,
    "quadratic_key_gates": cases.quadratic_key_gates,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_loop_under_checkpointing_becomes_a_gla_site_in_its_body(name):
    model = compiled_equal_to(CASES[name], checkpointed(getattr(cases, name)), case_inputs(name))
    report = model.laplace_report
    (row,) = report.recurrences
    assert row.status == "GLA site" and row.node.startswith("wrap_body_0."), row
    (site,) = report.sites
    assert site.status == "retiled" and site.node.startswith("wrap_body_0."), site
    body = report.graph("after", "dynamo_0").wrap_body_0
    assert [n.target for n in body.graph.nodes if n.op == "call_function"].count(
        torch.ops.laplace.chunked_gla.default) == 1
    assert len(body.graph.nodes) < 60, len(body.graph.nodes)  # no T-step chain left in the body


def test_a_reentrant_checkpoint_trains_through_backward():
    """use_reentrant=True (the default of older code) cannot be differentiated with autograd.grad: .backward()."""
    args = case_inputs("elementwise")
    expected_out, expected_grads = outputs_and_grads(cases.elementwise, args)
    model = compiled(checkpointed(cases.elementwise, use_reentrant=True))
    out, state = model(*args)
    torch.testing.assert_close(out, expected_out[0], rtol=2e-5, atol=2e-5)
    weights = [torch.linspace(-1, 1, o.numel()).view_as(o) for o in (out, state)]
    sum((o * w).sum() for o, w in zip((out, state), weights)).backward()
    assert_close([a.grad for a in args], expected_grads)
    assert [r.status for r in model.laplace_report.recurrences] == ["GLA site"]


def test_a_near_miss_in_a_body_is_declined_with_its_reason_and_unchanged_numbers():
    args = case_inputs("extra_term")
    expected_out, expected_grads = outputs_and_grads(checkpointed(cases.extra_term), args)
    model = compiled(checkpointed(cases.extra_term))
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out, rtol=0, atol=0)
    assert_close(grads, expected_grads, rtol=1e-6, atol=1e-6)
    (row,) = model.laplace_report.recurrences
    assert row.status == "declined" and row.node.startswith("wrap_body_0.")
    assert "its update adds 2 terms besides the decayed state" in row.reason
    assert not model.laplace_report.sites


class TokenLoopAttention(GatedLinearAttention):
    """GLA's recurrence as a team would write it: a Python loop over the tokens, no call to this project."""

    def recurrence(self, q, k, v, gk, initial_state, output_final_state):
        B, T, H, K = q.shape
        S = q.new_zeros(B, H, K, v.shape[-1])
        outputs = []
        for t in range(T):
            S = S * gk[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            outputs.append((q[:, t, :, :, None] * S).sum(-2) * K ** -0.5)
        return torch.stack(outputs, 1), (S if output_final_state else None)


class CheckpointedTokenLoopLM(GLALM):
    """`tiny` with `TokenLoopAttention` and every block under torch.utils.checkpoint, as a training run does."""

    def __init__(self, config):
        super().__init__(config)
        for layer in self.layers:
            layer.attn.__class__ = TokenLoopAttention
            forward = layer.forward
            layer.forward = lambda *a, _f=forward, **kw: checkpoint.checkpoint(_f, *a, use_reentrant=False, **kw)


def test_a_checkpointed_language_model_trains_like_tiny_through_recognised_sites():
    torch.manual_seed(0)
    model, reference = CheckpointedTokenLoopLM(model_zoo.config("tiny")), model_zoo.build("tiny")
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    F.cross_entropy(reference(ids).flatten(0, 1), ids.flatten()).backward()
    torch._dynamo.reset()
    compiled_model = laplace_passes.compile(model, target="cpu", chunk_size=16)
    F.cross_entropy(compiled_model(ids).flatten(0, 1), ids.flatten()).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    report = compiled_model.laplace_report
    assert [(r.status, r.steps) for r in report.recurrences] == [("GLA site", 40)] * 2
    assert sorted(s.node.split(".")[0] for s in report.sites) == ["wrap_body_0", "wrap_body_1"]
    assert [(s.status, s.plan["n_chunks"]) for s in report.sites] == [("retiled", 3)] * 2


region = torch.compiler.nested_compile_region(cases.elementwise)


def region_twice(q, k, v, g):
    o, state = region(q, k, v, g)
    o_doubled, _ = region(q * 2, k, v, g)
    return o + o_doubled, state


def elementwise_twice(q, k, v, g):
    o, state = cases.elementwise(q, k, v, g)
    return o + cases.elementwise(q * 2, k, v, g)[0], state


def test_a_loop_in_a_nested_compile_region_is_found_at_each_call():
    model = compiled_equal_to(elementwise_twice, region_twice, case_inputs("elementwise"))
    report = model.laplace_report
    (inlined,) = [p for p in report.passes if p.name == "inline_regions"]
    assert inlined.summary == "inlined 2 call(s) of 1 nested compile region(s): subgraph_0" and inlined.modified
    assert [r.status for r in report.recurrences] == ["GLA site"] * 2
    assert [s.status for s in report.sites] == ["retiled"] * 2
    after = report.graph("after", "dynamo_0")
    assert not [n for n in after.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]


class RegionBlock(model_zoo.GLABlock):
    """tiny's block as a nested compile region: traced once, called per layer."""

    @torch.compiler.nested_compile_region
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def test_tiny_with_region_blocks_on_trn2_unrolls_every_site_s_chunk_loop():
    """Without inlining, the one re-tiled site stayed inside the region: unrolled nowhere, not measured."""
    torch.manual_seed(0)
    model, reference = model_zoo.build("tiny"), model_zoo.build("tiny")
    reference.load_state_dict(model.state_dict())
    for layer in model.layers:
        layer.__class__ = RegionBlock
    ids = torch.randint(0, 128, (2, 256), generator=torch.Generator().manual_seed(3))
    F.cross_entropy(reference(ids).flatten(0, 1), ids.flatten()).backward()
    torch._dynamo.reset()
    compiled_model = laplace_passes.compile(model, target="trn2")
    F.cross_entropy(compiled_model(ids).flatten(0, 1), ids.flatten()).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    report = compiled_model.laplace_report
    assert [(s.status, s.plan["n_chunks"]) for s in report.sites] == [("retiled", 2)] * 2
    unrolled = sorted((g.name, loop.kind, loop.trip_count) for g in report.graphs for loop in g.loops
                      if loop.status == "unrolled")
    assert unrolled == ([("backward_0", "laplace.chunked_gla_backward", 2)] * 2
                        + [("forward_0", "laplace.chunked_gla", 2)] * 2)


def test_a_call_whose_result_is_read_whole_is_declined_and_left():
    gm, _ = dynamo_graph(region_twice, *case_inputs("elementwise"))
    call = next(n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph)
    output = gm.graph.output_node()
    output.args = ((*output.args[0], call),)
    outcome = run_pass(InlineRegions(), gm)
    assert outcome.declined == [f"{call.name}: its results are read whole, not element by element"]
    assert outcome.summary == "inlined 1 call(s) of 1 nested compile region(s): subgraph_0"
    assert call.graph is gm.graph


def fla_loss_and_grads(model, ids):
    torch._dynamo.reset()
    compiled_model = laplace_passes.compile(model, target="cpu")
    compiled_model(input_ids=ids, labels=ids).loss.backward()
    return compiled_model, {name: p.grad for name, p in model.named_parameters()}


def test_fla_retnet_under_gradient_checkpointing_says_how_dynamo_traces_it_then_trains():
    """fla's RotaryEmbedding caches on itself in its forward: Dynamo runs such a checkpointed block eagerly,
    where fla's Triton kernels cannot run. The error names the Dynamo setting; with it, the block is traced
    and trains as the model without checkpointing does."""
    pytest.importorskip("fla.models")
    from laplace_passes.fla import FlaCallNotReplaced

    torch.manual_seed(0)
    model, reference = model_zoo.build("fla-retnet-tiny"), model_zoo.build("fla-retnet-tiny")
    reference.load_state_dict(model.state_dict())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 128, (2, 96), generator=torch.Generator().manual_seed(3))
    _, expected = fla_loss_and_grads(reference, ids)
    with pytest.raises(FlaCallNotReplaced, match=r"inside torch.utils.checkpoint, eagerly.*"
                                                 r"skip_fwd_side_effects_in_bwd_under_checkpoint = True"):
        fla_loss_and_grads(model, ids)
    model.zero_grad()
    # Dynamo's own patch: pytest's monkeypatch deletes the setting from Dynamo's config when it restores it.
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        compiled_model, grads = fla_loss_and_grads(model, ids)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert sorted(s.node.split(".")[0] for s in compiled_model.laplace_report.sites) == ["wrap_body_0", "wrap_body_1"]
