"""Run a function on W gloo ranks (CPU processes) for multi-process tests.

    from tests._dist import run_ranks

    def _body(rank, world_size, n):          # module level: it is pickled
        ...                                  # process group already initialised
        return something_picklable

    results = run_ranks(3, _body, 5, timeout=60)   # [result of rank 0, 1, 2]

Every rank runs ``fn(rank, world_size, *args)`` in its own process, started
by torch.distributed's elastic launcher through
``laplace_passes.demo.distributed.launch_local`` (what ``laplace-passes demo
--world-size`` uses), after joining its gloo group (``env://``).  The return
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

Ranks start as `laplace_passes.demo.distributed.launch_local` starts them (its
defaults): forked from a fork server, a fresh process (never a fork of the
test runner) that imported torch, torch._dynamo, AOT Autograd, Inductor and the
project's packages once (several seconds of CPU), so a rank starts in milliseconds instead of
re-importing everything; on a 2-core machine that is most of a
multi-process test's runtime. The preload list is fixed when the fork
server starts (the first launch in a test session).
"""

from __future__ import annotations

import os
import socket
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


def _rank_entry(fn, args, pg_timeout, threads):
    # Runs in each launched process: join the group, run fn, report what happened.
    import torch

    from laplace_passes.demo.distributed import join_process_group

    torch.set_num_threads(threads)
    rank = int(os.environ["RANK"])
    try:
        rank, world_size = join_process_group(pg_timeout)
        return RankResult(rank, True, value=fn(rank, world_size, *args))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        return RankResult(rank, False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: float = 30.0,
    threads: int = 1,
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
) -> list[RankResult]:
    """Like run_ranks, but return a RankResult per rank instead of raising."""
    from laplace_passes.demo.distributed import LaunchError, launch_local

    try:
        return launch_local(world_size, _rank_entry, fn, args, pg_timeout, threads, timeout_s=timeout)
    except LaunchError as failed:  # a rank died without reporting; the agent stopped the others
        return [RankResult(r, False, error=f"process failed without reporting: {failed.failures[r]}")
                if r in failed.failures else RankResult(r, False, error="stopped: another rank failed")
                for r in range(world_size)]
    except TimeoutError:
        return [RankResult(r, False, error=f"no result within {timeout:.0f}s (hung?)") for r in range(world_size)]
