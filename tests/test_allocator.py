"""NOTE [freed memory kept]: after `keep_freed_memory`, tensors freed by one step are reused by the next,
pages and all; glibc's defaults fault them in again. Each case runs in a process of its own (the
setting is process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from laplace_passes.infra import allocator

STEPS = """
import resource, sys, torch
import laplace_passes
if sys.argv[1] == "keep":
    print(laplace_passes.keep_freed_memory())

def page_faults_of_a_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [torch.empty(3 << 20).fill_(1.0) for _ in range(3)]  # three 12 MiB tensors alive at once
    del buffers
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(*[page_faults_of_a_step() for _ in range(2)])
"""


def glibc() -> bool:
    """Whether keep_freed_memory can act here, by the module's own check of the C library."""
    try:
        allocator._glibc()
    except OSError:
        return False
    return True


def steps(setting: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", STEPS, setting], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()


@pytest.mark.skipif(not glibc(), reason="keep_freed_memory drives glibc's malloc")
def test_the_step_after_the_first_reuses_its_pages_with_freed_memory_kept():
    kept_setting, kept = steps("keep")
    (defaults,) = steps("defaults")
    assert "freed memory kept" in kept_setting and "32 MiB" in kept_setting, kept_setting
    first_kept, second_kept = (int(n) for n in kept.split())
    first_defaults, second_defaults = (int(n) for n in defaults.split())
    # Counted against each process's first step, which touches fresh pages either way (9,000 faults of
    # 4 KiB pages here; fewer where the kernel backs them with huge pages). Kept: the second step reuses
    # the first one's pages (of its three buffers, at most one is placed past them). Defaults: glibc
    # unmapped the first step's blocks when they were freed, and the second step faults them in again.
    assert first_kept > 0 and first_defaults > 0, (kept, defaults)
    assert second_kept <= first_kept // 3 + 64, (kept, defaults)
    assert second_defaults > first_defaults * 3 // 4, (kept, defaults)


def test_a_c_library_other_than_glibc_is_refused_with_the_reason(monkeypatch):
    class OtherLibc:
        pass

    monkeypatch.setattr(allocator, "_glibc", lambda: allocator._glibc_or_refuse(OtherLibc()))
    with pytest.raises(OSError, match="not glibc"):
        allocator.keep_freed_memory()
