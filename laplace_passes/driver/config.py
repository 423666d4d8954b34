"""The options of one `laplace` compile, validated once."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping

from laplace_passes.infra.checks import check_chunk_size
from laplace_passes.infra.inner import TORCH_COMPILERS, InnerCompiler, resolve_inner
from laplace_passes.infra.report import Report
from laplace_passes.infra.strict import strict_mode
from laplace_passes.infra.targets import HardwareTarget, get_target

OPTION_DOCS = {
    "target": "hardware target name or HardwareTarget (default 'trn2')",
    "inner": "compiler for the ATen graphs: 'eager', 'inductor', 'stablehlo', 'iree', 'neuron' "
    "(laplace_passes.lowering) or a callable (default 'eager')",
    "chunk_size": "GLA chunk size; default: the target's partition count",
    "retile_gla": "re-tile GLA sites (default True; False keeps the reference op, each site reported as declined)",
    "recognise_gla": "find GLA written in plain PyTorch (token loops) and make each a GLA site (default True)",
    "report": "a laplace_passes.Report to fill (default: a new one, see last_report())",
    "muon_all_to_all": "rewrite a sharded Muon step's gathers into paired all-to-alls (default True)",
    "gate_checks": "'auto' (default): a GLA site's gates are checked at run time unless the graph shows them "
    "<= 0 by construction (NOTE [gates proven <= 0]); 'always': every site's gates are checked",
    "strict": "raise an exception met inside a laplace pass instead of skipping the pass for that graph "
    "(default: False, or True when the environment sets LAPLACE_PASSES_STRICT=1)",
    "max_graph_instructions": "estimated instructions one compiled graph may hold; a graph over it is "
    "cut into partitions that fit (default: the target's, 5,000,000 on trn2; None: no limit)",
    "share_loop_bodies": "inner inductor on the cpu target: GLA sites of a graph sharing a signature call one "
    "body Inductor compiles once (default True: a faster first call, steps 5 to 12% slower); False inlines "
    "each site's body (NOTE [chunk-loop bodies compiled once])",
}

GATE_CHECKS = ("auto", "always")


@dataclass
class CompileConfig:
    target: HardwareTarget
    inner: InnerCompiler
    chunk_size: int
    retile_gla: bool
    report: Report
    muon_all_to_all: bool = True
    max_graph_instructions: int | None = None
    gate_checks: str = "auto"
    recognise_gla: bool = True
    strict: bool = False
    share_loop_bodies: bool = True
    _decompositions: dict | None = field(default=None, init=False, repr=False)

    def decompositions(self) -> dict | None:
        """The inner compiler's decomposition table (None: AOT Autograd's defaults), built once per compile."""
        if self._decompositions is None:
            self._decompositions = self.inner.decompositions()
        return self._decompositions

    @classmethod
    def from_options(
        cls, options: dict[str, Any] | None, compilers: Mapping[str, InnerCompiler] = TORCH_COMPILERS
    ) -> CompileConfig:
        """Validate `options`; `compilers`: the inner compilers a name in `inner` may name."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTION_DOCS))
        if unknown:
            # The first line is the cause and the likely fix; what each option means follows, one a line.
            known = "".join(f"\n  {name}: {doc}" for name, doc in OPTION_DOCS.items())
            raise ValueError(f"unknown laplace option(s) {unknown}{_did_you_mean(unknown)}; known options:{known}")
        target = get_target(options.get("target", "trn2"))
        inner = resolve_inner(options.get("inner", "eager"), compilers)
        inner.check_available()
        chunk_size = check_chunk_size("chunk_size", options.get("chunk_size", target.chunk_size))
        retile = options.get("retile_gla", True)
        if not isinstance(retile, bool):
            raise TypeError(f"retile_gla must be a bool, got {type(retile).__name__}")
        report = options.get("report")
        report = Report() if report is None else report
        if not isinstance(report, Report):  # a {} or a dict of results would otherwise be dropped silently
            raise TypeError(f"report must be a laplace_passes.Report, got {type(report).__name__}")
        report.target = target.name
        report.inner = inner.name
        muon_all_to_all = options.get("muon_all_to_all", True)
        if not isinstance(muon_all_to_all, bool):
            raise TypeError(f"muon_all_to_all must be a bool, got {type(muon_all_to_all).__name__}")
        budget = _check_budget(options.get("max_graph_instructions", target.max_graph_instructions))
        gate_checks = options.get("gate_checks", "auto")
        if gate_checks not in GATE_CHECKS:
            raise ValueError(f"gate_checks must be one of {GATE_CHECKS}, got {gate_checks!r}")
        recognise = options.get("recognise_gla", True)
        if not isinstance(recognise, bool):
            raise TypeError(f"recognise_gla must be a bool, got {type(recognise).__name__}")
        strict = options.get("strict", strict_mode())
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
        share_loop_bodies = options.get("share_loop_bodies", True)
        if not isinstance(share_loop_bodies, bool):
            raise TypeError(f"share_loop_bodies must be a bool, got {type(share_loop_bodies).__name__}")
        return cls(target, inner, chunk_size, retile, report, muon_all_to_all, max_graph_instructions=budget,
                   gate_checks=gate_checks, recognise_gla=recognise, strict=strict,
                   share_loop_bodies=share_loop_bodies)

    def __repr__(self) -> str:
        # Short: torch puts the backend's repr (a partial holding this config) into its error messages.
        return (f"CompileConfig(target={self.target.name!r}, inner={self.inner.name!r}, chunk_size={self.chunk_size}, "
                f"retile_gla={self.retile_gla}, recognise_gla={self.recognise_gla}, strict={self.strict})")


def _did_you_mean(unknown: list[str]) -> str:
    """` (did you mean chunk_size= for chunksize?)` for the misspellings close to an option."""
    close = [(name, difflib.get_close_matches(name, OPTION_DOCS, n=1)) for name in unknown]
    hints = [f"{match[0]}= for {name}" for name, match in close if match]
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    if "mode" in unknown:  # torch.compile's mode is Inductor's: where its settings go after the laplace passes
        hint += (" (mode is a setting of Inductor's own backend: for Inductor after the laplace passes, "
                 "inner='inductor', with Inductor's settings in torch._inductor.config, e.g. max_autotune = True)")
    return hint


def _check_budget(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"max_graph_instructions must be a positive int or None, got {value!r}")
    return value


def entry_point_options(entry_point: str, options: Mapping[str, Any], **fixed: Any) -> dict[str, Any]:
    """`options` with the values `entry_point` sets itself; one of those passed by the caller is an error.

    inspect, preflight and export_stablehlo choose their own inner compiler:
    a caller's `inner=` would otherwise be dropped without a word.
    """
    clash = sorted(set(options) & set(fixed))
    if clash:
        raise TypeError(f"{entry_point}() chooses {', '.join(clash)} itself; do not pass {', '.join(clash)}=")
    return {**options, **fixed}
