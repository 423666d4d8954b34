"""The library's own background threads: they build, probe and read pipes, and never run compiled code.

Some callers must know whether another Python thread could enter a
Dynamo-compiled function while they run: `model_zoo.decode`'s loop skips
Dynamo's guards, a process-wide stance, only while no such thread is alive
(NOTE [guards once per loop] there). The library's own threads are not
such threads: the kernel-batch builder (`kernel_batches`), the ISA probes
and the precompiled header (`inductor_fast`), the body helper's reader
(`unroll/body_helper.py`) only run g++, load libraries and wait on pipes.
Each marks itself with `mark_background` (a thread's first step, or a
thread pool's initializer), so a finished compile's builder thread, which
stays alive for the next compile, does not count as another thread.

    threading.Thread(target=work, name="laplace-...", daemon=True)   # work() starts with mark_background()
    ThreadPoolExecutor(1, thread_name_prefix="laplace-...", initializer=mark_background)
    runs_no_compiled_code(thread)   # True for those threads only
"""

from __future__ import annotations

import threading

_BACKGROUND = "_laplace_passes_background"


def mark_background() -> None:
    """Mark the calling thread as one of the library's background threads (see the module docstring)."""
    setattr(threading.current_thread(), _BACKGROUND, True)


def runs_no_compiled_code(thread: threading.Thread) -> bool:
    """Whether `thread` is one of the library's background threads, which never call compiled code."""
    return getattr(thread, _BACKGROUND, False)
