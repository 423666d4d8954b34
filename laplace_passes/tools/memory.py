"""Work too large for this machine's memory: refused in one line, with the fix, never a traceback.

    check_fits(needed_bytes, what, fix)        before the work, from a lower bound of what it allocates
    with allocation_failures_as_errors(fix):   where the work allocates: an allocation that fails
        ...                                    becomes an OutOfMemory naming the size and the fix

The bound given to `check_fits` must be one the work cannot go below (the
token ids and logits of a batch, say): a refusal is then never wrong. What
passes it may still fail later, in the allocator, whose failures differ by
device and size (a RuntimeError "can't allocate memory" or "not enough
memory" on CPU, "Invalid buffer size" on MPS, torch.OutOfMemoryError on
CUDA, OverflowError or TypeError for a size beyond 64 bits); the context manager turns
each into the same one line.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Iterator

# What allocators say when an allocation fails (CPU on Linux and Windows, MPS, CUDA, a size overflow).
_ALLOCATION_FAILURES = ("can't allocate memory", "not enough memory", "invalid buffer size", "out of memory",
                        "storage size calculation overflowed", "too large to convert",
                        "overflow when unpacking")


class OutOfMemory(ValueError):
    """Work that cannot fit in memory; the message names the size and the fix."""


def physical_memory_bytes() -> int | None:
    """This machine's memory; None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits(needed_bytes: int, what: str, fix: str) -> None:
    """Refuse `what` when it needs at least `needed_bytes`, more than this machine has."""
    available = physical_memory_bytes()
    if available is not None and needed_bytes > available:
        raise OutOfMemory(f"{what} need at least {format_bytes(needed_bytes)}, more than this machine's "
                          f"{format_bytes(available)} of memory: {fix}")


@contextlib.contextmanager
def allocation_failures_as_errors(fix: str) -> Iterator[None]:
    """Turn a failed allocation inside the block into an OutOfMemory saying `fix`; other errors pass."""
    try:
        yield
    except Exception as error:
        failure = _allocation_failure(error)
        if failure is None:
            raise
        raise OutOfMemory(f"out of memory ({_allocator_message(failure)}): {fix}") from error


def _allocation_failure(error: BaseException) -> BaseException | None:
    """`error`, or the error it was raised from, when that is a failed allocation (an OutOfMemory is not)."""
    seen = set()
    while error is not None and id(error) not in seen and not isinstance(error, OutOfMemory):
        seen.add(id(error))
        if isinstance(error, MemoryError):
            return error
        first_line = str(error).strip().partition("\n")[0].lower()  # not a report quoting other errors
        if isinstance(error, (RuntimeError, OverflowError, TypeError)) and any(
                words in first_line for words in _ALLOCATION_FAILURES):
            return error
        error = error.__cause__ if error.__cause__ is not None or error.__suppress_context__ else error.__context__
    return None


def _allocator_message(error: BaseException) -> str:
    """The allocator's words, without its source location ("[enforce fail at alloc_cpu.cpp:127] err == 0.")."""
    text = str(error).split("\nException raised from")[0]  # c10's C++ frames
    text = " ".join(text.split()) or type(error).__name__
    text = re.sub(r"^\[enforce fail at [^\]]*\]\s*(err == 0\.\s*)?", "", text)
    tried = re.search(r"tried to allocate (\d+) bytes", text)
    if tried:
        text = text.replace(tried.group(0), f"tried to allocate {format_bytes(int(tried.group(1)))}")
    return text


def format_bytes(count: int) -> str:
    size = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:,.0f} {unit}" if unit == "bytes" else f"{size:,.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
