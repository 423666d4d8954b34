"""Recurrent generation: chunked prefill + token decode equals one full forward; the state does not grow."""

import pytest
import torch

import laplace_passes
import model_zoo
from model_zoo.generate import generate
import model_zoo.prefill
from model_zoo.prefill import CompiledPrefill


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return model_zoo.build("tiny").eval()


def test_chunked_prefill_then_decode_equals_full_forward(model):
    prompt = torch.randint(1, 128, (3, 150), generator=torch.Generator().manual_seed(0))
    prefill = laplace_passes.compile(model, target="cpu")  # chunked GLA, 3 chunks of 64
    out = model.generate(prompt, 12, prefill=prefill, return_logits=True)
    assert out.tokens.shape == (3, 162)
    assert torch.equal(out.tokens[:, :150], prompt)
    with torch.no_grad():
        full = model(out.tokens)
    # logits for new token i were computed at position 149 + i
    torch.testing.assert_close(out.logits, full[:, 149:161], rtol=1e-4, atol=1e-4)
    assert torch.equal(out.tokens[:, 150:], out.logits.argmax(-1))
    assert prefill.laplace_report.sites[0].status == "retiled"


def test_state_bytes_do_not_grow_with_context(model):
    sizes = {}
    for context in (4, 300):
        prompt = torch.ones(2, context, dtype=torch.long)
        sizes[context] = model.generate(prompt, 1).state_bytes_per_sequence
    assert sizes[4] == sizes[300] == model.recurrent_state_bytes_per_sequence()
    assert model.kv_cache_bytes_softmax(300) > model.kv_cache_bytes_softmax(4)


def test_sampling_is_reproducible_with_a_generator(model):
    prompt = torch.ones(4, 5, dtype=torch.long)
    runs = [model.generate(prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(7)).tokens
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_compiled_decode_gives_eager_decodes_tokens_greedy_and_sampled(model):
    """Greedy tokens come from the step's in-graph argmax, sampled ones from its logits: both as eager decode's,
    and two calls in a row (each one decode loop) agree."""
    prompt = torch.randint(1, 128, (5, 7), generator=torch.Generator().manual_seed(8))
    for temperature in (0.0, 0.7):
        runs = {decode: [model.generate(prompt, 9, temperature=temperature, decode=decode,
                                        generator=torch.Generator().manual_seed(9)).tokens for _ in range(2)]
                for decode in ("compiled", "eager")}
        assert torch.equal(runs["compiled"][0], runs["eager"][0]), temperature
        assert torch.equal(runs["compiled"][1], runs["compiled"][0]), temperature


def test_bucketed_prefill_at_a_bucket_equals_eager_and_refuses_a_padded_prompt(model):
    """A prefill behind seq_buckets is exact only where nothing is padded: its final states would hold the padding."""
    prefill = laplace_passes.compile(model, target="cpu", seq_buckets=[16, 32])
    prompt = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    out = model.generate(prompt, 5, prefill=prefill, return_logits=True, decode="eager")
    expected = model.generate(prompt, 5, return_logits=True, decode="eager", prefill="eager")
    assert torch.equal(out.tokens, expected.tokens)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"seq_buckets: output_final_states=True would return recurrent states that "
                                         r"include 6 padding positions \(length 10, bucket 16\); prefill with the "
                                         r"model compiled without seq_buckets"):
        model.generate(prompt[:, :10], 5, prefill=prefill)


def test_default_prefill_is_compiled_once_per_bucket_and_gives_the_eager_tokens(model):
    """Static 256-token segments, then the rest padded to its bucket (128 or 256): eager's tokens, no recompile
    for a second length in a bucket."""
    generator = torch.Generator().manual_seed(2)
    prefill = model.compiled_prefill
    graphs = []
    # Rests: 128 (bucket 128), 188 and 232 (bucket 256, the segment's graph), none, 20 (the model's forward).
    for length in (640, 700, 1000, 1024, 1300):
        prompt = torch.randint(1, 128, (2, length), generator=generator)
        default = model.generate(prompt, 6, return_logits=True, decode="eager")
        reference = model.generate(prompt, 6, return_logits=True, decode="eager", prefill="eager")
        assert torch.equal(default.tokens, reference.tokens), length
        torch.testing.assert_close(default.logits, reference.logits)
        with torch.no_grad():  # every position's logits, and the states decode continues from
            logits, states = prefill(prompt)
            expected_logits, expected_states = model(prompt, output_final_states=True)
        torch.testing.assert_close(logits, expected_logits)
        torch.testing.assert_close(states, expected_states)
        graphs.append(prefill.graphs_compiled())
    assert graphs == [2, 2, 2, 2, 2], prefill.report.graphs  # the 256 bucket's graph and the 128's; then none
    assert sorted(prefill._bucket_graphs) == [128, 256]
    forms = {site.form for site in prefill.report.sites}
    assert forms == {"chunked: T = 256 > 64", "chunked: T = 128 > 64"}, forms


@pytest.mark.parametrize("name", ["tiny", "plain-tiny"])
def test_masked_tokens_leave_the_states_as_they_were(name):
    """Padding at the end under token_mask: the unpadded prompt's states and logits (the eager forward, no compile;
    plain-tiny's recurrence is its own scan)."""
    torch.manual_seed(0)
    model = model_zoo.build(name).eval()
    prompt = torch.randint(1, 128, (2, 37), generator=torch.Generator().manual_seed(6))
    padded = torch.cat([prompt, torch.randint(0, 128, (2, 27), generator=torch.Generator().manual_seed(7))], dim=1)
    token_mask = torch.arange(64) < 37
    with torch.no_grad():
        logits, states = model(padded, output_final_states=True, token_mask=token_mask.expand(2, 64))
        expected_logits, expected_states = model(prompt, output_final_states=True)
        _, unmasked_states = model(padded, output_final_states=True)
    torch.testing.assert_close(logits[:, :37], expected_logits)
    torch.testing.assert_close(states, expected_states)
    assert not torch.allclose(unmasked_states[0], expected_states[0])  # the padding would change them unmasked


def test_a_token_mask_of_the_wrong_shape_says_what_it_must_be(model):
    with pytest.raises(ValueError, match=r"^token_mask must be a bool tensor of input_ids' shape \[2, 5\] \(True "
                                         r"for a real token\), got dtype torch.bool, shape \[5\]: pass "
                                         r"input_ids != pad_id$"):
        model(torch.ones(2, 5, dtype=torch.long), token_mask=torch.ones(5, dtype=torch.bool))


def test_batch_sizes_past_the_bound_run_the_dynamic_graph_whole(model, monkeypatch):
    """Each batch size costs the static segment graph a compile: past the bound, the rest's graph takes the prompt."""
    monkeypatch.setattr(model_zoo.prefill, "SEGMENT_BATCH_SIZES", 1)
    prefill = CompiledPrefill(model)
    generator = torch.Generator().manual_seed(5)
    graphs = []
    for batch, length in ((2, 300), (3, 300), (4, 400)):  # a segment + 44 tokens eagerly; then whole: 300, 400
        prompt = torch.randint(1, 128, (batch, length), generator=generator)
        logits, states = prefill(prompt)
        with torch.no_grad():
            expected_logits, expected_states = model(prompt, output_final_states=True)
        torch.testing.assert_close(logits, expected_logits)
        torch.testing.assert_close(states, expected_states)
        graphs.append(prefill.graphs_compiled())
    assert graphs == [1, 2, 2] and prefill.segment_batch_sizes == {2}


@pytest.mark.parametrize("bad", [0, 100, 64.0, True])
def test_segment_tokens_must_be_a_multiple_of_the_chunk_size(model, bad):
    with pytest.raises(ValueError, match=rf"segment_tokens must be a positive multiple of the chunk size 64, "
                                         rf"got {bad!r}"):
        CompiledPrefill(model, segment_tokens=bad)


def test_a_prompt_of_one_chunk_runs_the_models_forward(model):
    """At most one chunk: the token recurrence costs what one chunk does; no compile for it."""
    prefill = CompiledPrefill(model)
    prompt = torch.randint(1, 128, (2, prefill.chunk_size), generator=torch.Generator().manual_seed(3))
    out = model.generate(prompt, 3, prefill=prefill, return_logits=True, decode="eager")
    expected = model.generate(prompt, 3, prefill="eager", return_logits=True, decode="eager")
    assert torch.equal(out.tokens, expected.tokens) and torch.equal(out.logits, expected.logits)
    assert prefill.graphs_compiled() == 0


def test_a_prefill_that_fails_to_compile_runs_the_forward_and_says_why(model):
    """A compile failure falls back to the model's forward with a warning; the caller's own errors propagate."""
    def failing_backend(gm, example_inputs):
        raise RuntimeError("no kernels here")

    prefill = CompiledPrefill(model, inner=failing_backend)
    with pytest.raises(IndexError, match="index out of range"):  # the caller's error, not the compile's
        prefill(torch.full((2, 70), 500))
    assert prefill.declined is None
    prompt = torch.randint(1, 128, (2, 70), generator=torch.Generator().manual_seed(4))
    with pytest.warns(UserWarning, match=r"^the compiled prefill failed \(.*no kernels here.*\); prefill runs the "
                                         r"model's own forward from now on: pass prefill='eager' to skip the compile"):
        logits, states = prefill(prompt)
    expected_logits, expected_states = model(prompt, output_final_states=True)
    assert torch.equal(logits, expected_logits) and all(map(torch.equal, states, expected_states))
    assert prefill.report.notes == [prefill.declined]


def test_prefill_compiled_needs_a_model_that_has_one():
    class NoPrefill(torch.nn.Module):
        def forward(self, input_ids, *, initial_states=None, output_final_states=False):
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match=r"prefill='compiled' needs a model with a compiled_prefill "
                                         r"\(model_zoo.GLALM\); NoPrefill has none: use prefill='eager'"):
        generate(NoPrefill(), torch.ones(1, 3, dtype=torch.long), 1, prefill="compiled", decode="eager")


BAD_ARGUMENTS = [
    ({"max_new_tokens": 0}, "max_new_tokens must be a positive int"),
    ({"max_new_tokens": -3}, "max_new_tokens must be a positive int"),
    ({"max_new_tokens": 2.0}, "max_new_tokens must be a positive int"),
    ({"max_new_tokens": True}, "max_new_tokens must be a positive int"),
    *[({"max_new_tokens": 2, "temperature": bad}, r"temperature must be a finite number >= 0 \(0: greedy\), got")
      for bad in (-1.0, float("nan"), float("inf"), "1.0", True, None)],
    ({"max_new_tokens": 2, "generator": 7}, "generator must be a torch.Generator or None"),
    ({"max_new_tokens": 2, "return_logits": "yes"}, "return_logits must be a bool"),
    ({"max_new_tokens": 2, "prefill": "chunked"}, r"prefill must be one of \('auto', 'compiled', 'eager'\) or a "
                                                   r"callable with the model's signature, got 'chunked'"),
    ({"max_new_tokens": 2, "decode": "fast"}, "decode must be one of"),
]


@pytest.mark.parametrize("kwargs,message", BAD_ARGUMENTS)
def test_bad_arguments(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(torch.ones(1, 3, dtype=torch.long), **kwargs)


@pytest.mark.parametrize("input_ids,message", [
    (torch.ones(3, dtype=torch.long), r"input_ids must be a \[B, T\] tensor with B >= 1 and T >= 1, got \(3,\)"),
    (torch.ones(1, 0, dtype=torch.long), r"B >= 1 and T >= 1, got \(1, 0\)"),
    (torch.ones(0, 3, dtype=torch.long), r"B >= 1 and T >= 1, got \(0, 3\)"),
    ([[1, 2, 3]], r"input_ids must be a \[B, T\] tensor .*got list"),
    (torch.ones(1, 3), "input_ids must hold integer token ids, got dtype torch.float32"),
])
def test_bad_input_ids(model, input_ids, message):
    with pytest.raises(ValueError, match=message):
        model.generate(input_ids, 2)
