"""CPU seconds of a process and of the processes it started, from Linux's /proc (None or nothing elsewhere).

    proc_stat(pid)                  /proc/PID/stat's fields after the command name (state first)
    descendants(root)               the live processes `root` started, and theirs
    own_cpu_seconds(pid)            user and system seconds of `pid` and its children waited for
    descendants_cpu_seconds(root)   the same, summed over `root`'s live descendants
    tree_cpu_seconds(root)          both
    usable_cores()                  the cores this process may run on, within a container's CPU quota
"""

from __future__ import annotations

import os
from typing import Callable

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """The live processes `root` started, and theirs (none where there is no /proc, or `root` ended).

    Read from each thread's /proc/PID/task/TID/children: a few files, where
    reading every process's stat costs about 20 microseconds per process on
    the host. Kernels without those files get that scan.
    """
    if not os.path.exists(f"/proc/{root}/task/{root}"):
        return []
    children_of = _listed_children if os.path.exists(f"/proc/{root}/task/{root}/children") else _scanned_children()
    found, frontier = [], [root]
    while frontier:
        frontier = [child for pid in frontier for child in children_of(pid)]
        found += frontier
    return found


def _listed_children(pid: int) -> list[int]:
    """The children of every thread of `pid` (none of a process or thread that ended meanwhile)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                children += [int(child) for child in listed.read().split()]
        except OSError:
            continue
    return children


def _scanned_children() -> Callable[[int], list[int]]:
    """Children by parent, from every process's stat read once."""
    by_parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = proc_stat(int(entry)) if entry.isdigit() else None
        if fields:
            by_parent.setdefault(int(fields[1]), []).append(int(entry))
    return lambda pid: by_parent.get(pid, [])


def stat_cpu_seconds(fields: list[str]) -> float:
    """utime, stime, cutime and cstime of `proc_stat` fields, in seconds."""
    return sum(int(f) for f in fields[11:15]) / _TICKS


def own_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of `pid` and of its children it waited for; None when unreadable (ended, or no /proc)."""
    fields = proc_stat(pid)
    return None if fields is None else stat_cpu_seconds(fields)


def descendants_cpu_seconds(root: int) -> float:
    """CPU seconds of `root`'s live descendants and of the children they waited for (0 where there is no /proc)."""
    return sum(stat_cpu_seconds(fields) for fields in map(proc_stat, descendants(root)) if fields)


def tree_cpu_seconds(root: int) -> float | None:
    """CPU seconds of `root`, of its children it waited for and of its live descendants; None when `root` is
    unreadable (ended, or no /proc)."""
    own = own_cpu_seconds(root)
    return None if own is None else own + descendants_cpu_seconds(root)


CPU_QUOTA = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" in microseconds, or "max <period>"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, within a container's CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, cores_in_quota() or cores)


def cores_in_quota() -> int | None:
    """The CPU time a container's quota allows, in whole cores (at least 1); None without a quota.

    A container limited to one CPU on a large host still sees all the host's cores in its affinity.
    """
    try:
        with open(CPU_QUOTA) as limits:
            quota, period = limits.read().split()[:2]
        return max(1, int(quota) // int(period))
    except (OSError, ValueError):  # no cgroup v2 file, "max" (no quota), or a format not expected
        return None
