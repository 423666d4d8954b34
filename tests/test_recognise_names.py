"""A loop declined because a source is written in place while it is read names that source as the user wrote it.

Dynamo names a module's buffer l_self_buffers_decay_, a module-level global G['DECAY'] and a global of
another module, read by a function there, G['__import_tests_dot_recognise_cases'].GATES_KEPT_HERE; the
reason says self.decay, DECAY and tests.recognise_cases.GATES_KEPT_HERE
(`laplace_passes.infra.fx_helpers.input_source`). The numbers are eager's:
the loop runs as written.
"""

import torch

import laplace_passes
from tests import recognise_cases as cases

DECAY = cases.inputs("bthk", "key")[3].clone()  # gates a script keeps in a module-level global


def compiled(fn):
    torch._dynamo.reset()
    return laplace_passes.compile(fn, target="cpu", chunk_size=8)


def decay_halved_after_the_loop(q, k, v, decay):
    """Per-key gates [B, T, H, K], step t reading its own, halved in place after the loop (before its outputs
    are stacked)."""
    S, outs = q.new_zeros(cases.B, cases.H, cases.K, cases.V), []
    for t in range(cases.T):
        S = S * decay[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    decay.mul_(0.5)
    return torch.stack(outs, 1), S


class DecayInABuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("decay", DECAY.clone())

    def forward(self, q, k, v):
        return decay_halved_after_the_loop(q, k, v, self.decay)


def decay_in_a_global(q, k, v):
    return decay_halved_after_the_loop(q, k, v, DECAY)


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


def test_a_global_written_while_the_loop_reads_it_is_declined_by_its_name():
    q, k, v, _ = cases.inputs("bthk", "key")
    start = DECAY.clone()
    with torch.no_grad():
        expected = decay_in_a_global(q, k, v)
        DECAY.copy_(start)
        model = compiled(decay_in_a_global)
        found = model(q, k, v)
    torch.testing.assert_close(DECAY, start * 0.5, rtol=0, atol=0)
    assert_declined_with_eager_numbers(model, found, expected, "DECAY")


def test_a_global_of_another_module_is_named_by_its_module():
    q, k, v, _ = cases.inputs("bthk", "key")
    start = cases.GATES_KEPT_HERE.clone()
    with torch.no_grad():
        expected = cases.gates_kept_here_halved_after_the_loop(q, k, v)
        cases.GATES_KEPT_HERE.copy_(start)
        model = compiled(lambda q, k, v: cases.gates_kept_here_halved_after_the_loop(q, k, v))
        found = model(q, k, v)
    torch.testing.assert_close(cases.GATES_KEPT_HERE, start * 0.5, rtol=0, atol=0)
    assert_declined_with_eager_numbers(model, found, expected, "tests.recognise_cases.GATES_KEPT_HERE")
