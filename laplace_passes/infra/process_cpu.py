"""CPU seconds of a process and of the processes it started, from Linux's /proc (None or nothing elsewhere).

    proc_stat(pid)          /proc/PID/stat's fields after the command name (state first)
    descendants(root)       the live processes `root` started, and theirs
    tree_cpu_seconds(root)  user and system seconds of `root`, its children waited for and its live descendants
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
    """The live processes `root` started, and theirs (none where there is no /proc)."""
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


def tree_cpu_seconds(root: int) -> float | None:
    """CPU seconds of `root`, of its children it waited for and of its live descendants; None when `root` is
    unreadable (ended, or no /proc)."""
    fields = proc_stat(root)
    if fields is None:
        return None
    return stat_cpu_seconds(fields) + sum(stat_cpu_seconds(f) for f in map(proc_stat, descendants(root)) if f)
