"""The compiled decode step: same tokens and logits as the eager reference, the state of the token
recurrence after N steps, updated in place, and no recompile per step or per batch size."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import model_zoo
from model_zoo.decode import LARGE_BATCH, LARGE_BATCH_HINT, SMALL_BATCH_HINT, DecodeStep
from model_zoo.generate import generate

TIGHT = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return model_zoo.build("tiny").eval()


def prompt(batch, length, seed=0):
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def stances(monkeypatch):
    """The keyword arguments of every torch.compiler.set_stance call from here on (each still takes effect)."""
    calls = []
    set_stance = torch.compiler.set_stance
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: calls.append(k) or set_stance(*a, **k))
    return calls


def test_default_generate_is_compiled_and_equals_the_eager_reference(model):
    ids = prompt(3, 5)
    compiled = model.generate(ids, 8, return_logits=True)  # decode="auto": compiled on the CPU
    # The ahead-of-time step, whose loops run the JIT-compiled graph where no library is compiled already.
    assert model.ahead_of_time_step.graphs_compiled() == 1 and model.ahead_of_time_step.graph_break is None
    assert all("no library compiled ahead of time" in note for note in model.ahead_of_time_step.report.notes)
    (site, *_) = model.ahead_of_time_step.report.sites
    assert site.status == "retiled" and site.form.startswith("recurrent: T = 1")
    eager = model.generate(ids, 8, return_logits=True, decode="eager")
    assert torch.equal(compiled.tokens, eager.tokens)
    torch.testing.assert_close(compiled.logits, eager.logits, **TIGHT)


def test_state_after_n_steps_is_the_token_recurrence_updated_in_place(model):
    ids = prompt(4, 6, seed=1)
    step = model.decode_step
    with torch.no_grad():
        logits, states = model(ids[:, :2], output_final_states=True)
        buffers = step.state_buffer(states)
        storages = [b.data_ptr() for b in buffers]
        for t in range(2, ids.shape[1]):
            step_logits = step(ids[:, t], buffers)
        assert step.graphs_compiled() == 1  # the graph the test above compiled, for B = 3
        # The reference: the whole sequence through the model eagerly, one `laplace::gla` per layer.
        full_logits, full_states = model(ids, output_final_states=True)
    assert [b.data_ptr() for b in buffers] == storages
    assert len(buffers) == len(full_states) == 2
    for buffer, state in zip(buffers, full_states):
        torch.testing.assert_close(buffer, state, **TIGHT)
    torch.testing.assert_close(step_logits, full_logits[:, -1], **TIGHT)


def test_the_greedy_choice_is_taken_in_the_graph(model):
    """The step's graph ends in argmax over the logits it returns: greedy decode runs no eager op between steps."""
    ids = prompt(3, 5, seed=3)
    step = model.decode_step
    with torch.no_grad():
        buffers = step.state_buffer(model(ids, output_final_states=True)[1])
        logits, greedy = step.logits_and_greedy(ids[:, -1], buffers)
    assert torch.equal(greedy, logits.argmax(-1))
    (graph,) = [g for g in step.report.graphs if g.kind == "inference"][:1]
    (output,) = graph.after.graph.find_nodes(op="output")
    returned = [node for node in output.args[0] if isinstance(node, torch.fx.Node)]
    argmaxes = [node for node in returned if node.target == torch.ops.aten.argmax.default]
    assert len(argmaxes) == 1, [node.target for node in returned]
    assert argmaxes[0].args[0] in returned  # the argmax of the logits the step returns (a view of them)
    assert step.graphs_compiled() == 1  # the same graph as the logits-only call: no compile of its own


def test_greedy_generate_chooses_only_the_prefills_token_outside_the_graph(model, monkeypatch):
    """Every later greedy token comes from the step's argmax; sampling still chooses each token from the logits."""
    import model_zoo.generate

    calls = []
    choose = model_zoo.generate._choose
    monkeypatch.setattr(model_zoo.generate, "_choose", lambda *a: calls.append(1) or choose(*a))
    ids = prompt(2, 4, seed=4)
    greedy = model.generate(ids, 6)
    assert len(calls) == 1
    assert torch.equal(greedy.tokens, model.generate(ids, 6, decode="eager").tokens)
    calls.clear()
    model.generate(ids, 6, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert len(calls) == 6


def test_in_graph_argmax_breaks_ties_as_eager_does():
    """All logits equal (a zero embedding, tied to the head): both argmaxes take the lowest index, 0."""
    torch.manual_seed(3)
    tiny = model_zoo.build("tiny", num_layers=1).eval()
    with torch.no_grad():
        tiny.embeddings.weight.zero_()
    ids = prompt(3, 4, seed=5)
    compiled = tiny.generate(ids, 4, return_logits=True, decode="compiled")
    eager = tiny.generate(ids, 4, return_logits=True, decode="eager")
    assert torch.equal(compiled.logits, torch.zeros_like(compiled.logits))
    assert torch.equal(compiled.tokens, eager.tokens)
    assert torch.equal(compiled.tokens[:, 4:], torch.zeros(3, 4, dtype=torch.long))


def test_a_loop_gives_the_guarded_steps_tokens_logits_and_states_and_skips_guards_after_its_first(
        model, monkeypatch, stances):
    """NOTE [guards once per loop]: every call after the first runs under skip_guard_eval_unsafe, and computes
    what the step called with every guard computes."""
    # Threads an earlier test left alive would turn the skip off (see the test below): this one is about the skip.
    monkeypatch.setattr(model_zoo.decode, "_only_thread", lambda: True)
    ids = prompt(3, 6, seed=6)
    step = model.decode_step
    with torch.no_grad():
        _, states = model(ids[:, :2], output_final_states=True)
    guarded, looped = step.state_buffer(states), step.state_buffer(states)
    decode_loop = step.loop(looped)
    for t in range(2, 6):
        expected = step.logits_and_greedy(ids[:, t], guarded)
        got = decode_loop(ids[:, t])
        assert torch.equal(got[1], expected[1])
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert all(map(torch.equal, looped, guarded))
    assert stances == [{"skip_guard_eval_unsafe": True}] * 3  # the first call evaluated every guard


def test_a_loop_after_another_steps_graph_at_another_batch_size_skips_guards_without_error(model, monkeypatch):
    """NOTE [guards once per loop]: a step compiled after another step's graph at 64 sequences got guards on its
    inputs' bases' sizes; the loop's later calls pass views, so those guards still find a base."""
    monkeypatch.setattr(model_zoo.decode, "_only_thread", lambda: True)
    earlier = DecodeStep(model, inner="eager")  # the eager inner: the compile that left those guards behind
    with torch.no_grad():
        for step, batch in ((earlier, LARGE_BATCH), (DecodeStep(model), 3)):
            ids = prompt(batch, 3, seed=batch)
            logits, states = model(ids, output_final_states=True)
            decode_loop, token = step.loop(step.state_buffer(states)), logits[:, -1].argmax(-1)
            for _ in range(3):
                _, token = decode_loop(token)
            expected = model.generate(ids, 4, decode="eager").tokens[:, -1]
            assert torch.equal(token, expected)


def _break_the_graph(module, args):
    torch._dynamo.graph_break()


def _branch_on_a_value(module, args):
    if args[0].abs().sum().item() < 0:  # data-dependent Python: never true, so the forward is unchanged
        return (args[0] * 2, *args[1:])
    return None


@pytest.mark.parametrize("hook, why", [(_break_the_graph, "Call to `torch._dynamo.graph_break()`"),
                                       (_branch_on_a_value, None)])
def test_a_forward_with_a_graph_break_decodes_each_batch_as_the_eager_loop_does(stances, hook, why):
    """NOTE [a forward with a graph break]: Dynamo's resumed frames met the buffers' batch classes and failed
    ("expand ... 3 -> s3") inside generate. The step drops the classes, guards every call, and decodes."""
    torch.manual_seed(0)
    model = model_zoo.build("tiny").eval()
    model.layers[1].register_forward_pre_hook(hook)
    step = DecodeStep(model, inner="eager")
    with torch.no_grad():
        for batch in (3, LARGE_BATCH + 6, 1, 5):
            ids = prompt(batch, 3, seed=batch)
            logits, states = model(ids, output_final_states=True)
            decode_loop, token = step.loop(step.state_buffer(states)), logits[:, -1].argmax(-1)
            for _ in range(3):
                _, token = decode_loop(token)
            assert torch.equal(token, model.generate(ids, 4, decode="eager").tokens[:, -1]), batch
    assert step.graph_break is not None and (why is None or step.graph_break == why)
    (note,) = step.report.notes
    assert note.startswith("Dynamo could not compile the decode step as one graph (") and note.endswith(
        "): it runs Dynamo's graphs without batch classes, each call fully guarded, compiled per batch size until "
        "Dynamo makes the batch dynamic"), note
    assert not [k for k in stances if k.get("skip_guard_eval_unsafe")]  # every call guarded
    ids = prompt(3, 4, seed=9)  # generate's default, as a user calls it
    assert torch.equal(model.generate(ids, 5).tokens, model.generate(ids, 5, decode="eager", prefill="eager").tokens)


def test_a_step_past_dynamos_recompile_limit_runs_as_dynamo_would(monkeypatch, stances):
    """The step compiles its graph whole (NOTE [a forward with a graph break]), and Dynamo then raises past its
    recompile limit where it ran the frame "run only": the step does, every call guarded, the limit noted once."""
    monkeypatch.setattr(model_zoo.decode, "_only_thread", lambda: True)
    torch.manual_seed(0)
    model = model_zoo.build("tiny").eval()
    step = DecodeStep(model, inner="eager")
    ids = prompt(3, 3, seed=12)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        for dtype in (torch.long, torch.int32, torch.long):  # Dynamo guards on the dtype: int32 needs a recompile
            _, states = model(ids, output_final_states=True)
            decode_loop, token = step.loop(step.state_buffer(states)), ids[:, -1].to(dtype)
            for _ in range(3):
                _, token = decode_loop(token.to(dtype))
            assert torch.equal(token, model.generate(ids, 4, decode="eager").tokens[:, -1]), dtype
    assert step.graphs_compiled() == 1
    (note,) = step.report.notes
    assert "a later call ran uncompiled, as will every call after it: Dynamo hit config.recompile_limit (1)" in note
    assert len(stances) == 2  # the first loop's later calls skipped guards; none after the limit


def test_each_loop_starts_with_every_guard():
    """A loop's first call compiles when no graph fits (one sequence after a batch); a change of tokens inside a
    loop is refused, not run on a graph made for other inputs."""
    torch.manual_seed(4)
    tiny = model_zoo.build("tiny", num_layers=1).eval()
    step = DecodeStep(tiny, inner="eager")
    for batch, graphs in ((3, 1), (1, 2)):
        with torch.no_grad():
            buffers = step.state_buffer(tiny(prompt(batch, 3), output_final_states=True)[1])
        decode_loop = step.loop(buffers)
        tokens = torch.ones(batch, dtype=torch.long)
        for _ in range(3):
            _, tokens = decode_loop(tokens)
        assert step.graphs_compiled() == graphs
    with pytest.raises(ValueError, match=r"^a decode loop's tokens keep the first step's shape and dtype, \(1,\) "
                                         r"torch.int64; got \(1,\) torch.int32: start a new loop"):
        decode_loop(tokens.int())


def test_a_step_built_to_guard_every_step_never_skips_guards(stances):
    """guards_once_per_loop=False (other threads run compiled code): no call of a loop changes Dynamo's stance."""
    torch.manual_seed(5)
    tiny = model_zoo.build("tiny", num_layers=1).eval()
    ids = prompt(2, 3, seed=7)
    reference = tiny.generate(ids, 4, decode="eager").tokens
    tiny.__dict__["_decode_step"] = DecodeStep(tiny, inner="eager", guards_once_per_loop=False)
    assert torch.equal(tiny.generate(ids, 4, decode="compiled").tokens, reference)
    assert stances == []


def test_a_loop_evaluates_every_guard_while_another_thread_is_alive(model, stances):
    """Dynamo's stance is process-wide: with another Python thread alive, no step skips guards."""
    import threading

    ids = prompt(3, 5, seed=8)
    reference = model.generate(ids, 3, decode="eager").tokens
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert torch.equal(model.generate(ids, 3, decode="compiled").tokens, reference)
    finally:
        release.set()
        other.join()
    assert stances == []


def test_the_librarys_background_threads_leave_the_skip_on(model, monkeypatch, stances):
    """A compile leaves laplace_passes' kernel-batch builder thread alive for the next one; it builds kernels and
    never calls compiled code, so it does not turn a loop's skip off (NOTE [guards once per loop]). Other
    threads of this test process (the test runner's) are left out of the view the loop takes."""
    import threading
    import types

    from laplace_passes.infra.threads import runs_no_compiled_code

    ids = prompt(2, 4, seed=9)
    reference = model.generate(ids, 4, decode="eager").tokens
    model.generate(ids, 2)  # the step's graphs compiled by Inductor, their kernels built in batches
    ours = [t for t in threading.enumerate() if t.name.startswith("laplace-")]
    assert any(t.name.startswith("laplace-kernel-batches") for t in ours)
    assert all(runs_no_compiled_code(t) for t in ours)
    assert not runs_no_compiled_code(threading.current_thread())
    only_ours = types.SimpleNamespace(current_thread=threading.current_thread,
                                      enumerate=lambda: [threading.current_thread(), *ours])
    monkeypatch.setattr(model_zoo.decode, "threading", only_ours)
    stances.clear()  # only this loop's calls: the generate calls above were other loops
    assert torch.equal(model.generate(ids, 4, decode="compiled").tokens, reference)
    assert stances == [{"skip_guard_eval_unsafe": True}] * 2  # steps 2 and 3; the first evaluated every guard


def test_decode_steps_leave_the_callers_prefill_states_unchanged(model):
    """The buffers a step advances in place are copies: the prefill's own states keep their values."""
    ids = prompt(3, 5, seed=2)
    step = model.decode_step
    with torch.no_grad():
        _, states = model(ids[:, :2], output_final_states=True)
        before = [s.clone() for s in states]
        buffers = step.state_buffer(states)
        for t in range(2, ids.shape[1]):
            step(ids[:, t], buffers)
    for state, original, buffer in zip(states, before, buffers):
        assert torch.equal(state, original)
        assert state.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        assert not torch.equal(buffer, original)  # the steps did advance the buffers


@pytest.fixture(scope="module")
def stepped_code():
    """A fresh step's first call at three sequences: (the prefill's states, the buffers made from them, as they
    were before the call, the buffers after it, and the code Inductor generated for the step)."""
    torch.manual_seed(2)
    tiny = model_zoo.build("tiny").eval()
    step = DecodeStep(tiny)
    with torch.no_grad():
        states = tiny(prompt(3, 4), output_final_states=True)[1]
    buffers = step.state_buffer(states)
    before = [b.clone() for b in buffers]
    _, (code,) = run_and_get_code(step, torch.ones(3, dtype=torch.long), buffers)
    return states, before, buffers, code


def test_the_kernels_write_each_state_buffer_without_a_temporary(stepped_code):
    """NOTE [one buffer per layer]: no state-sized tensor is allocated; the state kernels write the buffers."""
    _, _, buffers, code = stepped_code
    H, K, V = buffers[0].shape[1:]
    allocations = re.findall(r"empty_strided_cpu\(\(([^)]*)\)", code)
    assert allocations, "the generated code's allocations were not found: the check below would pass vacuously"
    state_sized = [a for a in allocations if a.replace(" ", "").endswith((f"{H},{K},{V}", f"{H},{V},{K}"))]
    assert state_sized == [], f"state-sized temporaries: {state_sized}"
    # Each buffer is both read and written by one kernel call (in place), not filled by a copy of another.
    calls = re.findall(r"cpp_fused_\w+\(([^)]*)\)", code)
    for name in state_buffer_arguments(code, buffers):
        assert any(call.split(", ").count(name) == 2 for call in calls), name


def test_state_buffers_hold_the_states_with_k_innermost_and_one_loop_walks_each(stepped_code):
    """NOTE [state buffers keep K innermost]: the buffers equal the states, each in memory of its own with K
    innermost, and the kernel that advances a buffer walks it in one loop (read once, written once)."""
    states, before, buffers, code = stepped_code
    for state, copied, buffer in zip(states, before, buffers, strict=True):
        assert torch.equal(copied, state) and buffer.dtype == torch.float32
        assert buffer.transpose(-1, -2).is_contiguous(), buffer.stride()
        assert buffer.untyped_storage().data_ptr() != state.untyped_storage().data_ptr()
    K, V = buffers[0].shape[-2:]
    for name in state_buffer_arguments(code, buffers):
        (kernel,) = {k for k, args in re.findall(r"(cpp_fused_\w+)\(([^)]*)\)", code) if name in args.split(", ")}
        source = code.split(f"{kernel} = async_compile")[1].split("async_compile")[0]
        # Each outermost loop (over x0, the (sequence, head) pairs) that indexes a state as [.. + K*V * x0].
        walks = [loop for loop in source.split("for(int64_t x0=")[1:] if f"{K * V}L*x0" in loop]
        assert len(walks) == 1, f"{kernel} walks a state buffer in {len(walks)} loops"


def state_buffer_arguments(code: str, buffers) -> list[str]:
    """The generated code's names of the step's state buffers (its [s, H, K, V] inputs), one per buffer."""
    H, K, V = buffers[0].shape[1:]
    names = re.findall(r"assert_size_stride\((arg\d+_1), \(s\d+, %d, %d, %d\)" % (H, K, V), code)
    assert len(names) == len(buffers), names
    return names


def test_no_recompile_per_step_or_per_batch_size():
    torch.manual_seed(1)
    step = DecodeStep(model_zoo.build("tiny", num_layers=1).eval(), inner="eager")
    counts = []
    for batch in (2, 3, 5, 1, 4, 1, LARGE_BATCH, 200, LARGE_BATCH - 1, 2):
        buffers = [torch.zeros(batch, 2, 16, 32)]
        for _ in range(3):
            step(torch.ones(batch, dtype=torch.long), buffers)
        counts.append(step.graphs_compiled())
    # One graph per batch class (NOTE [batch classes]): 2 to LARGE_BATCH - 1, a single sequence, LARGE_BATCH and
    # more; none per step.
    assert counts == [1, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    small, single, large = (g for g in step.report.sites)
    assert isinstance(small.shape["B"], str) and single.shape["B"] == 1 and isinstance(large.shape["B"], str)


def test_each_batch_class_is_compiled_as_for_its_own_batch():
    """NOTE [batch classes]: each class's graph is handed to the inner compiler as for a batch of its own (the
    batch Inductor splits its kernels over threads by), whatever batch came first, with the eager tokens."""
    torch.manual_seed(2)
    tiny = model_zoo.build("tiny", num_layers=1).eval()
    compiled_for = []
    step = DecodeStep(tiny, inner=lambda gm, inputs: compiled_for.append(_batch_compiled_for(inputs)) or gm.forward)
    for batch in (2, 100, 3, 70):
        ids = prompt(batch, 3, seed=batch)
        with torch.no_grad():
            _, states = tiny(ids[:, :2], output_final_states=True)
        got = step.logits_and_greedy(ids[:, 2], step.state_buffer(states))[1]
        assert torch.equal(got, tiny(ids, output_final_states=True)[0][:, -1].argmax(-1))
    assert compiled_for == [SMALL_BATCH_HINT, LARGE_BATCH_HINT]


def _batch_compiled_for(inputs) -> int:
    """The batch Inductor would take a graph to run at: its symbolic batch's hint override, else its hint."""
    tokens = next(x for x in inputs if isinstance(x, torch.Tensor) and x.dim() == 1 and x.dtype == torch.long)
    node = tokens.shape[0].node
    return node.shape_env.var_to_hint_override.get(node.expr, node.hint)


def test_a_tokens_tensor_keeps_no_batch_mark_and_a_column_of_one_sequence_decodes():
    """The step marks its own views of the tokens and buffers (marks add up on a tensor, and Dynamo picks one of
    them), and a [1, T] batch's column (stride T) runs a loop without a recompile under skipped guards."""
    torch.manual_seed(3)
    tiny = model_zoo.build("tiny", num_layers=1).eval()
    step = DecodeStep(tiny, inner="eager")
    ids = prompt(3, 3, seed=3)
    buffers = step.state_buffer(tiny(ids[:, :2], output_final_states=True)[1])
    tokens = ids[:, 2].clone()
    step(tokens, buffers)
    assert not hasattr(tokens, "_dynamo_dynamic_range") and not hasattr(buffers[0], "_dynamo_dynamic_range")
    one = prompt(1, 4, seed=4)
    decode_loop = step.loop(step.state_buffer(tiny(one[:, :2], output_final_states=True)[1]))
    _, greedy = decode_loop(one[:, 2])  # a column: stride 4
    decode_loop(greedy)  # stride 1, under skipped guards, where a recompile raises


def test_decode_steps_of_two_models_are_each_compiled():
    """Each step has its own code object: Dynamo's compiles per code object (8) are not shared."""
    with torch._dynamo.config.patch(recompile_limit=1):
        for seed in range(2):
            torch.manual_seed(seed)
            step = DecodeStep(model_zoo.build("tiny", num_layers=1, hidden_size=32).eval(), inner="eager")
            step(torch.ones(2, dtype=torch.long), [torch.zeros(2, 2, 8, 16)])
            assert step.graphs_compiled() == 1


def test_auto_decode_of_a_bf16_model_is_eager():
    torch.manual_seed(0)
    model = model_zoo.build("tiny", num_layers=1, dtype=torch.bfloat16).eval()
    model.generate(prompt(2, 3), 2)
    assert "_decode_step" not in model.__dict__  # never made: the eager loop ran


def test_compiled_decode_needs_a_decode_step():
    class NoStep(torch.nn.Module):
        def forward(self, ids, initial_states=None, output_final_states=False):
            raise AssertionError("not reached: the decode mode is checked first")

    with pytest.raises(ValueError, match="needs a model with a decode_step"):
        generate(NoStep(), prompt(1, 2), 1, decode="compiled")


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="decode must be one of"):
        model.generate(prompt(1, 2), 1, decode="fast")
    step, tokens = model.decode_step, torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"one \[B, H, K, V\] state buffer per layer with the same B, got tokens "
                                         r"\(2,\) and states \[\(2, 2, 16, 32\), \(3, 2, 16, 32\)\]"):
        step(tokens, [torch.zeros(2, 2, 16, 32), torch.zeros(3, 2, 16, 32)])
    with pytest.raises(ValueError, match=r"a list of per-layer .* got a tensor of shape \(2, 2, 2, 16, 32\)"):
        step(tokens, torch.zeros(2, 2, 2, 16, 32))  # one stacked tensor is not the buffers
    with pytest.raises(ValueError, match="same B"):
        step(tokens, [])
    with pytest.raises(ValueError, match="must be float32"):
        step(tokens, [torch.zeros(2, 2, 16, 32, dtype=torch.float64)] * 2)
    shared = torch.zeros(2, 2, 16, 32)
    with pytest.raises(ValueError, match=r"states\[0\] and states\[1\] are the same memory"):
        step(tokens, [shared, shared])
