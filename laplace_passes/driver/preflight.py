"""`laplace_passes.preflight`: what neuronx-cc or TorchNeuron will reject, found in seconds on any machine.

    report = laplace_passes.preflight(model, ids, target="trn2")
    print(report)           # one line per finding: the check, graph, node, what is wrong, the fix
    assert report.ok

It captures the graphs as inner="neuron" would hand them over (the
`PreflightCompiler` of `laplace_passes.lowering.preflight`, whose last ATen
pass runs the checks) and gathers the findings of every graph.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

from laplace_passes.driver.compile_fx import capture_graphs
from laplace_passes.driver.config import CompileConfig, entry_point_options
from laplace_passes.infra.report import Report
from laplace_passes.lowering.checks import Finding
from laplace_passes.lowering.neuron import NEURON_ADVICE
from laplace_passes.lowering.preflight import NeuronPreflight, PreflightCompiler


@dataclass
class PreflightReport:
    target: str
    findings: list[Finding]
    graphs: list[str]
    report: Report

    @property
    def ok(self) -> bool:
        return not self.findings

    def by_check(self, check: str) -> list[Finding]:
        return [f for f in self.findings if f.check == check]

    @property
    def dynamic_dims(self) -> list[str]:
        """Input dimensions the examples marked dynamic: each concrete shape is checked (and compiled) on its own."""
        return self.report.dynamic_dims

    def to_dict(self) -> dict:
        return {"target": self.target, "graphs": self.graphs, "findings": [asdict(f) for f in self.findings],
                "dynamic_dims": list(self.dynamic_dims)}

    def __str__(self) -> str:
        head = f"Neuron preflight ({self.target}): {len(self.graphs)} graph(s) checked"
        lines = [f"{head}, no finding"] if self.ok else [f"{head}, {len(self.findings)} finding(s):",
                                                          *(f"  {f}" for f in self.findings)]
        if self.dynamic_dims:
            lines += [f"dynamic dimensions: {'; '.join(self.dynamic_dims)}", f"  {NEURON_ADVICE}"]
        return "\n".join(lines)

    __repr__ = __str__



def preflight(model_or_fn: Callable, *example_inputs: Any, target: Any = "trn2", **options: Any) -> PreflightReport:
    """Check the graphs `model_or_fn(*example_inputs)` would hand to TorchNeuron; nothing is compiled by it.

    Runs once on the examples (the ATen graphs execute eagerly), forward and
    backward when an output requires grad; `options` are the backend's
    (chunk_size, retile_gla, ...).
    """
    options = entry_point_options("preflight", options, target=target, inner=PreflightCompiler())
    report = capture_graphs(model_or_fn, example_inputs, CompileConfig.from_options(options))
    checked = [record for record in report.passes if record.name == NeuronPreflight.name]
    findings = [f for record in checked for f in record.findings]
    return PreflightReport(report.target, findings, [record.graph for record in checked], report)
