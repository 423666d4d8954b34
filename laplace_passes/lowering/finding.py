"""`Finding`: one thing the Neuron toolchain will reject, as the preflight's checks report it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """One thing the Neuron toolchain will reject, where it is and how to fix it."""

    check: str
    node: str
    op: str
    message: str
    fix: str
    graph: str = ""

    def __str__(self) -> str:
        where = f"{self.graph}: " if self.graph else ""
        return f"[{self.check}] {where}node {self.node} ({self.op}): {self.message}. Fix: {self.fix}"
