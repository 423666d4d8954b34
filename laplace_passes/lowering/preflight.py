"""The Neuron preflight: what neuronx-cc or TorchNeuron will reject, found in seconds on any machine.

    report = laplace_passes.preflight(model, ids, target="trn2")
    print(report)           # one line per finding: the check, graph, node, what is wrong, the fix
    assert report.ok

It runs the passes and AOT Autograd as inner="neuron" would (with
torch-mlir's decomposition table standing in for TorchNeuron's, which ships
with torch-neuronx), then checks every ATen graph:

    dynamic-shape          a symbolic size, at the input or the data-dependent op (nonzero,
                           masked_select, ...) it enters by: neuronx-cc compiles static shapes only
    loop                   while_loop / scan / map left in the graph
    control-flow           a cond left in the graph (neuronx-cc implements no control flow)
    f64                    float64 tensors: no f64 on Trainium, TorchNeuron demotes them; `preflight`
                           names float64 parameters and inputs before tracing, and an op refusing
                           float64 while tracing (laplace's GLA) ends it with the finding, no exception
    instruction-budget     estimated instructions over the target's budget (neuronx-cc [XTP002])
                           that the budget pass will not cut into partitions that fit
    all-to-all-splits      unequal (or run-time) input or output split sizes (TorchNeuron's
                           all-to-all: equal splits only)
    collective-group-size  a collective over a group size the target does not support (trn2: 4,
                           8, 16, multiples of 32)
    collective             a collective the StableHLO lowering has no form for
    unlowerable-op         an op torch-mlir cannot lower: the lowering is tried, the op named
    stablehlo-*, hbm-estimate   on the lowered module itself (`hlo_checks`): f64 or complex values,
                           dynamic dimensions, ops outside StableHLO, unknown custom_call targets,
                           while, case and if, integer dot_general, and inputs plus peak live
                           intermediates over the target's HBM per logical core
    internal-error         a check that failed inside: named, the others still run (raised under
                           LAPLACE_PASSES_STRICT=1)

inner="neuron" runs the same checks as its last ATen pass (`NeuronPreflight`),
so the findings are in its report and stop the compile before TorchNeuron
starts.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
import torch.fx
from functorch.compile import make_boxed_func

from laplace_passes.infra.inner import InnerCompiler
from laplace_passes.lowering.checks import Finding, check_graph
from laplace_passes.lowering.stablehlo import torch_mlir_decompositions
from laplace_passes.infra.pass_base import GraphContext, GraphPass, PassResult
from laplace_passes.infra.targets import HardwareTarget

class PreflightError(RuntimeError):
    """The Neuron preflight found problems; raised before the graph reaches TorchNeuron."""

    def __init__(self, findings: list[Finding]) -> None:
        self.findings = list(findings)
        lines = "\n".join(f"  {f}" for f in self.findings)
        super().__init__(
            f"Neuron preflight: {len(self.findings)} finding(s); neuronx-cc or TorchNeuron would reject "
            f"this graph:\n{lines}\n(pass strict_preflight=False to neuron_compiler() to compile anyway)"
        )


class NeuronPreflight(GraphPass):
    """Run the preflight checks; keep the findings in `findings` and the report (graph unchanged).

    NOTE [neuron_preflight: before and after]
    The graph is unchanged. A backward graph that kept a declined GLA site:

        gla_backward = torch.ops.laplace.gla_backward.default(primals_1, ...)

    gets the finding

        [unlowerable-op] backward_0: node gla_backward (laplace.gla_backward.default): torch-mlir
        cannot lower this op (...). Fix: the re-tiling pass declined this GLA site ...

    in the report (this pass's `declined` list and its summary).
    """

    name = "neuron_preflight"

    def __init__(self, target: HardwareTarget, graph_name: str = "", partition_budget: int | None = None) -> None:
        self.findings: list[Finding] = []  # of the graph this pass checked last (`RequireCleanPreflight` reads them)
        self.target = target
        self.graph_name = graph_name  # names the graph in each finding
        self.partition_budget = partition_budget

    @classmethod
    def for_graph(cls, context: GraphContext) -> NeuronPreflight:
        return cls(context.target, graph_name=context.name, partition_budget=context.max_graph_instructions)

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        findings = self.findings = check_graph(gm, self.target, self.graph_name, self.partition_budget)
        if findings:
            counts = ", ".join(f"{check} x{n}" for check, n in Counter(f.check for f in findings).items())
            summary = f"{len(findings)} finding(s) for {self.target.name}: {counts}"
        else:
            summary = "no finding: nothing here that neuronx-cc or TorchNeuron is known to reject"
        return PassResult(gm, modified=False, summary=summary, declined=[str(f) for f in findings], findings=findings)


class RequireCleanPreflight(GraphPass):
    """Stop the compile (PreflightError) when the `NeuronPreflight` run before it found anything.

    NOTE [require_clean_preflight: before and after]
    The graph is unchanged; it reaches TorchNeuron only when the preflight
    found nothing. A separate pass, so that the preflight's findings are in
    the report before the compile stops: it is made with the preflight pass
    it follows and reads that pass's findings.
    """

    name = "require_clean_preflight"
    stops_compile_on_error = True  # NOTE [a failing pass declines]: the failure is the answer asked for

    def __init__(self, preflight: NeuronPreflight) -> None:
        self.preflight = preflight

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        if self.preflight.findings:
            raise PreflightError(self.preflight.findings)
        return PassResult(gm, modified=False, summary="preflight clean: the graph goes to TorchNeuron")


class PreflightCompiler(InnerCompiler):
    """The preflight's inner compiler: the graphs run eagerly, only the passes' findings matter.

    Its graphs are those inner="neuron" would hand over: torch-mlir's
    decomposition table stands in for TorchNeuron's (which ships with
    torch-neuronx), the same lowering passes, then the checks.
    """

    name = "neuron-preflight"
    static_shapes = True  # the graphs inner="neuron" would receive
    for_neuron = True
    legalizes = True
    preflight = "report"
    keep_inference_input_mutations = True  # the graphs inner="neuron" gets (see lowering/neuron.py)

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
        return make_boxed_func(gm.forward)

    def decompositions(self) -> dict:
        return torch_mlir_decompositions()


__all__ = ["Finding", "NeuronPreflight", "PreflightCompiler", "PreflightError", "RequireCleanPreflight", "check_graph"]
