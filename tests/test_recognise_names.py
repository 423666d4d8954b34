"""A loop declined because a source is written in place while it is read names that source as the user wrote it.

Dynamo names a module's buffer l_self_buffers_decay_, a module-level global G['DECAY'] and a global of
another module, read by a function there, G['__import_tests_dot_recognise_cases'].GATES_KEPT_HERE; the
reason says self.decay, DECAY and tests.recognise_cases.GATES_KEPT_HERE
(`laplace_passes.infra.fx_helpers.input_source`). The numbers are eager's:
the loop runs as written.
"""

import pytest
import torch

import laplace_passes
from tests import recognise_cases as cases

DECAY = cases.inputs("bthk", "key")[3].clone()  # gates a script keeps in a module-level global


def compiled(fn):
    torch._dynamo.reset()
    return laplace_passes.compile(fn, target="cpu", chunk_size=8)


class DecayInABuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("decay", DECAY.clone())

    def forward(self, q, k, v):
        return cases.decay_halved_after_the_loop(q, k, v, self.decay)


def decay_in_a_global(q, k, v):
    return cases.decay_halved_after_the_loop(q, k, v, DECAY)


def assert_declined_with_eager_numbers(model, found, expected, name):
    for f, e in zip(found, expected):
        torch.testing.assert_close(f, e, rtol=0, atol=0)
    (row,) = model.laplace_report.recurrences
    assert row.status == "declined" and f"mul_ writes in place to {name} while it is read" in row.reason, row


def test_a_buffer_written_while_the_loop_reads_it_is_declined_by_the_name_the_user_gave_it():
    q, k, v, _ = cases.inputs("bthk", "key")
    eager, written = DecayInABuffer(), DecayInABuffer()
    with torch.no_grad():
        expected = eager(q, k, v)
        model = compiled(written)
        found = model(q, k, v)
    torch.testing.assert_close(written.decay, eager.decay, rtol=0, atol=0)
    assert_declined_with_eager_numbers(model, found, expected, "self.decay")


@pytest.mark.parametrize("function, gates, name", [
    (decay_in_a_global, DECAY, "DECAY"),  # this module's global, read by the function compiled
    # another module's global, read by a function there that the compiled one calls
    (lambda q, k, v: cases.gates_kept_here_halved_after_the_loop(q, k, v), cases.GATES_KEPT_HERE,
     "tests.recognise_cases.GATES_KEPT_HERE"),
], ids=["this-module", "another-module"])
def test_a_global_written_while_the_loop_reads_it_is_declined_by_its_name(function, gates, name):
    q, k, v, _ = cases.inputs("bthk", "key")
    start = gates.clone()
    with torch.no_grad():
        expected = function(q, k, v)
        gates.copy_(start)
        model = compiled(function)
        found = model(q, k, v)
    torch.testing.assert_close(gates, start * 0.5, rtol=0, atol=0)
    assert_declined_with_eager_numbers(model, found, expected, name)
