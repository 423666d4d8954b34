"""Keep freed memory in the process on glibc, so large CPU tensors are reused instead of faulted in again.

    import laplace_passes
    laplace_passes.keep_freed_memory()   # once, early: process-wide; raises OSError where glibc is not the libc

NOTE [freed memory kept]
A compiled CPU graph allocates its intermediate tensors at every call and
frees them before the next: the chunked GLA forward and backward at B=1,
T=2048, H=4, K=128, V=256 allocate tens of buffers of 1 to 8 MiB. glibc
serves such blocks with fresh ``mmap`` pages or trims them off the top of
its heap when they are freed, so the next call touches new pages and the
kernel zeroes each one on its first write: 8,300 minor page faults (33 MiB)
per forward + backward there, against 600 to 1,000 with freed memory kept, and the
copy loops that write fresh buffers ran at a third of the copy bandwidth
(`benchmarks/bench_loops.py` times them; figures in docs/benchmarks.md).

`keep_freed_memory` sets glibc's ``M_MMAP_THRESHOLD`` to its largest value
(32 MiB on 64-bit: smaller blocks come from the heap) and ``M_TRIM_THRESHOLD``
to its largest (up to 2 GiB of freed memory at the heap's top stays mapped), so a buffer freed by one call
is handed, pages and all, to the next. The cost: the process keeps the
memory of its peak, as a caching allocator does; blocks above 32 MiB are
still mapped and unmapped per allocation. It is process-wide and changes
nothing a program computes, so the library never sets it on its own: a
program calls it (the GLA benchmarks do when given `--keep-freed-memory`,
and print the allocator they ran with). Setting ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=...``
in the environment before Python starts does the same.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# From glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): a larger value is refused.
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
TRIM_THRESHOLD = 2**31 - 1  # mallopt's largest value (an int): freed heap memory stays mapped up to 2 GiB


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL:
    """The process's C library, if it is glibc (its mallopt is the one this module drives)."""
    return _glibc_or_refuse(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"))


def _glibc_or_refuse(libc):
    if not hasattr(libc, "gnu_get_libc_version"):
        raise OSError("the C library is not glibc: keep_freed_memory sets glibc's malloc thresholds only")
    return libc


def keep_freed_memory() -> str:
    """Make glibc keep freed memory in the process (NOTE [freed memory kept]); returns what was set.

    Raises OSError where the C library is not glibc or refuses a setting.
    """
    libc = _glibc()
    for name, option, value in (("M_MMAP_THRESHOLD", _M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
                                ("M_TRIM_THRESHOLD", _M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if libc.mallopt(ctypes.c_int(option), ctypes.c_int(value)) != 1:
            raise OSError(f"glibc refused mallopt({name}, {value})")
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    version = libc.gnu_get_libc_version().decode()
    return (f"glibc {version}: blocks up to {MMAP_THRESHOLD_MAX >> 20} MiB from the heap, freed memory kept "
            "(laplace_passes.keep_freed_memory)")
