"""The options of one `laplace` compile, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laplace_passes._checks import check_chunk_size
from laplace_passes.inner import InnerCompiler, resolve_inner
from laplace_passes.report import Report
from laplace_passes.targets import HardwareTarget, get_target

OPTION_DOCS = {
    "target": "hardware target name or HardwareTarget (default 'trn2')",
    "inner": "compiler for the ATen graphs: 'eager', 'inductor' or a callable (default 'eager')",
    "chunk_size": "GLA chunk size; default: the target's partition count",
    "retile_gla": "run the GLA re-tiling pass (default True)",
    "report": "a laplace_passes.Report to fill (default: a new one, see last_report())",
}


@dataclass
class CompileConfig:
    target: HardwareTarget
    inner: InnerCompiler
    chunk_size: int
    retile_gla: bool
    report: Report

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> CompileConfig:
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTION_DOCS))
        if unknown:
            known = "; ".join(f"{k}: {v}" for k, v in OPTION_DOCS.items())
            raise ValueError(f"unknown laplace option(s) {unknown}; known options: {known}")
        target = get_target(options.get("target", "trn2"))
        inner = resolve_inner(options.get("inner", "eager"))
        chunk_size = check_chunk_size("chunk_size", options.get("chunk_size", target.chunk_size))
        retile = options.get("retile_gla", True)
        if not isinstance(retile, bool):
            raise TypeError(f"retile_gla must be a bool, got {type(retile).__name__}")
        report = options.get("report") or Report()
        if not isinstance(report, Report):
            raise TypeError(f"report must be a laplace_passes.Report, got {type(report).__name__}")
        report.target = target.name
        report.inner = inner.name
        return cls(target, inner, chunk_size, retile, report)
