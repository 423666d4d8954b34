"""GLA found by what it computes: token loops written in plain PyTorch become GLA sites, near misses do not.

Every case is compiled with the laplace backend (cpu target, chunk 8, so a
20-step loop is three chunks) and compared with the same function run
eagerly: every output and every input gradient. The graph is checked too:
after recognition the Dynamo graph holds one chunked GLA call and no
T-step chain; the report's "recurrences" table has the loop's row. A near
miss must leave the numbers exactly as they were, with its reason.
"""

import pytest
import torch
import torch.nn.functional as F

import laplace_passes
from laplace_passes.fx.gla_build import GlaBuilder
from laplace_passes.fx.recognise import RecogniseGLA
from laplace_passes.infra.pass_base import run_pass
from tests import recognise_cases as cases

RECOGNISED = {
    "elementwise": "per-key gates",
    "einsum_bhtk": "per-key gates",
    "matmul_cat": "per-key gates",
    "outer_unbatched": "per-key gates, state [8, 6]",
    "preallocated": "per-key gates",
    "with_initial_state": "per-key gates",
    "scanned": "token loop (unrolled scan)",
    "while_looped": "token loop (unrolled while_loop)",
    "head_gates": "per-head scalar gates",
    "retnet": "per-head scalar gates",
    "linear_attention": "no gate",
    "fixed_decay": "a fixed decay 0.9",
    "hgrn2": "per-key gates",
    "grouped_heads": "per-key gates",
    "grouped_broadcast": "per-key gates",
    "last_token_readout": "per-key gates",
    "fused_projection": "per-key gates",
    "in_place_sum": "per-key gates",
    "in_place_chain": "per-key gates",
    "projected_in_the_loop": "per-key gates",
    "decay_after_sum": "per-key gates",
    "add_statement": "per-key gates",
    "mamba2_ssd": "per-head scalar gates, state [2, 2, 6, 8] (key dim 3, value dim 2)",
    "head_decay_after_sum": "per-head scalar gates",
    "gates_changed_before_the_loop_reads_them": "per-key gates",
}

NEAR_MISSES = {
    "extra_term": "its update adds 2 terms besides the decayed state",
    "positive_gate": "its decay is exp of a value >= 0 by construction",
    "reads_previous_output": "a step that depends on the previous output",
    "vector_state": "its update adds a term that is not an outer product of the step's inputs",
    "backwards": "a loop that runs backwards",
    "state_through_tanh": "its update reads its previous state through tanh (tanh, an op the algebra does not read)",
    "decay_after_sum_final_only": "step 1's decay is not computed like step 0's",
    "value_decay_after_sum": "its decay reads dimension 3 of the state, which its readout keeps (the readout "
                             "sums over dimension 2)",
    "gates_changed_after_the_loop": "mul_ writes in place to g while it is read: the GLA call reads its inputs "
                                    "once, where the results are first read",
    "gates_changed_inside_the_loop": "mul_ writes in place to g while it is read",
    "gates_changed_while_steps_are_read": "imul writes in place to g (through getitem",
}


def case_inputs(name: str, dtype=torch.float32):
    gates = "head" if name in ("head_gates", "head_decay_after_sum") else "key"
    args = cases.inputs("bhtk" if name == "einsum_bhtk" else "bthk", gates,
                        dtype=dtype)
    if name == "with_initial_state":
        args = args + (torch.randn(cases.B, cases.H, cases.K, cases.V, generator=torch.Generator().manual_seed(7)),)
    return [a.clone().requires_grad_() for a in args]


def outputs_and_grads(fn, args):
    out = fn(*args)
    out = out if isinstance(out, tuple) else (out,)
    weights = [torch.linspace(-1, 1, o.numel()).view_as(o) for o in out]
    loss = sum((o * w).sum() for o, w in zip(out, weights))
    grads = torch.autograd.grad(loss, args, allow_unused=True)
    return [o.detach() for o in out], grads


def compiled(fn):
    torch._dynamo.reset()
    return laplace_passes.compile(fn, target="cpu", chunk_size=8)


def assert_close(found, expected, rtol=2e-5, atol=2e-5):
    for f, e in zip(found, expected):
        if e is None:
            assert f is None or not f.abs().any()
            continue
        torch.testing.assert_close(f, e, rtol=rtol, atol=atol)


def compiled_equal_to(reference, fn, args):
    """`fn` compiled (`compiled`), its outputs and input gradients checked against `reference` run eagerly."""
    expected_out, expected_grads = outputs_and_grads(reference, args)
    model = compiled(fn)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out)
    assert_close(grads, expected_grads)
    return model


@pytest.mark.parametrize("name", sorted(RECOGNISED))
def test_a_token_loop_becomes_one_gla_site_with_equal_outputs_and_gradients(name):
    fn = getattr(cases, name)
    # torch's eager while_loop gives wrong input gradients (torch 2.13); the same loop written elementwise is
    # the reference there.
    reference = cases.elementwise if name == "while_looped" else fn
    model = compiled_equal_to(reference, fn, case_inputs(name))

    report = model.laplace_report
    (row,) = report.recurrences
    assert row.status == "GLA site" and RECOGNISED[name] in row.form, row
    assert row.steps == cases.T
    dynamo = report.graph("after", "dynamo_0")
    calls = [n for n in dynamo.graph.nodes if n.target is torch.ops.laplace.chunked_gla.default]
    assert len(calls) == 1
    # No T-step chain is left: a constant number of nodes, whatever T.
    assert len(dynamo.graph.nodes) < 60, len(dynamo.graph.nodes)
    (site,) = report.sites
    assert site.status == "retiled" and site.plan["n_chunks"] == 3 and site.origin == row.form


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_a_near_miss_is_declined_with_its_reason_and_unchanged_numbers(name):
    fn = getattr(cases, name)
    args = case_inputs(name)
    expected_out, expected_grads = outputs_and_grads(fn, args)
    model = compiled(fn)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out, rtol=0, atol=0)
    assert_close(grads, expected_grads, rtol=1e-6, atol=1e-6)
    report = model.laplace_report
    (row,) = report.recurrences
    assert row.status == "declined" and NEAR_MISSES[name] in row.reason, row.reason
    assert row.reason.startswith(f"a {row.steps}-step loop carrying a {row.state} state, but ")
    assert not report.sites
    assert "recognise_gla" in {p.name for p in report.passes if any(r.startswith(row.node) for r in p.declined)}


@pytest.mark.parametrize("name", ["per_head_loops", "per_head_loops_bhtk"])
def test_a_loop_per_head_is_one_gla_site_per_head(name):
    """NOTE [an index of several numbers]: q[:, t, h] (or q[:, h, t]) holds the token's position and a
    constant head; the number that changes between two steps is the position."""
    fn = getattr(cases, name)
    model = compiled_equal_to(fn, fn, case_inputs("elementwise"))
    report = model.laplace_report
    assert [(r.status, r.steps, r.state) for r in report.recurrences] == \
        [("GLA site", cases.T, [cases.B, cases.K, cases.V])] * cases.H, report.recurrences
    dynamo = report.graph("after", "dynamo_0")
    assert len([n for n in dynamo.graph.nodes if n.target is torch.ops.laplace.chunked_gla.default]) == cases.H
    assert len(dynamo.graph.nodes) < 100, len(dynamo.graph.nodes)  # no T-step chain left, no stack of T steps


def reset_inputs(gates):
    q, k, v, _ = cases.inputs()
    return [x.clone().requires_grad_() for x in (q, k, v, gates)]


@pytest.mark.parametrize("name", ["masked_reset", "saturated_decay"])
def test_a_reset_in_a_trained_decay_gets_the_loop_s_gradients_not_nan(name):
    """NOTE [resets in a trained decay]: a decay of exactly 0 (the mask's zeros; 1 - sigmoid(20) in fp32)
    reaches log(decay); the trained input's gradient there is the loop's own 0, where log's derivative
    made it NaN."""
    x = torch.randn(cases.B, cases.T, cases.H, cases.K, generator=torch.Generator().manual_seed(3)) + 2
    x = torch.where(cases.RESETS == 0, 20.0, x) if name == "saturated_decay" else x
    args = reset_inputs(x)
    fn = getattr(cases, name)
    model = compiled_equal_to(fn, fn, args)
    (row,) = model.laplace_report.recurrences
    assert row.status == "GLA site", row
    _, grads = outputs_and_grads(model, args)
    at_resets = grads[3] * (1 - cases.RESETS)
    assert torch.isfinite(grads[3]).all() and not at_resets.any()


def test_a_decay_given_as_exactly_zero_gets_the_gradient_zero_there():
    """A decay that is itself the input, 0 at the resets: the outputs and the q, k, v gradients are the
    loop's; the decay's gradient is the loop's except at the zeros, where it is 0 as for a flushed decay."""
    # Decays of 0.5 or more elsewhere: the gradient of log(decay) is the gate's over the decay, which
    # scales the gate's rounding error by 1 / decay.
    decay = (torch.rand(cases.B, cases.T, cases.H, cases.K, generator=torch.Generator().manual_seed(4)) + 1) / 2
    decay = decay * cases.RESETS
    args = reset_inputs(decay)
    expected_out, expected_grads = outputs_and_grads(cases.decay_as_given, args)
    out, grads = outputs_and_grads(compiled(cases.decay_as_given), args)
    assert_close(out, expected_out)
    assert_close(grads[:3], expected_grads[:3])
    resets = (decay == 0).expand_as(decay)
    assert resets.any() and expected_grads[3][resets].abs().min() > 0  # the loop's own is not 0 there
    assert torch.isfinite(grads[3]).all() and not grads[3][resets].any()
    torch.testing.assert_close(grads[3][~resets], expected_grads[3][~resets], rtol=2e-5, atol=2e-5)


def dynamo_graph(fn, *args) -> tuple[torch.fx.GraphModule, list]:
    """The graph Dynamo captures of `fn(*args)`, and its inputs in the graph's order."""
    captured = []

    def backend(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    (found,) = captured
    return found


def test_the_pass_on_a_bare_graph_module():
    args = [a.detach() for a in case_inputs("elementwise")]
    gm, inputs = dynamo_graph(cases.elementwise, *args)
    expected = gm(*inputs)
    result = run_pass(RecogniseGLA(), gm)
    assert result.modified and result.summary == "1 of 1 loops carrying a state rewritten as GLA sites"
    (row,) = result.recurrences
    assert row.status == "GLA site" and row.steps == cases.T
    code = result.graph_module.code
    assert code.count("torch.ops.laplace.gla.default") == 1 and "exp" not in code
    for found, want in zip(result.graph_module(*inputs), expected):
        torch.testing.assert_close(found, want, rtol=1e-5, atol=1e-5)


def test_a_rewrite_that_computes_something_else_is_caught_on_random_inputs(monkeypatch):
    """The canonical form is checked, not trusted: gates read wrong (doubled) are found and the loop kept."""
    original = GlaBuilder.gates

    def doubled(self):
        gates, width = original(self)
        return self.call(torch.mul, gates, 2.0), width

    monkeypatch.setattr(GlaBuilder, "gates", doubled)
    args = case_inputs("elementwise")
    expected_out, _ = outputs_and_grads(cases.elementwise, args)
    model = compiled(cases.elementwise)
    out, _ = outputs_and_grads(model, args)
    assert_close(out, expected_out, rtol=0, atol=0)
    (row,) = model.laplace_report.recurrences
    assert row.status == "declined" and "on random inputs its GLA form differs from the loop" in row.reason


def test_an_internal_error_declines_instead_of_breaking_the_compile(monkeypatch):
    def broken(self, *args, **kwargs):
        raise IndexError("planted")

    monkeypatch.setenv("LAPLACE_PASSES_STRICT", "0")  # what a user gets; strict mode raises it (below)

    monkeypatch.setattr(GlaBuilder, "gla_inputs", broken)
    args = case_inputs("elementwise")
    expected_out, _ = outputs_and_grads(cases.elementwise, args)
    model = compiled(cases.elementwise)
    out, _ = outputs_and_grads(model, args)
    assert_close(out, expected_out, rtol=0, atol=0)
    (row,) = model.laplace_report.recurrences
    assert "left alone after an internal error while rewriting it: IndexError: planted" in row.reason
    monkeypatch.setenv("LAPLACE_PASSES_STRICT", "1")
    with pytest.raises(Exception, match="planted"):
        outputs_and_grads(compiled(cases.elementwise), args)


def test_bfloat16_loops_are_recognised_within_bf16_rounding():
    args = case_inputs("elementwise", dtype=torch.bfloat16)
    expected_out, _ = outputs_and_grads(cases.elementwise, [a.float() for a in args])
    model = compiled(cases.elementwise)
    out, _ = outputs_and_grads(model, args)
    for found, want in zip(out, expected_out):
        assert ((found.float() - want).norm() / want.norm()) < 2e-2
    assert model.laplace_report.recurrences[0].status == "GLA site"


def gates_inside(q, k, v, x):
    """Gates made inside the compiled function, logsigmoid(x) / 4: provably <= 0 through the rewrite."""
    return cases.elementwise(q, k, v, F.logsigmoid(x) / 4)


def test_gates_built_inside_are_proven_and_not_checked_at_run_time():
    args = case_inputs("elementwise")
    model = compiled(gates_inside)
    expected_out, expected_grads = outputs_and_grads(gates_inside, args)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out)
    assert_close(grads, expected_grads)
    (site,) = model.laplace_report.sites
    assert site.gates.startswith("<= 0 by construction"), site.gates


def test_the_option_turns_recognition_off():
    torch._dynamo.reset()
    model = laplace_passes.compile(cases.elementwise, target="cpu", recognise_gla=False)
    model(*[a.detach() for a in case_inputs("elementwise")])
    assert not model.laplace_report.recurrences and not model.laplace_report.sites
    assert "recognise_gla" not in {p.name for p in model.laplace_report.passes}


def test_plain_tiny_your_model_unchanged_trains_like_tiny_through_two_recognised_sites():
    """model_zoo's plain-tiny (a scan over tokens, no call to this project) against tiny (the GLA op) with the
    same weights: logits and every parameter gradient, compiled for trn2; each layer's loop a GLA site."""
    import model_zoo

    torch.manual_seed(0)
    plain, reference = model_zoo.build("plain-tiny"), model_zoo.build("tiny")
    reference.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 128, (2, 160), generator=torch.Generator().manual_seed(3))
    expected = reference(ids)
    expected.square().mean().backward()
    torch._dynamo.reset()
    compiled_model = laplace_passes.compile(plain, target="trn2")
    logits = compiled_model(ids)
    logits.square().mean().backward()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(plain.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    report = compiled_model.laplace_report
    assert [(r.status, r.steps) for r in report.recurrences] == [("GLA site", 160)] * 2
    assert all("unrolled scan" in r.form for r in report.recurrences)
    assert [(s.status, s.plan["n_chunks"], s.gates.startswith("<= 0")) for s in report.sites] == [("retiled", 2, True)] * 2


QUADRATIC = {
    "quadratic_head_gates": "per-head gates summed cumulatively",
    "quadratic_einsum": "per-head gates summed cumulatively",
    "quadratic_cumprod": "per-head decays multiplied cumulatively",
    "quadratic_zeros_like_fill": "per-head gates summed cumulatively",
    "quadratic_zeros_like_fill_first": "per-head gates summed cumulatively",
    "quadratic_retnet": "a fixed decay per head raised to i - j",
    "quadratic_linear": "no gate",
    "quadratic_key_gates": "per-key gates summed cumulatively",
    "quadratic_log_mask": "per-head gates summed cumulatively",
    "quadratic_tril_before_exp": "per-head gates summed cumulatively",
    "quadratic_constant_decay": "a fixed decay per head raised to i - j",
    "quadratic_scores_masked": "no gate",
    "quadratic_fill_first": "per-head gates summed cumulatively",
    "quadratic_zero_fill_before_exp": "per-head gates summed cumulatively",
    "quadratic_scores_masked_fill_first": "no gate",
}
QUADRATIC_NEAR_MISSES = {
    "quadratic_unmasked": "no causal mask",
    "quadratic_ones_like_fill": "masked with 1.0 where the mask drops entries, not 0",
    "quadratic_full_like_fill": "masked with 0.5 where the mask drops entries, not 0",
    "quadratic_upper_mask": "keeps the upper triangle",
    "quadratic_log_upper_mask": "its mask drops keys at or before the query and keeps later ones: not causal",
    "quadratic_constant_not_powers": "a constant that is not one decay per head raised to the power i - j",
    "quadratic_tril_before_exp_only": "no causal mask",
    "quadratic_scores_masked_upper": "a constant that is not a causal mask",
    "quadratic_zero_fill_below_before_exp": "not built from a cumulative sum",
    "quadratic_mask_changed_in_place": "setitem writes in place to mask before it is read: the form is read from "
                                       "how its values are built, so a mask, decay or operand changed in place",
    "quadratic_decay_changed_in_place": "masked_fill_ writes in place to D before it is read",
    "quadratic_mask_from_values": "is computed from the values of the graph's inputs",
    "quadratic_gates_changed_after_the_decays": "mul_ writes in place to g while it is read",
}


def saved_shapes(fn, args) -> list[tuple]:
    """The shapes of the tensors autograd keeps for backward while `fn(*args)` runs."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        fn(*args)
    return shapes


@pytest.mark.parametrize("name", sorted(QUADRATIC))
def test_a_quadratic_form_becomes_a_gla_site_and_keeps_no_t_by_t_tensor(name):
    fn = getattr(cases, name)
    args = [a.clone().requires_grad_() for a in cases.inputs("bthk", "key" if "key" in name else "head")]
    expected_out, expected_grads = outputs_and_grads(fn, args)
    model = compiled(fn)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out)
    assert_close(grads, expected_grads)
    (row,) = model.laplace_report.recurrences
    assert row.status == "GLA site" and QUADRATIC[name] in row.form and row.steps == cases.T, row
    T = cases.T
    assert any(shape.count(T) >= 2 for shape in saved_shapes(fn, args))  # eagerly: A and D are kept
    assert not any(shape.count(T) >= 2 for shape in saved_shapes(model, args))


@pytest.mark.parametrize("name", sorted(QUADRATIC_NEAR_MISSES))
def test_a_quadratic_near_miss_is_declined_with_unchanged_numbers(name):
    fn = getattr(cases, name)
    args = [a.clone().requires_grad_() for a in cases.inputs("bthk", "head")]
    expected_out, expected_grads = outputs_and_grads(fn, args)
    model = compiled(fn)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out, rtol=0, atol=0)
    assert_close(grads, expected_grads, rtol=1e-6, atol=1e-6)
    (row,) = model.laplace_report.recurrences
    assert row.status == "declined" and QUADRATIC_NEAR_MISSES[name] in row.reason, row.reason


def in_place_state(q, k, v, g):
    """The state updated in place (under no_grad; eager refuses it with gradients): no chain of states."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        S.mul_(g[:, t].exp()[..., None]).add_(k[:, t, :, :, None] * v[:, t, :, None, :])
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1)


def test_a_state_updated_in_place_gets_a_row_saying_how_to_write_it():
    args = cases.inputs("bthk", "key")
    with torch.no_grad():
        expected = in_place_state(*args)
        model = compiled(in_place_state)
        torch.testing.assert_close(model(*args), expected, rtol=0, atol=0)
    (row,) = model.laplace_report.recurrences
    assert (row.status, row.steps, row.state) == ("declined", cases.T, [cases.B, cases.H, cases.K, cases.V]), row
    assert row.reason.startswith(f"a {cases.T}-step loop carrying a {row.state} state, but its state S is updated "
                                 "in place (add_, mul_): recognition follows a state passed from step to step as a "
                                 "new value; write S = S * a + k v"), row.reason


def test_a_loop_over_a_dynamic_batch_is_declined_naming_the_symbolic_sizes():
    """The canonical algebra reads static sizes: the row says which inputs' sizes are symbolic, and how to get
    graphs of static sizes (the same loop with a static batch is a GLA site: test above)."""
    def elementwise_any_batch(q, k, v, g):  # cases.elementwise, its batch read off q
        S = q.new_zeros(q.shape[0], cases.H, cases.K, cases.V)
        outs = []
        for t in range(cases.T):
            S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append((q[:, t, :, :, None] * S).sum(-2))
        return torch.stack(outs, 1)

    args = [a.clone() for a in cases.inputs("bthk", "key")]
    for a in args:
        torch._dynamo.mark_dynamic(a, 0)
    model = compiled(elementwise_any_batch)
    torch.testing.assert_close(model(*args), elementwise_any_batch(*args), rtol=0, atol=0)
    (row,) = model.laplace_report.recurrences
    assert row.status == "declined" and "a symbolic size (the graph's inputs have symbolic sizes: " in row.reason
    assert " dim 0 = s" in row.reason and "dim 1" not in row.reason, row.reason
    assert row.reason.endswith("torch.compile(..., dynamic=False) compiles one graph per shape in which it can)")


class QuadraticWithAMaskBuffer(torch.nn.Module):
    """The causal mask kept as a buffer, as attention modules often keep it: its values are not in the graph."""

    def __init__(self):
        super().__init__()
        self.register_buffer("causal", cases.causal_mask(cases.T))

    def forward(self, q, k, v, g):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        G = g.transpose(1, 2).cumsum(-1)
        D = torch.exp(G[..., :, None] - G[..., None, :]).masked_fill(~self.causal, 0)
        return ((q @ k.transpose(-1, -2)) * D) @ v


def test_a_quadratic_form_whose_mask_is_a_buffer_is_declined_with_what_to_write_instead():
    module = QuadraticWithAMaskBuffer()
    args = [a.clone().requires_grad_() for a in cases.inputs("bthk", "head")]
    expected_out, expected_grads = outputs_and_grads(module, args)
    model = compiled(module)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out, rtol=0, atol=0)
    assert_close(grads, expected_grads, rtol=1e-6, atol=1e-6)
    (row,) = model.laplace_report.recurrences
    assert row.status == "declined", row
    assert "torch.bool tensor that comes from the graph's inputs (a mask held in a buffer" in row.reason, row.reason
    assert "a causal mask built inside forward from its sizes" in row.reason, row.reason


CHUNKED = {
    "chunked_simple_gla": ("head", "5 chunks of 4 tokens (20 tokens), per-head gates", "head_gates"),
    "chunked_gla": ("key", "4 chunks of 5 tokens (20 tokens), per-key gates", "elementwise"),
}


@pytest.mark.parametrize("name", sorted(CHUNKED))
def test_a_user_s_own_chunked_algorithm_is_retiled_at_the_target_s_chunk(name):
    gates, form, token_loop = CHUNKED[name]
    fn = getattr(cases, name)
    args = [a.clone().requires_grad_() for a in cases.inputs("bthk", gates)]
    expected_out, expected_grads = outputs_and_grads(fn, args)
    model = compiled(fn)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out)
    assert_close(grads, expected_grads)
    report = model.laplace_report
    (row,) = report.recurrences
    assert row.status == "GLA site" and form in row.form and row.steps == cases.T, row
    (site,) = report.sites
    assert site.plan["chunk_size"] == 8 and site.plan["n_chunks"] == 3  # the target's chunk, not the user's
    assert len(report.graph("after", "dynamo_0").graph.nodes) < 60


def test_a_chunked_algorithm_whose_first_chunk_makes_its_own_state_is_declined_with_unchanged_numbers():
    """No S_0 (neither zeros nor an initial state): the first chunk's output reads no state to read the form from."""
    args = [a.clone().requires_grad_() for a in cases.inputs("bthk", "key")]
    expected_out, expected_grads = outputs_and_grads(cases.chunked_gla_without_s0, args)
    model = compiled(cases.chunked_gla_without_s0)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out, rtol=0, atol=0)
    assert_close(grads, expected_grads, rtol=1e-6, atol=1e-6)
    rows = model.laplace_report.recurrences
    (row,) = [r for r in rows if r.steps == 4]  # besides, each chunk's intra-chunk part is a declined quadratic form
    assert row.status == "declined" and "its first chunk starts without a state" in row.reason, row.reason
    assert all(r.status == "declined" for r in rows) and not model.laplace_report.sites


def test_a_chunked_algorithm_slicing_its_chunks_is_declined_saying_to_reshape_them():
    """Chunks sliced out of the sequence have no chunks dimension to read the loop over: the reason says which
    spelling the pass reads, and the numbers stay eager's (each chunk's intra-chunk part is a GLA site of its own)."""
    args = [a.clone().requires_grad_() for a in cases.inputs("bthk", "key")]
    expected_out, expected_grads = outputs_and_grads(cases.chunked_gla_by_slices, args)
    assert_close(expected_out, outputs_and_grads(cases.chunked_gla, args)[0])  # the same algorithm
    model = compiled(cases.chunked_gla_by_slices)
    out, grads = outputs_and_grads(model, args)
    assert_close(out, expected_out)
    assert_close(grads, expected_grads)
    (row,) = [r for r in model.laplace_report.recurrences if r.steps == 4]
    assert row.status == "declined" and "its gates ([2, 2, 5, 8], summed over dimension 2) are not laid out" \
        in row.reason and "reshaped into chunks" in row.reason and "g[:, :, i:i + C]" in row.reason, row.reason


def _loop_from_an_expanded_state(q, k, v, g, S0):
    S, outs = S0.expand(q.shape[0], -1, -1, -1), []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def test_a_first_step_left_as_written_is_named_in_the_loop_s_form():
    """A state broadcast from a parameter (S0.expand(B, ...)): the first step is not read as a step, so the site
    covers the other 19 of 20; the row counts the user's 20 and its form says which step runs as written."""
    S0 = torch.randn(cases.H, cases.K, cases.V, generator=torch.Generator().manual_seed(3))
    q, k, v, g, S0 = (a.clone().requires_grad_() for a in (*cases.inputs("bthk", "key"), S0))
    expected_out, expected_grads = outputs_and_grads(_loop_from_an_expanded_state, [q, k, v, g, S0])
    model = compiled(_loop_from_an_expanded_state)
    out, grads = outputs_and_grads(model, [q, k, v, g, S0])
    assert_close(out, expected_out)
    assert_close(grads, expected_grads)
    (row,) = model.laplace_report.recurrences
    (site,) = model.laplace_report.sites
    assert row.status == "GLA site" and row.steps == cases.T and site.plan["T"] == cases.T - 1
    assert row.form.startswith(f"token loop, {cases.T - 1} steps") and \
        row.form.endswith("; the loop's first step (S_1) is not part of it and runs as written"), row.form


def test_a_counter_as_long_as_a_long_loop_is_read_without_recursion():
    """An unrolled while_loop's counter is a chain of one add per trip: read in graph order, not recursively."""
    from laplace_passes.fx.per_step import constant_value, pattern

    graph = torch.fx.Graph()
    counter = graph.call_function(torch.tensor, (0,))
    for _ in range(3000):  # past Python's recursion limit
        counter = graph.call_function(torch.add, (counter, 1))
    graph.output(counter)
    assert int(constant_value(counter)) == 3000
    assert not pattern(counter, {}).varies


@pytest.mark.parametrize("gammas, per", [((0.5, 0.9), "head"), ((0.5, 0.7, 0.8, 0.9), "key")])
def test_a_constant_decay_matrix_is_read_where_its_entries_underflow_and_per_key(gammas, per):
    """NOTE [a constant decay matrix]: gamma = 0.5 over 160 tokens leaves entries of D that are subnormal or 0 in
    float32, which are still gamma ** (i - j); a constant D per key channel is read per key."""
    T, K, V = 160, len(gammas) if per == "key" else 4, 3
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, T, K, generator=gen).requires_grad_() for _ in range(2))
    v = torch.randn(1, 2, T, V, generator=gen).requires_grad_()

    def retention(q, k, v):
        n = torch.arange(T, dtype=torch.float32)
        distance = (n[:, None] - n[None, :]).clamp(min=0)
        if per == "head":  # [H, T, T]
            D = torch.exp2(distance * torch.tensor(gammas).log2()[:, None, None]) * (n[:, None] >= n)
            return ((q @ k.transpose(-1, -2)) * D) @ v
        D = torch.exp2(distance[..., None] * torch.tensor(gammas).log2()) * (n[:, None] >= n)[..., None]  # [T, T, K]
        return torch.einsum("bhik,bhjk,ijk,bhjv->bhiv", q, k, D, v)

    compiled_equal_to(retention, retention, [q, k, v])
    (row,) = laplace_passes.last_report().recurrences
    assert row.status == "GLA site" and f"a fixed decay per {per} raised to i - j" in row.form, row


def clamped_once(q, k, v, g):
    """The state clamped at step 10 only: two loops, each one GLA site (a row for the op belongs to loops that
    read their state through it at every step, `state_through_tanh`)."""
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        if t == 10:
            S = S.clamp(-5, 5)
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1), S


def test_an_op_on_the_state_at_one_step_cuts_the_loop_there():
    model = compiled_equal_to(clamped_once, clamped_once, case_inputs("elementwise"))
    assert [r.status for r in model.laplace_report.recurrences] == ["GLA site", "GLA site"]
