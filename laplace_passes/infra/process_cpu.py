"""CPU seconds of a process and of the processes it started, from Linux's /proc (None or nothing elsewhere).

    proc_stat(pid)          /proc/PID/stat's fields after the command name (state first)
    descendants(root)       the live processes `root` started, and theirs
    own_cpu_seconds(pid)    user and system seconds of `pid` and its children waited for
    tree_cpu_seconds(root)  the same, and its live descendants'
"""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """The live processes `root` started, and theirs (none where there is no /proc).

    Read from each thread's /proc/PID/task/TID/children: a few files, where
    reading every process's stat costs about 20 microseconds per process on
    the host. Kernels without those files get that scan.
    """
    found, frontier = [], [root]
    while frontier:
        children = []
        for pid in frontier:
            listed = _children(pid)
            if listed is None:
                return _descendants_by_scan(root)
            children += listed
        found += children
        frontier = children
    return found


def _children(pid: int) -> list[int] | None:
    """The children of every thread of `pid` ([] when it ended); None where the kernel keeps no such list."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                children += [int(child) for child in listed.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{task}"):  # the thread ended meanwhile
                continue
            return None
        except OSError:
            continue
    return children


def _descendants_by_scan(root: int) -> list[int]:
    if not os.path.isdir("/proc"):
        return []
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = proc_stat(int(entry))
            if fields:
                parents[int(entry)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def stat_cpu_seconds(fields: list[str]) -> float:
    """utime, stime, cutime and cstime of `proc_stat` fields, in seconds."""
    return sum(int(f) for f in fields[11:15]) / _TICKS


def own_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of `pid` and of its children it waited for; None when unreadable (ended, or no /proc)."""
    fields = proc_stat(pid)
    return None if fields is None else stat_cpu_seconds(fields)


def tree_cpu_seconds(root: int) -> float | None:
    """CPU seconds of `root`, of its children it waited for and of its live descendants; None when `root` is
    unreadable (ended, or no /proc)."""
    own = own_cpu_seconds(root)
    if own is None:
        return None
    return own + sum(stat_cpu_seconds(f) for f in map(proc_stat, descendants(root)) if f)
