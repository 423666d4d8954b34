"""Running one function on several CPU processes: under torchrun, or launched locally.

Two ways a data-parallel job gets its processes, both torch.distributed's own
launcher (torchelastic):

* ``torchrun ... laplace-passes demo`` (one node or several): torchrun's
  agent starts the processes and puts RANK, WORLD_SIZE, MASTER_ADDR/PORT and
  TORCHELASTIC_RUN_ID in their environment. :func:`under_torchrun` sees that,
  and :func:`join_process_group` joins the group through ``env://``.
* ``launch_local(W, fn, *args)`` on this machine: the same agent, started
  in-process through ``torch.distributed.launcher.api.elastic_launch`` with a
  c10d rendezvous on 127.0.0.1 and a free port, and no restarts. ``fn`` runs
  in W processes, each of which sees the torchrun environment above and
  calls :func:`join_process_group` itself; the return values come back in
  rank order. The processes are forked from a fork server that imported
  torch, torch._dynamo, AOT Autograd, Inductor and this project once (``preload``): a spawned
  process would spend seconds of CPU importing them, W times over on a
  machine with fewer cores than ranks.

The process group is gloo (CPU). See `docs/usage.md`, "More than one machine".
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

# Process-group timeout: how long a collective waits for a peer that hangs.
DEFAULT_PG_TIMEOUT_S = 300.0

# The agent's TCPStore outlives a restart; gloo then reads the dead attempt's
# addresses (pytorch/pytorch#135712). Disabling the shared store avoids it.
_SHARED_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


# Imported once by the fork server that locally launched ranks are forked from.
# A name that fails to import is skipped (multiprocessing's forkserver ignores it).
# Beside the project, what a rank's first compile imports otherwise: AOT Autograd
# and Inductor (imported by Dynamo's backend lookup and AOT Autograd's call, not
# by `import torch._dynamo`), and Dynamo's debug wrapper of the backend. With them,
# a rank's first Inductor compile of a small function (its kernels cached) took 1.4
# to 1.8 s and 0.6 s of CPU instead of 2.2 to 2.5 s and 1.2 to 1.4 s (two ranks, 2
# cores). A single launch gains nothing (the server's start takes what the ranks
# save); every later launch of the process does. None of them starts a thread, which
# a fork would not copy.
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "laplace_passes", "model_zoo", "model_zoo.muon",
                   "torch._functorch.aot_autograd", "torch._inductor.compile_fx", "torch._inductor.debug",
                   "torch._dynamo.repro.after_dynamo")


class LaunchError(RuntimeError):
    """A locally launched rank failed; ``failures`` maps rank to what went wrong.

    The agent stops the other ranks as soon as one fails, so ``failures``
    holds the rank(s) that failed first. ``raised`` maps each rank that
    raised (rather than died) to its exception's ``"Type: message"``.
    """

    def __init__(self, failures: dict[int, str], raised: dict[int, str] | None = None):
        self.failures = dict(sorted(failures.items()))
        self.raised = dict(sorted((raised or {}).items()))
        lines = [f"{len(failures)} rank(s) failed (the others were stopped):"]
        lines += [f"--- rank {rank}: {message}" for rank, message in self.failures.items()]
        super().__init__("\n".join(lines))


def under_torchrun() -> bool:
    """True inside a process that torchrun's (or elastic_launch's) agent started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launcher_rank_and_world() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) from the launcher's environment; (0, 1) outside one."""
    if not under_torchrun():
        return 0, 1
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def join_process_group(timeout_s: float = DEFAULT_PG_TIMEOUT_S) -> tuple[int, int]:
    """Join the launcher's gloo process group (``env://``); returns (rank, world size).

    Warns on rank 0 when torchrun may restart the workers but shares its
    store with them (the restart would fail in gloo's rendezvous).
    """
    import torch.distributed as dist

    if not under_torchrun():
        raise RuntimeError("join_process_group: not started by torchrun or launch_local (no TORCHELASTIC_RUN_ID)")
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if rank == 0 and restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print(f"warning: torchrun --max-restarts {restarts} with gloo: a restart reads the failed attempt's "
              "addresses from torchrun's store and fails to connect (pytorch/pytorch#135712); use a c10d "
              f"rendezvous (--standalone or --rdzv-backend c10d) with {_SHARED_STORE_VAR}=1 in torchrun's "
              "environment", file=sys.stderr)
    return rank, world


def launch_local(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
                 start_method: str = "forkserver", preload: tuple[str, ...] = DEFAULT_PRELOAD) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` local processes through torchelastic; rank-ordered results.

    ``fn`` must be a module-level function (it is pickled) and calls
    :func:`join_process_group` itself. Rank 0's stdout and stderr go to this
    terminal; the other ranks' go to files that are read back only when
    they fail. Raises :class:`LaunchError` if any rank raised or died, and
    ``TimeoutError`` after ``timeout_s`` seconds (the agent then stops every
    rank). The agent's signal handlers are removed afterwards.

    ``start_method`` "forkserver" (default; "spawn" where the platform has
    no fork server) forks every rank from one process that imported
    ``preload``; the list is fixed when that server starts, at the first
    forkserver launch of this process. "spawn" starts fresh interpreters.
    """
    import multiprocessing

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    if start_method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        start_method = "spawn"
    if start_method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    log_dir = tempfile.mkdtemp(prefix="laplace_launch_")
    logs = DefaultLogsSpecs(log_dir=log_dir, redirects={r: Std.NONE if r == 0 else Std.ALL for r in range(world_size)},
                            tee=Std.NONE)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_configs={"timeout": 120},
                          max_restarts=0, monitor_interval=0.1, start_method=start_method, logs_specs=logs,
                          local_addr="127.0.0.1", shutdown_timeout=5)
    _quiet_agent_loggers()
    try:
        with _restored_signal_handlers(), _deadline(timeout_s):
            values = elastic_launch(config, fn)(*args)
    except ChildFailedError as error:
        raise LaunchError({rank: _failure_text(f) for rank, f in error.failures.items()},
                          {rank: text for rank, f in error.failures.items() if (text := _raised_text(f))}) from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return [values[rank] for rank in range(world_size)]


def _failure_text(failure) -> str:
    """The rank's exception and traceback when it raised; its exit code or signal when it died."""
    message = failure.message
    if isinstance(message, dict):  # the error file `record` wrote: message and traceback
        stack = message.get("extraInfo", {}).get("py_callstack", "")
        return stack.rstrip() or str(message.get("message", message))
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    return f"exited with code {failure.exitcode}"


def _raised_text(failure) -> str | None:
    """"Type: message" of the exception the rank raised (from the error file `record` wrote); None if it died."""
    message = failure.message
    if isinstance(message, dict) and isinstance(message.get("message"), str):
        return message["message"]
    return None


def _quiet_agent_loggers() -> None:
    """The agent logs every worker start and stop as warnings; failures come back as LaunchError."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


class _restored_signal_handlers:
    """The agent installs SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers and never removes them."""

    _SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

    def __enter__(self):
        self._saved = {s: signal.getsignal(s) for s in self._SIGNALS}
        self._env = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")

    def __exit__(self, *exc):
        for s, handler in self._saved.items():
            signal.signal(s, handler)
        if self._env is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        return False


class _deadline:
    """Raise TimeoutError in the main thread after `seconds` (None: no limit); elastic_launch has none."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds

    def __enter__(self):
        if self.seconds is not None:
            self._old = signal.signal(signal.SIGALRM, self._expire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def _expire(self, signum, frame):
        raise TimeoutError(f"the ranks did not finish within {self.seconds:g}s")

    def __exit__(self, *exc):
        if self.seconds is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)
        return False
