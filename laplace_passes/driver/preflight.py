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
from laplace_passes.infra.report import PassRecord, Report
from laplace_passes.lowering.checks import Finding, check_float64_entries, float64_refusal
from laplace_passes.lowering.neuron import NEURON_ADVICE
from laplace_passes.lowering.preflight import NeuronPreflight, PreflightCompiler


@dataclass
class PreflightReport:
    target: str
    findings: list[Finding]
    graphs: list[str]
    report: Report
    not_checked: str = ""  # why the graphs were not captured (a float64 model an op refused), else ""

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
                "dynamic_dims": list(self.dynamic_dims), "not_checked": self.not_checked}

    def __str__(self) -> str:
        head = f"Neuron preflight ({self.target}): {len(self.graphs)} graph(s) checked"
        lines = [f"{head}, no finding"] if self.ok else [f"{head}, {len(self.findings)} finding(s):",
                                                          *(f"  {f}" for f in self.findings)]
        if self.dynamic_dims:
            lines += [f"dynamic dimensions: {'; '.join(self.dynamic_dims)}", f"  {NEURON_ADVICE}"]
        if self.not_checked:
            lines.append(self.not_checked)
        return "\n".join(lines)

    __repr__ = __str__



def preflight(model_or_fn: Callable, *example_inputs: Any, target: Any = "trn2", **options: Any) -> PreflightReport:
    """Check the graphs `model_or_fn(*example_inputs)` would hand to TorchNeuron; nothing is compiled by it.

    Runs once on the examples (the ATen graphs execute eagerly), forward and
    backward when an output requires grad; `options` are the backend's
    (chunk_size, retile_gla, ...).
    """
    options = entry_point_options("preflight", options, target=target, inner=PreflightCompiler())
    config = CompileConfig.from_options(options)
    f64_entries = check_float64_entries(model_or_fn, example_inputs)
    try:
        report = capture_graphs(model_or_fn, example_inputs, config)
    except Exception as error:
        refusal = float64_refusal(error)
        if not f64_entries and refusal is None:
            raise
        return PreflightReport(config.report.target, f64_entries or [refusal], [], config.report,
                               not_checked=_not_captured(error))
    checked = preflight_records(report)
    findings = [f for record in checked for f in record.findings] + graph_break_findings(report)
    if f64_entries:  # they name the parameters and inputs the graphs' f64 placeholders stand for
        findings = [f for f in findings if not (f.check == "f64" and f.op == "input")]
    return PreflightReport(report.target, f64_entries + findings, [record.graph for record in checked], report)


def graph_break_findings(report: Report) -> list[Finding]:
    """One finding per kind of graph break: TorchNeuron gets each graph alone, and the code between them runs
    on the host at every call (a branch on a device value waits for it to come back)."""
    return [Finding("graph-break", "(between graphs)", "graph break", f"Dynamo split the function here: {reason}",
                    "make the code between the graphs traceable: a branch computed both ways and chosen with "
                    "torch.where, ops whose output shape does not depend on values (a mask instead of nonzero); "
                    "inspect() lists every graph")
            for reason in report.graph_breaks]


def preflight_records(report: Report) -> list[PassRecord]:
    """The Neuron preflight pass's records in `report`, one per graph it checked, each with its findings."""
    return [record for record in report.passes if record.name == NeuronPreflight.name]


def _not_captured(error: Exception) -> str:
    """float64 stopped the capture (an op refuses it): the graphs' checks wait for the cast model."""
    cause = str(error).splitlines()[0] if str(error) else ""
    return (f"graphs not checked: tracing stopped at {type(error).__name__}: {cause}; cast the model and "
            "inputs to float32/bfloat16 and run preflight again for the graphs' checks")
