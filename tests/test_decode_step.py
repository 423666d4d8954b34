"""The compiled decode step: same tokens and logits as the eager reference, the state of the token
recurrence after N steps, updated in place, and no recompile per step or per batch size."""

import pytest
import torch

import model_zoo
from model_zoo.decode import DecodeStep
from model_zoo.generate import generate

TIGHT = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return model_zoo.build("tiny").eval()


def prompt(batch, length, seed=0):
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_default_generate_is_compiled_and_equals_the_eager_reference(model):
    ids = prompt(3, 5)
    compiled = model.generate(ids, 8, return_logits=True)  # decode="auto": compiled on the CPU
    assert model.decode_step.graphs_compiled() == 1
    (site, *_) = model.decode_step.report.sites
    assert site.status == "retiled" and site.form.startswith("recurrent: T = 1")
    eager = model.generate(ids, 8, return_logits=True, decode="eager")
    assert torch.equal(compiled.tokens, eager.tokens)
    torch.testing.assert_close(compiled.logits, eager.logits, **TIGHT)


def test_state_after_n_steps_is_the_token_recurrence_updated_in_place(model):
    ids = prompt(4, 6, seed=1)
    step = model.decode_step
    with torch.no_grad():
        logits, states = model(ids[:, :2], output_final_states=True)
        buffer = step.state_buffer(states)
        storage = buffer.data_ptr()
        for t in range(2, ids.shape[1]):
            step_logits = step(ids[:, t], buffer)
        assert step.graphs_compiled() == 1  # the graph the test above compiled, for B = 3
        # The reference: the whole sequence through the model eagerly, one `laplace::gla` per layer.
        full_logits, full_states = model(ids, output_final_states=True)
    assert buffer.data_ptr() == storage
    torch.testing.assert_close(buffer, torch.stack(full_states), **TIGHT)
    torch.testing.assert_close(step_logits, full_logits[:, -1], **TIGHT)


def test_no_recompile_per_step_or_per_batch_size():
    torch.manual_seed(1)
    step = DecodeStep(model_zoo.build("tiny", num_layers=1).eval(), inner="eager")
    counts = []
    for batch in (2, 3, 5, 1, 4, 1):
        buffer = torch.zeros(1, batch, 2, 16, 32)
        for _ in range(3):
            step(torch.ones(batch, dtype=torch.long), buffer)
        counts.append(step.graphs_compiled())
    # One graph for every batch of two or more, one for a single sequence; none per step.
    assert counts == [1, 1, 1, 2, 2, 2]
    dynamic, single = (g for g in step.report.sites)
    assert isinstance(dynamic.shape["B"], str) and single.shape["B"] == 1


def test_decode_steps_of_two_models_are_each_compiled():
    """Each step has its own code object: Dynamo's compiles per code object (8) are not shared."""
    with torch._dynamo.config.patch(recompile_limit=1):
        for seed in range(2):
            torch.manual_seed(seed)
            step = DecodeStep(model_zoo.build("tiny", num_layers=1, hidden_size=32).eval(), inner="eager")
            step(torch.ones(2, dtype=torch.long), torch.zeros(1, 2, 2, 8, 16))
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
    with pytest.raises(ValueError, match="same B"):
        model.decode_step(torch.ones(2, dtype=torch.long), torch.zeros(2, 3, 2, 16, 32))
