"""A dependency-free progress line for long jobs.

On a terminal it redraws one line; elsewhere (CI logs, pipes) it prints a
line every tenth of the way, so logs stay short but show the job is alive.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.interactive = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self._last_tenth = -1

    def update(self, done: int, **fields: float | str) -> None:
        if not self.enabled:
            return
        text = self._line(done, fields)
        if self.interactive:
            self.stream.write("\r" + text)
            self.stream.flush()
            return
        tenth = done * 10 // self.total
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()

    def _line(self, done: int, fields: dict) -> str:
        width = 24
        filled = width * done // self.total
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.perf_counter() - self.start
        parts = [f"{self.label} [{bar}] {done}/{self.total}", f"{elapsed:5.1f}s"]
        parts += [f"{k} {_fmt(v)}" for k, v in fields.items()]
        return "  ".join(parts)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3f}"
    return str(value)
