"""Run a function on W gloo ranks (CPU processes) for multi-process tests.

    from tests._dist import run_ranks

    def _body(rank, world_size, n):          # module level: it is pickled
        ...                                  # process group already initialised
        return something_picklable

    results = run_ranks(3, _body, 5, timeout=60)   # [result of rank 0, 1, 2]

Every rank runs ``fn(rank, world_size, *args)`` in its own process, started
with ``torch.multiprocessing``, after
``init_process_group("gloo", "tcp://127.0.0.1:<free port>")``.  The return
values come back in rank order.  If any rank raises, exits without reporting,
or the whole run exceeds ``timeout`` seconds, :class:`RankFailures` is raised
with the traceback of every failed rank (survivors are killed after the
deadline).  ``run_ranks_detailed`` returns a :class:`RankResult` per rank
instead of raising.

A test that *expects* a rank to fail should catch the exception inside ``fn``
and return a description of it, so that the run itself succeeds.
``pg_timeout`` is the process group's collective timeout: a rank stuck in a
collective whose peer has hung raises after about that long (a peer that
exited is noticed at once: its connections close).

Start method: ``forkserver`` by default.  The fork server is a fresh process
(never a fork of the test runner) that imports ``preload`` once (torch,
torch._dynamo and the project's packages: several seconds of CPU, because
``model_zoo`` imports ``laplace_passes`` which imports ``torch._dynamo``) and
forks every rank from that state, so a rank starts in milliseconds instead of
re-importing everything; on a 2-core machine that is most of a multi-process
test's runtime.  A preload module that fails to import is skipped (the ranks
then import what they need themselves).  The preload list is fixed when the
fork server starts (the first call in a test session).
``start_method="spawn"`` gives fully independent interpreters.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["RankFailures", "RankResult", "free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None  # return value when ok
    error: str = ""  # "ExcType: message" when not ok
    traceback: str = ""


class RankFailures(RuntimeError):
    """One or more ranks failed; ``results`` holds a RankResult per rank."""

    def __init__(self, results: list[RankResult], reason: str = ""):
        self.results = results
        lines = [reason or "ranks failed:"]
        for r in results:
            if r.ok:
                continue
            lines.append(f"--- rank {r.rank}: {r.error}")
            if r.traceback:
                lines.append(r.traceback.rstrip())
        super().__init__("\n".join(lines))


def _worker(rank, world_size, port, pg_timeout, threads, fn, args, out_q):
    # Runs in the child process.
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    code = 1
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world_size, *args)
        out_q.put(RankResult(rank, True, value=value))
        code = 0
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        try:
            out_q.put(
                RankResult(
                    rank,
                    False,
                    error=f"{type(e).__name__}: {e}",
                    traceback=traceback.format_exc(),
                )
            )
        except Exception:  # unpicklable/oversized: still report something
            out_q.put(RankResult(rank, False, error=repr(e)[:2000]))
    finally:
        # No destroy_process_group(): after a failed or timed-out collective
        # (which tests provoke on purpose) it can block on the dead peer.
        # Every collective fn issued has completed once it returns, so leaving
        # at once is safe.  Flush the result queue first.
        out_q.close()
        out_q.join_thread()
        os._exit(code)


DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "laplace_passes",
    "model_zoo",
    "model_zoo.muon",
)


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: float = 30.0,
    threads: int = 1,
    start_method: str = "forkserver",
    preload: tuple[str, ...] = DEFAULT_PRELOAD,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Returns the per-rank return values (rank order).  Raises RankFailures if
    any rank raised, died, or the run exceeded ``timeout`` seconds.
    ``threads`` sets torch's intra-op threads per rank (1 keeps several ranks
    from oversubscribing a small machine).
    """
    results = run_ranks_detailed(
        world_size,
        fn,
        *args,
        timeout=timeout,
        pg_timeout=pg_timeout,
        threads=threads,
        start_method=start_method,
        preload=preload,
    )
    if not all(r.ok for r in results):
        raise RankFailures(results, f"{sum(not r.ok for r in results)} of {world_size} ranks failed:")
    return [r.value for r in results]


def run_ranks_detailed(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: float = 30.0,
    threads: int = 1,
    start_method: str = "forkserver",
    preload: tuple[str, ...] = DEFAULT_PRELOAD,
) -> list[RankResult]:
    """Like run_ranks, but return a RankResult per rank instead of raising."""
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(preload))
    out_q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, pg_timeout, threads, fn, args, out_q),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()

    deadline = time.monotonic() + timeout
    got: dict[int, RankResult] = {}
    while len(got) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            res = out_q.get(timeout=min(remaining, 0.5))
            got[res.rank] = res
            continue
        except queue_mod.Empty:
            pass
        # A rank that died without reporting (segfault, os._exit) never will.
        for r, p in enumerate(procs):
            if r not in got and p.exitcode is not None:
                # Give its queue item a last chance to arrive.
                try:
                    while True:
                        res = out_q.get(timeout=0.2)
                        got[res.rank] = res
                except queue_mod.Empty:
                    pass
                if r not in got:
                    got[r] = RankResult(r, False, error=f"process exited with code {p.exitcode} without reporting")

    timed_out = len(got) < world_size
    for r in range(world_size):
        if r not in got:
            got[r] = RankResult(r, False, error=f"no result within {timeout:.0f}s (hung?)")

    # Reap the processes: successful ranks exit by themselves shortly.
    join_deadline = time.monotonic() + (0 if timed_out else 10.0)
    for p in procs:
        p.join(timeout=max(0.0, join_deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    out_q.close()
    return [got[r] for r in range(world_size)]
