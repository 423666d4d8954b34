"""Recurrent generation: chunked prefill + token decode equals one full forward; the state does not grow."""

import pytest
import torch

import laplace_passes
import model_zoo


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


@pytest.mark.parametrize(
    "kwargs,message",
    [({"max_new_tokens": 0}, "max_new_tokens must be a positive int"),
     ({"max_new_tokens": 2, "temperature": -1.0}, "temperature must be >= 0")],
)
def test_bad_arguments(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(torch.ones(1, 3, dtype=torch.long), **kwargs)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        model.generate(torch.ones(3, dtype=torch.long), 1)
