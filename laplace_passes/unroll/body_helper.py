"""A helper process that compiles chunk-loop bodies while this process compiles their host graphs.

    HELPER.start()                 start the helper now (it takes seconds to import torch), if enabled
    HELPER.submit(op, layouts)     compile the body of `op` there, its arguments as `compiled_bodies.signature`
                                   lays them out: a Future of its wrapper's source, or None when the helper
                                   is off or cannot start
    HELPER.submit_codegen(payload) Inductor's codegen of a graph there (laplace_passes.infra.remote_codegen,
                                   NOTE [backward graphs generated in the helper process]): a Future of the
                                   compiled graph's bytes, or None
    load_wrapper(source)           that source as this process's callable (its C++ from the shared cache)

NOTE [bodies compiled in a helper process]
Inductor's codegen is Python: two graphs of one process cannot be generated
side by side, and on the cpu target's training step the backward's GLA body
was the largest compile of the first call (about 7 s of codegen of 26 s on
a 2-core machine), with the second core idle. Its signature is known as
soon as the forward graph is: the backward op takes the forward op's
inputs, tangents shaped as its outputs and its residuals
(`compiled_bodies.backward_arguments`). So the forward's `compile_ahead`
hands it to this helper, which traces and compiles it exactly as this
process would (`compiled_bodies.compiled_source`: the same body, the same
Inductor configuration, sent with the request) while this process compiles
the forward body, the host graphs and runs the forward. The helper answers
with the wrapper module Inductor generated, once its kernels are built into
the shared Inductor cache folder; this process loads that module (its
kernels found in the cache, not built again) at the backward graph's first
call, so the backward graph's own codegen runs while the helper finishes
(waiting for the body before that codegen cost 0.7 s of a 26 s first call).
The kernels are the ones Inductor generated for the same
graph: the numbers are those of the body compiled here
(tests/test_body_helper.py compares them bit for bit).

What the helper cannot do costs nothing but its CPU: a body whose request
fails (the helper exited, an error in its compile) is compiled here, as
before, with the reason in the log; a predicted signature the backward
does not use is never loaded. The helper is a plain `python -m` process
(not multiprocessing, which would run the user's main script again in it),
started as the first Dynamo graph with GLA sites whose bodies will be
compiled begins (`compile_fx`), fed over a pipe, one request at a time
(`body_worker`, its side); it exits when this process closes the pipe, or
after `IDLE_EXIT_S` without a request.

The same helper generates a training step's whole backward graph (NOTE
[backward graphs generated in the helper process] in
`laplace_passes/driver/backward_ahead.py`, `submit_codegen`).

Where it runs: with two usable cores or more, for bodies and whole
backward graphs alike. On two cores the first call is CPU bound, so the
helper gains only what its second core adds beside this process's g++
runs: measured on a 2-core AVX2 machine in fresh processes alternating
with LAPLACE_PASSES_BODY_HELPER=0, the cpu target's first call of tiny's
step 0.94x as long, of fla's GLAForCausalLM 0.92x (docs/benchmarks.md).
With one core it would only take this process's time. The cores are
shared with the other ranks on the machine: as many as the launcher says
(torchrun's LOCAL_WORLD_SIZE, Open MPI's and MPICH's local sizes), else,
for a launch that says nothing (`torch.multiprocessing.spawn`), every rank
of an initialised process group, so that eight spawned ranks on eight
cores do not start eight helpers (a job across machines that says
nothing counts all its ranks, and may keep the helper off: it only loses
what the helper would gain). LAPLACE_PASSES_BODY_HELPER=1 turns it on
whatever the cores, =0 off.

NOTE [a stuck helper]
A helper that is alive but makes no progress (stopped by a signal, or
blocked for good) would leave this process waiting for its answer forever,
the training step hung. So waiting for an answer (`Future.result()` on what
`submit` and `submit_codegen` return) watches the helper's CPU time, its
own and, when that stands still, its processes' (g++;
`laplace_passes.infra.process_cpu`): a compile, however slow on a loaded
machine, keeps taking some. After STALL_S seconds without any, the helper is
killed with the processes it started, which would otherwise linger, blocked
too (its pending requests fail, their bodies and graphs are compiled here, a
warning says why), and a later request starts a new one. A wait that
itself did not run for a while (the whole job stopped, a paused machine)
starts counting again. Requests are pickled by their caller and written to
the helper by a thread of their own, so a helper that reads no more blocks
that thread, not a compile sending it a graph bigger than the pipe's buffer;
the helper keeps its pipes on descriptors its own processes (g++) do not
inherit, so once it is killed that write fails at once. A forked child does not
wait for its parent's requests: they fail at once, and it compiles them
itself. Where the CPU time cannot be read (no /proc) the wait is as before.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Sequence

import torch

from laplace_passes.infra import logs
from laplace_passes.infra.process_cpu import descendants, own_cpu_seconds, tree_cpu_seconds, usable_cores
from laplace_passes.infra.threads import mark_background

SWITCH = "LAPLACE_PASSES_BODY_HELPER"  # "1": on, "0": off, anything else or unset: on with enough cores
# This process and the helper, each on a core of its own (NOTE above: on two cores a training step's
# first call measured 0.92x to 0.94x as long with it).
MIN_CORES = 2
IDLE_EXIT_S = 600.0  # the helper exits after this long without a request
STALL_S = 60.0  # a helper whose processes take no CPU time for this long is stuck (NOTE [a stuck helper])
POLL_S = 1.0  # how often a wait for an answer reads the helper's CPU time
_LENGTH = struct.Struct("<Q")


class _Connection:
    """One helper process, the requests not sent yet, and the Futures of those it has not answered, in order."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.waiting: deque[Future] = deque()
        # Written by a thread of its own: a helper that reads no more (stopped, or busy with a request bigger
        # than the pipe's buffer) blocks that thread, never a compile (NOTE [a stuck helper]). None ends it.
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.owner = os.getpid()  # a forked child's copies of the Futures are answered to the parent only
        self.closed = False  # its requests failed (`BodyHelper._fail_waiting`): it takes no more


class _Answer(Future):
    """A Future of the helper's answer whose `result()` gives up on a stuck helper (NOTE [a stuck helper])."""

    def __init__(self, helper: BodyHelper, connection: _Connection) -> None:
        super().__init__()
        self._helper, self._connection = helper, connection

    def result(self, timeout: float | None = None):
        if timeout is not None:
            return super().result(timeout)
        if os.getpid() != self._connection.owner and not self.done():
            raise RuntimeError("a request of the parent process: its helper answers the parent")
        cpu, since = None, time.monotonic()
        polled = since
        while True:
            try:
                return super().result(POLL_S)
            except FutureTimeout:
                pass
            # Longer than a poll since the last one: this process did not run either (a stopped job, a
            # paused machine), and neither did the helper.
            now = time.monotonic()
            paused, polled = now - polled > 3 * POLL_S, now
            reading = _cpu_reading(self._connection.process.pid, cpu)
            if reading is None and self._connection.process.poll() is not None:  # ended, its reply not read
                self._helper._fail_waiting(self._connection, "the helper process exited")
            elif paused or reading is None or reading != cpu:  # unreadable (wait as before), or progress
                cpu, since = reading, now
            elif now - since >= STALL_S:
                self._helper.stop_stuck(self._connection, now - since)


def _cpu_reading(pid: int, last: tuple | None) -> tuple | None:
    """The helper's CPU seconds, and its descendants' (g++) only when its own did not change since `last`."""
    own = own_cpu_seconds(pid)
    if own is None:
        return None
    if last is None or own != last[0]:
        return own, None
    return own, tree_cpu_seconds(pid)


class BodyHelper:
    """This process's side of the helper: starts it, sends requests, hands each reply to its Future in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connection: _Connection | None = None

    @staticmethod
    def enabled() -> bool:
        """On: switched on, or not switched off and MIN_CORES usable cores."""
        switch = os.environ.get(SWITCH)
        if switch in ("0", "1"):
            return switch == "1"
        return _usable_cores() >= MIN_CORES

    def start(self) -> bool:
        """The helper running (started now if need be); False when it is off or could not start."""
        if not self.enabled():
            return False
        with self._lock:
            return self._running() is not None

    def submit(self, op, layouts: Sequence[tuple]) -> Future | None:
        """Compile the body of chunk-loop `op` in the helper; `layouts`: its signature's arguments (no tensors).

        A Future of {"source": the wrapper module's source, "seconds": ...}.
        """
        if not self.enabled():
            return None
        return self._request({"op": op.name(), "args": list(layouts),
                              "inductor_config": torch._inductor.config.save_config_portable()})

    def submit_codegen(self, payload: bytes) -> Future | None:
        """Inductor's codegen of a `remote_codegen.CodegenRequest.payload()` in the helper: a Future of its answer.

        The answer is the bytes `remote_codegen.load_answer` loads, sent once the kernels are built into the
        shared cache.
        """
        future = self._request({"codegen": payload}) if self.enabled() else None
        if future is None:
            return None
        answer = _Answer(self, future._connection)

        def answered(done: Future) -> None:
            try:
                answer.set_result(done.result()["answer"])
            except Exception as error:  # noqa: BLE001 - a failed request, or a reply without an answer
                answer.set_exception(error)

        future.add_done_callback(answered)
        return answer

    def _request(self, request: dict) -> Future | None:
        from torch._inductor.async_compile import get_compile_threads

        # compile_threads is not in Inductor's portable configuration; it decides how kernels are batched into
        # libraries, and this process finds the helper's libraries in the cache only if the helper batches them
        # the same way. Pickled here: a request that cannot be is this caller's error, not the writer thread's.
        data = frame({**request, "compile_threads": get_compile_threads()})
        with self._lock:
            connection = self._running()
            if connection is None:
                return None
            future = _Answer(self, connection)
            connection.waiting.append(future)
            connection.outbox.put(data)  # in the order of `waiting`
        return future

    def _running(self) -> _Connection | None:
        if self._connection is not None and not self._connection.closed and self._connection.process.poll() is None:
            return self._connection
        environment = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "laplace_passes.unroll.body_worker"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=environment)
        except OSError:
            self._connection = None
            return None
        self._connection = _Connection(process)
        threading.Thread(target=self._read_replies, args=(self._connection,), daemon=True,
                         name="laplace-body-helper").start()
        threading.Thread(target=self._write_requests, args=(self._connection,), daemon=True,
                         name=f"laplace-body-helper-requests-{process.pid}").start()
        return self._connection

    def _write_requests(self, connection: _Connection) -> None:
        mark_background()
        while (data := connection.outbox.get()) is not None:
            try:
                write_bytes(connection.process.stdin, data)
            except Exception as error:  # noqa: BLE001 - the helper exited, or its pipe was closed: nothing more
                self._fail_waiting(connection, f"the helper process takes no more requests ({error!r})")
                return

    def _fail_waiting(self, connection: _Connection, why: str) -> None:
        """Fail every request `connection` has not answered (they are compiled here); it takes no more."""
        with self._lock:
            connection.closed = True  # a request is either in `waiting` now or sent to a new helper
            waiting = list(connection.waiting)
            connection.waiting.clear()
        for future in waiting:
            future.set_exception(RuntimeError(why))

    def _read_replies(self, connection: _Connection) -> None:
        mark_background()
        replies = connection.process.stdout.fileno()  # once: `stop` may close the stream meanwhile
        while True:
            try:
                reply = read_frame(replies)
            except Exception:  # noqa: BLE001 - a closed descriptor or a torn frame: the helper is gone
                reply = None
            if reply is None:  # the helper exited: what it had not answered is compiled here
                self._fail_waiting(connection, "the helper process exited")
                connection.outbox.put(None)
                break
            with self._lock:
                if not connection.waiting:  # stopped as stuck (`stop_stuck`): its requests failed already
                    continue
                future = connection.waiting.popleft()
            if "error" in reply:
                future.set_exception(RuntimeError(reply["error"]))
            else:
                future.set_result(reply)
        _close(connection.process)

    def stop_stuck(self, connection: _Connection, idle_s: float) -> None:
        """Kill a helper that took no CPU time for `idle_s` s; what it had not answered fails at once."""
        with self._lock:
            if connection.closed:  # another wait stopped it, or it exited
                return
            connection.closed = True
            if self._connection is connection:
                self._connection = None
        if connection.process.poll() is None:
            logs.log.warning("the helper process (pid %d) took no CPU time for %.0f s: stopped; what it was "
                             "compiling is compiled here", connection.process.pid, idle_s)
            _kill_with_descendants(connection.process)
        self._fail_waiting(connection, f"the helper process was stuck (no CPU time for {idle_s:.0f} s)")
        connection.outbox.put(None)

    def stop(self) -> None:
        """End the helper now (what it had not answered fails, and is compiled here when asked for)."""
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            self._fail_waiting(connection, "the helper process was stopped")
            connection.outbox.put(None)
            if connection.process.poll() is None:
                connection.process.kill()
                _close(connection.process)


def _kill_with_descendants(process: subprocess.Popen) -> None:
    """SIGKILL the processes the helper started, then the helper (once it is killed, they would be init's).

    The helper is stopped first (SIGSTOP), so that it neither starts another process nor reaps or outlives
    the ones being killed: a child that ends meanwhile stays its zombie, its number not handed to another
    process before the signal, and the helper ends by the SIGKILL, never on its own once its children die
    (a shell waiting on them would exit 0). The deepest first, the helper last.
    """
    process.send_signal(signal.SIGSTOP)  # not sent where the helper was reaped: its number may be another's
    if process.returncode is not None:  # it ended, and was reaped just now: its number is free to be reused
        return
    for pid in reversed(descendants(process.pid)):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # ended and reaped meanwhile
            pass
    process.kill()


def _close(process: subprocess.Popen) -> None:
    """Reap an ended (or killed) helper and close this process's ends of its pipes."""
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:  # its stdout closed but it lingers: it gets no more requests anyway
        process.kill()
    for stream in (process.stdin, process.stdout):
        try:
            stream.close()
        except OSError:
            pass


HELPER = BodyHelper()
atexit.register(HELPER.stop)
if hasattr(os, "register_at_fork"):  # a forked child does not own its parent's helper
    os.register_at_fork(after_in_child=lambda: HELPER.__init__())


def _usable_cores() -> int:
    """The cores this process may run on (within a container's CPU quota), shared with the other ranks started
    on this machine."""
    return usable_cores() // _ranks_on_this_machine()


# What launchers say of the ranks they started on this machine: torchrun, Open MPI, MPICH.
LOCAL_RANK_COUNTS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def _ranks_on_this_machine() -> int:
    """The ranks sharing this machine's cores: what the launcher says, else every rank of an initialised process
    group (`mp.spawn` says nothing, and starts every rank here), else this process alone.

    A job across machines that says nothing (`mp.spawn` on each machine, srun) counts every rank of the job, and
    ranks a launcher pinned to cores of their own (MPI's binding) share cores they do not have: both may leave
    the helper off, which costs only what it would have gained (LAPLACE_PASSES_BODY_HELPER=1 turns it on).
    """
    for name in LOCAL_RANK_COUNTS:  # a count that is not a positive integer says nothing
        try:
            ranks = int(os.environ[name])
        except (KeyError, ValueError):
            continue
        if ranks > 0:
            return ranks
    distributed = torch.distributed
    try:
        if distributed.is_available() and distributed.is_initialized():
            return max(1, distributed.get_world_size())
    except (RuntimeError, ValueError):  # the group destroyed meanwhile, by another thread
        pass
    return 1


def load_wrapper(source: str) -> Callable[[list], Sequence[torch.Tensor]]:
    """Inductor's wrapper module from its source: its `call` (a list of tensors in, the outputs out)."""
    from torch._inductor.codecache import PyCodeCache

    from laplace_passes.infra.kernel_batches import kernels_compiled_together

    with kernels_compiled_together():  # the kernels as the helper built them: found in the cache
        module = PyCodeCache.load(source)
    return module.call


def write_frame(stream, obj) -> None:
    write_bytes(stream, frame(obj))


def frame(obj) -> bytes:
    """`obj` pickled, after its length: what `read_frame` reads back."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


def write_bytes(stream, data: bytes) -> None:
    stream.write(data)
    stream.flush()


def read_frame(fd: int, timeout: float | None = None):
    """One pickled object from `fd`; None at the end of the stream or after `timeout` s without one."""
    if timeout is not None and not select.select([fd], [], [], timeout)[0]:
        return None
    header = _read_exactly(fd, _LENGTH.size)
    if header is None:
        return None
    payload = _read_exactly(fd, _LENGTH.unpack(header)[0])
    return None if payload is None else pickle.loads(payload)


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
