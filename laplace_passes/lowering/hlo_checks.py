"""The preflight's checks on the StableHLO neuronx-cc receives (the ATen checks are in checks.py).

The ATen graph can look clean and its lowering still not be: torch-mlir adds
f64 scalars, `arith` constants and `dynamic_iota` of its own (see
`clean_stablehlo`, which removes the known ones). These checks read the
final module text, one line per op, and report what neuronx-cc is
documented to reject (AWS Neuron SDK, compiler/error-codes):

    stablehlo-dtype         f64 or complex values: no NeuronCore has either type (data-types.rst;
                            complex: NCC_EVRF004)
    stablehlo-dynamic       a `?` dimension: neuronx-cc compiles static shapes only
    stablehlo-op            an op outside the stablehlo dialect (arith, chlo, tensor, ...)
    stablehlo-custom-call   a custom_call target neuronx-cc does not know (NCC_EHCA005 lists them)
    stablehlo-while         a loop: neuronx-cc wants straight-line code (our unroll passes)
    stablehlo-control-flow  a `case` or `if`: neuronx-cc does not implement control flow
    stablehlo-integer-dot   an integer dot_general: no integer matmul datapath (NCC_EVRF035)
    hbm-estimate            the graph's inputs plus its peak of live intermediates pass the target's
                            HBM per logical core (NCC_EOOM001)

`scan_stablehlo(text)` parses the text once; `check_stablehlo` turns what
it found into `Finding`s naming the graph, the op and the fix.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from laplace_passes.lowering.finding import Finding
from laplace_passes.infra.targets import HardwareTarget

# NCC_EHCA005 / NCC_EVRF015 (compiler/error-codes/EHCA005.rst): the custom_call targets neuronx-cc recognises.
NEURON_CUSTOM_CALLS = frozenset({
    "AwsNeuronErf", "AwsNeuronGelu", "AwsNeuronGeluApprxTanh", "AwsNeuronGeluBackward", "AwsNeuronSilu",
    "AwsNeuronSiluBackward", "AwsNeuronRmsNorm", "AwsNeuronSoftmax", "AwsNeuronSoftmaxBackward",
    "AwsNeuronCollectiveMatmul", "AwsNeuronIntMatmult", "AwsNeuronArgMax", "AwsNeuronArgMin", "AwsNeuronTopK",
    "AwsNeuronDropoutMaskV1", "AwsNeuronCustomNativeKernel", "AwsNeuronCustomOp", "AwsNeuronDevicePrint",
    "ResizeNearest", "ResizeBilinear", "ResizeNearestGrad", "AwsNeuronLNCShardingConstraint",
    "AwsNeuronTransferWithStaticRing", "AwsNeuronModuleMarkerStart-Forward", "AwsNeuronModuleMarkerEnd-Forward",
    "AwsNeuronModuleMarkerStart-Backward", "AwsNeuronModuleMarkerEnd-Backward", "NeuronBoundaryMarker-Start",
    "NeuronBoundaryMarker-End",
})
STRUCTURAL_OPS = frozenset({"func.func", "func.return", "builtin.module", "module"})

_OP_LINE = re.compile(r'^\s*(?P<results>%[\w.#:, %]+?)\s*=\s*"?(?P<op>[a-z_]+\.[\w.]+)"?')
_BARE_OP = re.compile(r'^\s*"?(?P<op>[a-z_]+\.[\w.]+)"?[\s(<{]')
_TENSOR = re.compile(r"tensor<([^<>]*(?:<[^<>]*>[^<>]*)*)>")
_ARGUMENT = re.compile(r"(%arg\d+): (tensor<[^>]*>)")
_VALUE = re.compile(r"%[\w.]+")
_BITS = {"i1": 8, "f64": 64, "i64": 64, "ui64": 64, "complex<f32>": 64, "complex<f64>": 128,
         "f32": 32, "i32": 32, "ui32": 32, "f16": 16, "bf16": 16, "i16": 16, "ui16": 16}


@dataclass
class HloOp:
    line: int
    name: str
    result: str  # its first result (%12), "" for an op without one
    result_types: list[str]
    text: str


@dataclass
class HloScan:
    """What the checks need of one module: its ops in order, argument types, each value's last use."""

    ops: list[HloOp] = field(default_factory=list)
    arguments: dict[str, str] = field(default_factory=dict)
    last_use: dict[str, int] = field(default_factory=dict)


def scan_stablehlo(text: str) -> HloScan:
    scan = HloScan()
    for number, line in enumerate(text.splitlines()):
        if "func.func" in line:
            scan.arguments.update(_ARGUMENT.findall(line))
            continue
        match = _OP_LINE.match(line) or _BARE_OP.match(line)
        if match is not None:
            results = match.groupdict().get("results") or ""
            defined = results.split(":")[0].split("#")[0].strip() if results else ""
            scan.ops.append(HloOp(number, match.group("op"), defined, _result_types(line), line.strip()))
        # Uses: every value named after the op (or on a `return` line), the defined one excluded.
        for used in _VALUE.findall(line[match.end():] if match is not None else line):
            scan.last_use[used] = number
    return scan


def _result_types(line: str) -> list[str]:
    """The tensor types after the last `->` (or the last ` : ` when the op has no arrow)."""
    tail = line.rsplit("->", 1)[1] if "->" in line else line.rsplit(" : ", 1)[-1]
    return ["tensor<" + t + ">" for t in _TENSOR.findall(tail)]


def tensor_bytes(tensor_type: str) -> int:
    """Bytes of `tensor<4x16xf32>`; a dynamic dimension counts as 1 (reported on its own)."""
    body = tensor_type.removeprefix("tensor<").removesuffix(">")
    *dims, element = body.split("x") if not body.startswith("complex") else ["complex" + body[7:]]
    if element.startswith("complex"):
        dims, element = [], element
    sizes = [int(d) if d.isdigit() else 1 for d in dims]
    return math.prod(sizes) * _BITS.get(element, 32) // 8


def peak_memory(scan: HloScan) -> tuple[int, int, HloOp | None]:
    """(argument bytes, peak bytes of live results, the op at the peak), in program order.

    An upper bound of what neuronx-cc allocates: every result is its own
    buffer from its op to its last use (no fusion, no reuse of a reshape's
    operand), and the inputs stay live throughout.
    """
    arguments = sum(tensor_bytes(t) for t in scan.arguments.values())
    live: dict[str, int] = {}
    current = peak = 0
    at_peak = None
    for op in scan.ops:
        if op.result:
            size = sum(tensor_bytes(t) for t in op.result_types)
            live[op.result] = size
            current += size
            if current > peak:
                peak, at_peak = current, op
        for value in [v for v in live if scan.last_use.get(v, -1) <= op.line]:
            current -= live.pop(value)
    return arguments, peak, at_peak


def check_stablehlo(text: str, target: HardwareTarget, graph_name: str = "") -> list[Finding]:
    """Findings on one lowered module (see the module docstring); `graph_name` names it in each."""
    scan = scan_stablehlo(text)
    findings = [Finding(check, op.result or "(no result)", op.name, message, fix, graph_name)
                for op in scan.ops for check, message, fix in _op_problems(op)]
    findings += [Finding("stablehlo-dtype", name, "input", f"input {name} is {t}; " + _DTYPE_WHY, _DTYPE_FIX, graph_name)
                 for name, t in scan.arguments.items() if _bad_element(t)]
    limit = target.hbm_bytes_per_core
    if limit is not None:
        arguments, peak, at_peak = peak_memory(scan)
        if arguments + peak > limit:
            where = at_peak or HloOp(0, "input", "(inputs)", [], "")
            findings.append(Finding(
                "hbm-estimate", where.result, where.name,
                f"inputs of {_size(arguments)} plus a peak of {_size(peak)} of live intermediates (at this op) "
                f"pass {target.name}'s {_size(limit)} of HBM per logical core{_lnc(target)} (neuronx-cc: NCC_EOOM001)",
                "shorter sequences or a smaller batch per graph, fewer layers per graph (a lower "
                "max_graph_instructions cuts the graph into partitions), or activation checkpointing", graph_name))
    return findings


def _lnc(target: HardwareTarget) -> str:
    return "" if target.logical_cores is None else f" at --lnc {target.logical_cores}"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


_DTYPE_WHY = "no NeuronCore has f64 or complex types (Neuron data types; complex: NCC_EVRF004)"
_DTYPE_FIX = ("compute in float32 or bfloat16; if the ATen graph has no f64, torch-mlir made it: report the op "
              "(laplace_passes.lowering.clean_stablehlo folds the known cases)")


def _bad_element(tensor_type: str) -> bool:
    return "f64" in tensor_type or "complex" in tensor_type


def _op_problems(op: HloOp) -> list[tuple[str, str, str]]:
    """(check, message, fix) for each thing wrong with one op."""
    problems = []
    if any(_bad_element(t) for t in op.result_types):
        problems.append(("stablehlo-dtype", f"produces {', '.join(op.result_types)}; {_DTYPE_WHY}", _DTYPE_FIX))
    if any("?" in t for t in op.result_types) or op.name.startswith("stablehlo.dynamic_"):
        problems.append(("stablehlo-dynamic", "a dynamic shape; neuronx-cc compiles static shapes only",
                         "compile with static shapes (dynamic=False, no mark_dynamic); pad lengths to buckets"))
    if not op.name.startswith("stablehlo.") and op.name not in STRUCTURAL_OPS:
        problems.append(("stablehlo-op", "not a StableHLO op; neuronx-cc reads StableHLO only",
                         "rewrite it to StableHLO (see laplace_passes.lowering.clean_stablehlo for arith.constant)"))
    if op.name == "stablehlo.custom_call":
        call = re.search(r'call_target_name = "([^"]+)"', op.text) or re.search(r"@([\w.-]+)", op.text)
        name = call.group(1) if call else "?"
        if name not in NEURON_CUSTOM_CALLS:
            problems.append(("stablehlo-custom-call", f"custom_call target {name!r} is not one neuronx-cc knows "
                             "(NCC_EHCA005)", "decompose the op that lowered to it into standard ATen ops"))
    if op.name == "stablehlo.while":
        problems.append(("stablehlo-while", "a loop; neuronx-cc wants loops unrolled with static trip counts",
                         "unroll it before lowering (laplace's unroll passes, or a Python loop over range(n))"))
    if op.name in ("stablehlo.case", "stablehlo.if"):
        problems.append(("stablehlo-control-flow", "a branch; neuronx-cc does not implement control flow "
                         "(general/arch/neuron-features/control-flow.rst)",
                         "compute both branches and select (stablehlo.select, torch.where in the model)"))
    if op.name == "stablehlo.dot_general" and re.search(r"tensor<[^>]*x(u?i\d+)>", op.text.split(" : ", 1)[-1]):
        problems.append(("stablehlo-integer-dot", "an integer matrix product; the TensorEngine has no integer "
                         "datapath (NCC_EVRF035)", "cast the operands to bfloat16 or float32 before the matmul"))
    return problems
