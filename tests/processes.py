"""Subprocesses that start processes of their own (torchrun agents, `--world-size` ranks).

`subprocess.run(..., timeout=...)` and `Popen.communicate(timeout=...)` kill
(or leave) only the process they started: its ranks would outlive a test that
timed out and hold the CPU and ports for the tests after it. These helpers
start the command in a session of its own and, when it runs over, kill the
whole session before raising `subprocess.TimeoutExpired`.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def start(command: list[str], **popen_kwargs) -> subprocess.Popen:
    """`command` started in a new session, stdout and stderr captured as text."""
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen_kwargs)


def communicate(process: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The process's (stdout, stderr); past `timeout` seconds its whole session is killed first."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # the session ended meanwhile
            pass
        process.communicate()
        raise


def run(command: list[str], timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """Like `subprocess.run(command, capture_output=True, text=True, timeout=timeout)`, session and all."""
    process = start(command, **popen_kwargs)
    out, err = communicate(process, timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def alive(pid: int) -> bool:
    """The process exists and has not ended: neither gone nor a zombie (or dead) waiting to be reaped."""
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:  # reaped meanwhile
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
