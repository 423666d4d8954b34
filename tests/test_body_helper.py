"""Chunk-loop bodies compiled in a helper process (laplace_passes.unroll.body_helper).

NOTE [bodies compiled in a helper process]: a body the helper compiled and
this process loaded must be the body this process compiles, bit for bit;
the backward's arguments predicted from the forward's must be the ones the
op's autograd passes; whatever goes wrong in the helper (an error in its
compile, its exit) leaves the body to this process, with the reason logged.
"""

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
import types
from concurrent.futures import Future

import pytest
import torch

from laplace_passes.infra import process_cpu
from laplace_passes.ops.chunked import CHUNK_LOOP_OPS, chunked_gla_op
from laplace_passes.unroll import body_helper, compiled_bodies
from laplace_passes.unroll.body_helper import HELPER, BodyHelper
from laplace_passes.unroll.compiled_bodies import CompiledBodies, backward_arguments, signature, signature_arguments
from tests import processes
from tests._dist import run_ranks
from tests.gla_cases import make_inputs
from tests.test_logs import Records

B, T, H, K, V = 1, 100, 2, 8, 6  # two chunks of 64 on the cpu target, the second padded

switched_off = pytest.mark.skipif(os.environ.get(body_helper.SWITCH) == "0",
                                  reason="the helper process is switched off (LAPLACE_PASSES_BODY_HELPER=0)")


@pytest.fixture
def helper_on(monkeypatch):
    """The helper on whatever the cores: on one it is off by default, and these tests are about it."""
    monkeypatch.setenv(body_helper.SWITCH, "1")


def forward_arguments(save_residuals=True):
    q, k, v, gk, h0 = make_inputs(B, T, H, K, V, gate_divisor=0.5, seed=21)
    return (q, k, v, gk, h0, K ** -0.5, 64, 8, save_residuals)


def real_backward_arguments(forward_args):
    """The backward op's arguments as autograd passes them: the saved inputs and residuals, and the tangents."""
    outputs = chunked_gla_op(*forward_args)
    grad_o, grad_final_state = torch.randn_like(outputs[0]), torch.randn_like(outputs[1])
    residuals = outputs[2:] if forward_args[8] else (None, None)
    return (*forward_args[:5], grad_o, grad_final_state, *residuals, *forward_args[5:8])


@pytest.mark.parametrize("save_residuals", [True, False])
def test_the_predicted_backward_arguments_have_the_layouts_autograd_passes(save_residuals):
    """The prediction is checked by signature: shapes, strides, dtypes, devices and settings."""
    forward_args = forward_arguments(save_residuals)
    predicted = backward_arguments(forward_args)
    assert signature(CHUNK_LOOP_OPS[1], predicted) == signature(CHUNK_LOOP_OPS[1], real_backward_arguments(forward_args))


def test_the_helper_rebuilds_arguments_of_the_same_signature_from_their_layouts():
    """What the helper is sent is the signature's layouts; the fakes it compiles from have that signature."""
    args = real_backward_arguments(forward_arguments())
    args = (args[0].transpose(1, 2).contiguous().transpose(1, 2),) + args[1:]  # a strided one too
    key = signature(CHUNK_LOOP_OPS[1], args)
    assert signature(CHUNK_LOOP_OPS[1], signature_arguments(key[1:])) == key


@switched_off
def test_a_body_compiled_in_the_helper_is_the_body_compiled_here_bit_for_bit(helper_on):
    args = real_backward_arguments(forward_arguments())
    helped = CompiledBodies(helper=HELPER)
    assert helped.compile_elsewhere(CHUNK_LOOP_OPS[1], args)
    assert not helped.compile_elsewhere(CHUNK_LOOP_OPS[1], args)  # already on its way
    got = helped.run(CHUNK_LOOP_OPS[1], args)
    assert helped.signatures() == helped.from_helper and not helped.graphs  # loaded, not compiled here
    expected = CompiledBodies().run(CHUNK_LOOP_OPS[1], args)
    for g, e in zip(got, expected, strict=True):
        assert g.stride() == e.stride() and torch.equal(g, e)
    for g, e in zip(got, torch.ops.laplace.chunked_gla_backward(*args)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


class FailingHelper:
    def submit(self, op, layouts):
        future = Future()
        future.set_exception(RuntimeError("the helper process exited"))
        return future


def test_a_body_the_helper_could_not_compile_is_compiled_here_with_the_reason_logged():
    args = forward_arguments()
    bodies = CompiledBodies(compile_body=lambda gm, fakes: (lambda tensors: gm(*tensors)), helper=FailingHelper())
    assert bodies.compile_elsewhere(CHUNK_LOOP_OPS[0], args)
    with Records("laplace.passes") as records:
        got = bodies.run(CHUNK_LOOP_OPS[0], args)
    logged = "\n".join(r.getMessage() for r in records)
    assert "not compiled in the helper process (RuntimeError: the helper process exited); compiled here" in logged
    assert not bodies.from_helper and len(bodies.graphs) == 1
    for g, e in zip(got, chunked_gla_op(*args)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


class PendingHelper:
    def __init__(self):
        self.futures = []

    def submit(self, op, layouts):
        self.futures.append(Future())
        return self.futures[-1]


def test_a_body_pending_in_the_helper_is_left_to_the_first_call_unless_its_request_failed():
    """compile_ahead skips a body the helper is compiling (loaded at the graph's first call, after its codegen),
    but not one whose request already failed: that one is compiled with its graph, as without the helper."""
    args, helper = forward_arguments(), PendingHelper()
    bodies = CompiledBodies(compile_body=lambda gm, fakes: (lambda tensors: gm(*tensors)), helper=helper)
    assert bodies.compile_elsewhere(CHUNK_LOOP_OPS[0], args) and bodies.in_helper(CHUNK_LOOP_OPS[0], args)
    helper.futures[0].set_exception(RuntimeError("the helper process exited"))
    assert not bodies.in_helper(CHUNK_LOOP_OPS[0], args)


def test_a_forked_child_compiles_here_what_its_parent_sent_to_the_helper():
    """The helper answers the parent: a child forked with a request pending would wait on it forever."""
    args, helper = forward_arguments(), PendingHelper()
    bodies = CompiledBodies(compile_body=lambda gm, fakes: (lambda tensors: gm(*tensors)), helper=helper)
    assert bodies.compile_elsewhere(CHUNK_LOOP_OPS[0], args)
    bodies.forget_helper_requests()  # what os.register_at_fork runs in the child for compiled_bodies.BODIES
    assert not bodies.in_helper(CHUNK_LOOP_OPS[0], args)
    for g, e in zip(bodies.run(CHUNK_LOOP_OPS[0], args), chunked_gla_op(*args)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    assert len(bodies.graphs) == 1 and not bodies.from_helper


def test_the_process_s_bodies_forget_helper_requests_in_a_forked_child():
    if not hasattr(os, "fork"):
        pytest.skip("no os.fork here")
    args = forward_arguments()
    key = signature(CHUNK_LOOP_OPS[0], args)
    compiled_bodies.BODIES._elsewhere[key] = Future()
    try:
        child = os.fork()
        if child == 0:  # the child: exit status 0 when the request was dropped
            os._exit(0 if not compiled_bodies.BODIES.in_helper(CHUNK_LOOP_OPS[0], args) else 1)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert compiled_bodies.BODIES.in_helper(CHUNK_LOOP_OPS[0], args)  # the parent keeps its own
    finally:
        compiled_bodies.BODIES._elsewhere.pop(key, None)


class NoSuchOp:
    @staticmethod
    def name():
        return "laplace::no_such_op"


@switched_off
def test_the_helper_answers_an_error_and_a_new_helper_starts_after_one_exits(helper_on):
    helper = BodyHelper()
    try:
        failed = helper.submit(NoSuchOp, signature(CHUNK_LOOP_OPS[0], (torch.zeros(2), 0.5))[1:])
        with pytest.raises(RuntimeError, match="AttributeError.*no_such_op"):
            failed.result(timeout=120)
        first = helper._connection.process
        first.kill()
        first.wait()
        lost = helper.submit(NoSuchOp, ())  # a new helper: the old one exited
        assert helper._connection.process is not first
        with pytest.raises(RuntimeError, match="AttributeError"):
            lost.result(timeout=120)
        pending = helper.submit(NoSuchOp, ())
        helper._connection.process.kill()  # before it answers: the request fails, nothing hangs
        with pytest.raises((RuntimeError, OSError)):
            pending.result(timeout=120)
    finally:
        helper.stop()


@switched_off
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the helper's CPU time is read from /proc")
def test_a_stuck_helper_is_stopped_its_requests_fail_and_a_new_one_starts(helper_on, monkeypatch):
    """NOTE [a stuck helper]: a helper stopped by SIGSTOP takes no CPU time; the waits give up on it."""
    monkeypatch.setattr(body_helper, "STALL_S", 1.5)
    monkeypatch.setattr(body_helper, "POLL_S", 0.1)
    helper, stuck = BodyHelper(), None
    try:
        with pytest.raises(RuntimeError, match="AttributeError"):
            helper.submit(NoSuchOp, ()).result(timeout=120)  # up, idle, answering
        stuck = helper._connection.process
        # The processes it starts (g++) inherit no end of the request pipe, which would keep a write to it
        # blocked after it is killed.
        assert os.readlink(f"/proc/{stuck.pid}/fd/0") == os.devnull
        os.kill(stuck.pid, signal.SIGSTOP)
        # A graph bigger than the pipe's buffer, to a helper that reads no more: sent by the writer thread.
        codegen, pending = outcome_within(5, lambda: (helper.submit_codegen(b"x" * 1_000_000),
                                                      helper.submit(NoSuchOp, ())))
        with Records("laplace.passes") as records:
            codegen_error = outcome_within(30, codegen.result)
        assert isinstance(codegen_error, RuntimeError)
        assert re.fullmatch(r"the helper process was stuck \(no CPU time for \d+ s\)", str(codegen_error))
        assert "stuck" in str(outcome_within(5, pending.result))
        assert stuck.wait(timeout=10) == -signal.SIGKILL
        writer = f"laplace-body-helper-requests-{stuck.pid}"  # its blocked write failed: the thread ended
        outcome_within(5, lambda: [t.join() for t in threading.enumerate() if t.name == writer])
        assert any(f"the helper process (pid {stuck.pid}) took no CPU time" in r.getMessage() for r in records)
        with pytest.raises(RuntimeError, match="AttributeError"):
            helper.submit(NoSuchOp, ()).result(timeout=120)  # a new helper answers
        assert helper._connection.process is not stuck
    finally:
        if stuck is not None:
            stuck.kill()  # first: a write blocked on its pipe may hold the helper's lock
        helper.stop()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="read from /proc")
def test_a_process_s_descendants_are_read_from_its_children_lists_as_a_scan_of_every_process_finds_them():
    started = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(process_cpu.descendants(started.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the shell's two sleeps
        listed = process_cpu.descendants(started.pid)
        assert sorted(listed) == sorted(process_cpu._scanned_children()(started.pid)) and len(listed) == 2
        assert {started.pid, *listed} <= set(process_cpu.descendants(os.getpid()))  # theirs are this one's
        own = process_cpu.own_cpu_seconds(os.getpid())
        assert process_cpu.tree_cpu_seconds(os.getpid()) >= own > 0
    finally:
        started.kill()
        started.wait()
    assert process_cpu.descendants(started.pid) == [] and process_cpu.tree_cpu_seconds(started.pid) is None


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="read from /proc")
def test_a_stuck_helper_is_killed_with_the_processes_it_started(monkeypatch):
    """NOTE [a stuck helper]: its processes (a blocked g++) would otherwise linger once it is killed.

    The helper is stopped before its processes are killed: a shell waiting on them would otherwise exit 0 as
    they die, before its own SIGKILL (a race the suite lost under load)."""
    helper_process = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], stdin=subprocess.PIPE)
    started, signals_sent, kill = [], [], os.kill
    monkeypatch.setattr(os, "kill", lambda pid, sig: (signals_sent.append((pid, sig)), kill(pid, sig))[1])
    try:
        deadline = time.monotonic() + 10
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            started = process_cpu.descendants(helper_process.pid)
        assert len(started) == 2
        BodyHelper().stop_stuck(body_helper._Connection(helper_process), idle_s=60.0)
        assert signals_sent[0] == (helper_process.pid, signal.SIGSTOP)
        assert signals_sent[-1] == (helper_process.pid, signal.SIGKILL)
        assert helper_process.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while any(processes.alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(processes.alive(pid) for pid in started)
    finally:
        helper_process.kill()
        for pid in started:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def outcome_within(seconds: float, call):
    """What `call()` returns, or the exception it raises, within `seconds` (a failure, not a hung test, if it
    waits on)."""
    outcome = []

    def calling():
        try:
            outcome.append(call())
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome.append(error)

    thread = threading.Thread(target=calling, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting after {seconds} s"
    return outcome[0]


class FakeClock:
    """time.monotonic(): 0.1 s more at each call (one call per poll), 10 s more from call `jump_at` on (the whole
    job stopped for 10 s between two polls)."""

    def __init__(self, jump_at: int | None):
        self.calls, self.jump_at = 0, jump_at

    def monotonic(self):
        self.calls += 1
        return 0.1 * self.calls + (10.0 if self.jump_at is not None and self.calls >= self.jump_at else 0.0)


@pytest.mark.parametrize("cpu_seconds, jump_at", [("advancing", None), ("descendants advancing", None),
                                                   ("unreadable", None), ("still", 5)])
def test_a_wait_goes_on_while_the_helper_takes_cpu_time_or_where_it_cannot_be_read(monkeypatch, cpu_seconds, jump_at):
    """Taking CPU time (its own, or g++'s under it), unreadable, or standing still only while the job was
    stopped: waited for, not stopped. The answer comes at the sixth poll, 0.6 s on the fake clock, twice
    STALL_S: a wait that ignored any of these would have stopped the helper first."""
    monkeypatch.setattr(body_helper, "STALL_S", 0.3)
    monkeypatch.setattr(body_helper, "POLL_S", 0.05)  # a 0.1 s step is no pause (3 * POLL_S); 10 s is
    helper = BodyHelper()
    process = types.SimpleNamespace(pid=os.getpid(), poll=lambda: None)
    answer = body_helper._Answer(helper, body_helper._Connection(process))
    polls, trees = [], []

    def own(pid):
        polls.append(pid)
        if len(polls) == 6:
            answer.set_result({"source": "answered"})
        return {"advancing": len(polls), "unreadable": None}.get(cpu_seconds, 1.0)

    def tree(pid):
        trees.append(pid)
        return 1.0 + (len(trees) if cpu_seconds == "descendants advancing" else 0)

    monkeypatch.setattr(body_helper, "own_cpu_seconds", own)
    monkeypatch.setattr(body_helper, "tree_cpu_seconds", tree)
    monkeypatch.setattr(body_helper, "time", FakeClock(jump_at))
    stopped = []
    monkeypatch.setattr(helper, "stop_stuck", lambda *args: stopped.append(args))
    assert answer.result() == {"source": "answered"} and not stopped
    # The descendants are read only while the helper's own CPU time stands still.
    assert not trees if cpu_seconds in ("advancing", "unreadable") else len(trees) >= 4


def test_a_wait_with_no_cpu_time_stops_the_helper_and_a_forked_child_does_not_wait_for_its_parent_s(monkeypatch):
    monkeypatch.setattr(body_helper, "STALL_S", 0.3)
    monkeypatch.setattr(body_helper, "POLL_S", 0.05)
    monkeypatch.setattr(body_helper, "own_cpu_seconds", lambda pid: 1.0)
    monkeypatch.setattr(body_helper, "tree_cpu_seconds", lambda pid: 2.0)
    helper = BodyHelper()
    process = types.SimpleNamespace(pid=os.getpid(), poll=lambda: 0)  # ended: nothing to kill
    connection = body_helper._Connection(process)
    answer = body_helper._Answer(helper, connection)
    connection.waiting.append(answer)
    with pytest.raises(RuntimeError, match=r"stuck \(no CPU time for 0 s\)"):
        answer.result()
    assert connection.closed and not connection.waiting
    parents = body_helper._Answer(helper, body_helper._Connection(process))
    parents._connection.owner = os.getpid() + 1  # as a forked child sees its parent's request
    with pytest.raises(RuntimeError, match="a request of the parent process"):
        parents.result()


@pytest.mark.parametrize("switch, cores, on", [(None, 1, False), (None, 2, True), ("1", 1, True), ("0", 16, False),
                                                ("yes", 1, False), ("yes", 2, True)])
def test_the_helper_runs_with_two_cores_or_when_switched_on(monkeypatch, switch, cores, on):
    if switch is None:
        monkeypatch.delenv(body_helper.SWITCH, raising=False)
    else:
        monkeypatch.setenv(body_helper.SWITCH, switch)
    monkeypatch.setattr(body_helper, "_usable_cores", lambda: cores)
    assert BodyHelper.enabled() is on


def _sixteen_cores_and_no_launcher(monkeypatch):
    monkeypatch.setattr(process_cpu, "CPU_QUOTA", "/nonexistent/cpu.max")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    for name in body_helper.LOCAL_RANK_COUNTS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("quota, cores", [("max 100000\n", 16), ("100000 100000\n", 1), ("150000 100000", 1),
                                          ("400000 100000", 4), ("50000 100000", 1), ("", 16), (None, 16)])
def test_a_container_s_cpu_quota_bounds_the_cores(monkeypatch, tmp_path, quota, cores):
    """A container limited to one CPU on a 16-core host: the affinity says 16, the cgroup's cpu.max one."""
    _sixteen_cores_and_no_launcher(monkeypatch)
    limits = tmp_path / "cpu.max"
    if quota is not None:
        limits.write_text(quota)
    monkeypatch.setattr(process_cpu, "CPU_QUOTA", str(limits))
    assert body_helper._usable_cores() == cores


def test_ranks_on_one_machine_share_its_cores(monkeypatch):
    _sixteen_cores_and_no_launcher(monkeypatch)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert body_helper._usable_cores() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert body_helper._usable_cores() == 8


@pytest.mark.parametrize("variable", body_helper.LOCAL_RANK_COUNTS)
def test_each_launcher_s_count_of_the_ranks_here_shares_the_cores(monkeypatch, variable):
    _sixteen_cores_and_no_launcher(monkeypatch)
    monkeypatch.setenv(variable, "4")
    assert body_helper._usable_cores() == 4


def test_torchrun_s_count_comes_first_and_a_count_that_is_not_positive_says_nothing(monkeypatch):
    """torchrun under mpirun (one task per machine, 8 ranks each): torchrun's 8, not MPI's 1."""
    _sixteen_cores_and_no_launcher(monkeypatch)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    assert body_helper._usable_cores() == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert body_helper._usable_cores() == 2
    for nothing in ("four", "", "0", "-2"):  # the next launcher's count decides
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", nothing)
        assert body_helper._usable_cores() == 4, nothing


def test_ranks_spawned_without_a_launcher_s_count_share_the_cores_by_their_process_group(monkeypatch):
    """mp.spawn sets no local size: every rank of the initialised group counts, so 16 ranks on 16 cores start
    no helper (each used to see all 16 cores and start one)."""
    _sixteen_cores_and_no_launcher(monkeypatch)
    monkeypatch.delenv(body_helper.SWITCH, raising=False)
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert body_helper._usable_cores() == 16  # no process group: this process alone
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 16)
    assert body_helper._usable_cores() == 1 and not BodyHelper.enabled()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # a launcher's count comes first
    assert body_helper._usable_cores() == 8


def test_a_helper_that_ended_before_the_kill_is_not_searched_for_processes(monkeypatch):
    """Reaped by the SIGSTOP's own poll, its number is free for another process, whose children it would kill."""
    helper_process = subprocess.Popen(["true"])
    while process_cpu.proc_stat(helper_process.pid)[0] != "Z":  # ended, not yet reaped
        time.sleep(0.01)
    searched = []
    monkeypatch.setattr(body_helper, "descendants", lambda pid: searched.append(pid) or [])
    body_helper._kill_with_descendants(helper_process)
    assert helper_process.returncode == 0 and searched == []


def _cores_here_without_launcher_variables(rank, world_size):
    """In a rank that joined its group: what a rank of mp.spawn sees (no launcher's variables) on 16 cores."""
    for name in (*body_helper.LOCAL_RANK_COUNTS, "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(name, None)
    os.sched_getaffinity = lambda pid: set(range(16))  # this rank's process only
    process_cpu.CPU_QUOTA = "/nonexistent/cpu.max"
    return body_helper._usable_cores()


def test_ranks_of_a_real_process_group_share_the_cores_when_no_launcher_says():
    assert run_ranks(2, _cores_here_without_launcher_variables, timeout=120) == [8, 8]


def test_the_off_switch_keeps_every_body_here(monkeypatch):
    monkeypatch.setenv(body_helper.SWITCH, "0")
    helper = BodyHelper()
    layouts = signature(CHUNK_LOOP_OPS[0], forward_arguments())[1:]
    assert not helper.start() and helper.submit(CHUNK_LOOP_OPS[0], layouts) is None
    assert helper._connection is None
    assert not CompiledBodies(helper=helper).compile_elsewhere(CHUNK_LOOP_OPS[0], forward_arguments())


def test_frames_cross_a_pipe_whole_and_a_silent_pipe_times_out():
    """A frame longer than a pipe's buffer arrives whole (read in pieces); no frame within the timeout is None."""
    read_end, write_end = os.pipe()
    frame = {"source": "x" * 1_000_000}
    with os.fdopen(write_end, "wb") as writer:
        sending = threading.Thread(target=body_helper.write_frame, args=(writer, frame))
        sending.start()
        assert body_helper.read_frame(read_end) == frame
        sending.join()
        start = time.perf_counter()
        assert body_helper.read_frame(read_end, timeout=0.2) is None
        assert time.perf_counter() - start >= 0.2
    assert body_helper.read_frame(read_end) is None  # the writer closed: the end of the stream
    os.close(read_end)
