"""What torch-mlir's StableHLO needs before neuronx-cc may read it: no f64, no `arith`, no `dynamic_iota`,
and low-precision matmuls that say they accumulate in f32.

torch-mlir 20261001 writes things neuronx-cc does not accept into graphs
whose shapes are all static (sources: torch-mlir's
lib/Conversion/TorchToStablehlo, https://github.com/llvm/torch-mlir):

* a Python scalar argument (`mul(x, 0.25)`, `clamp(x, min=-30.0)`) becomes
  `arith.constant dense<...> : tensor<1xf64>` then a `stablehlo.convert`
  (`hlo::scalarToStablehloTensor`): f64, and an op outside StableHLO;
* `arange` computes its length as ceil((end - start) / step) in f64 and
  feeds `stablehlo.dynamic_iota`, even for a static result (Basic.cpp,
  `ConvertAtenOp<AtenArangeStartStepOp>`);
* integer floor division converts both sides to f64, divides, floors and
  converts back (Basic.cpp, `defaultIntToFloatType = f64`).

Neuron has no FP64 type on any NeuronCore (AWS Neuron SDK, "Neuron data
types", about-neuron/arch/neuron-features/data-types.rst). TorchNeuron
itself retypes every f64 to f32 after lowering (its `dtype_conversion_pass`);
we instead fold the f64 away where it is only constants and index
arithmetic, so a real f64 computation is left for the preflight to report
rather than silently demoted.

`clean_module(module)` rewrites the module in place, in this order:

    arith.constant                          -> stablehlo.constant (same type and value)
    stablehlo-aggressive-simplification     StableHLO's own pass: folds the f64 arange length,
                                            dynamic_iota with a static result -> iota
    convert_iN(floor(convert_f64(x) / c))   -> x / c - (remainder(x, c) < 0), in iN (c > 0 constant)
    convert_f(select(p, c1 : iN, c2 : iN))  -> select(p, c1 : f, c2 : f): decompositions pick integer
                                            constants (a sign, 1 or 0) by a predicate and then convert
    dot_general : bf16 / f16                -> convert(dot_general : f32): accumulate in f32, as PyTorch
                                            and the TensorEngine do, whatever the consumer's default
    reduce(add) : bf16 / f16                -> convert(reduce(add) of f32): PyTorch's sums do the same
    reshape / convert of an f64 constant    -> a constant of the result type (numpy's cast rounds to
                                            nearest even, as stablehlo.convert does at run time; a
                                            bf16 one when the constant is one value, rounded by torch)
    stablehlo-aggressive-simplification, canonicalize, cse

`DenseLiterals` is the importer hook that writes tensor literals inline
(`dense<...>`) instead of as `dense_resource` blobs, which XLA's HLO
conversion does not read (TorchNeuron's importer overrides the same hook,
torch_neuronx/neuron_dynamo_backend/fx/fx_hooks.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

SIMPLIFY = "builtin.module(func.func(stablehlo-aggressive-simplification),canonicalize,cse)"
# numpy types for folding an f64 constant into a float type (bf16 has none: its scalars are rounded by torch).
FLOAT_NUMPY = {"f16": np.float16, "f32": np.float32, "f64": np.float64}


def clean_module(module) -> dict[str, int]:
    """Rewrite `module` (a torch_mlir.ir.Module of StableHLO) in place; how many of each rewrite ran."""
    counts = {"arith_constants": _arith_constants_to_stablehlo(module)}
    _simplify(module)
    counts["integer_floor_divisions"] = _integer_floor_divisions(module)
    counts["f64_constant_reshapes"] = _fold_f64_constants(module, "stablehlo.reshape")
    counts["f64_constant_converts"] = _fold_f64_constants(module, "stablehlo.convert")
    counts["converted_selects"] = _convert_selects_of_constants(module)
    counts["f32_accumulating_dots"] = _accumulate_dots_in_f32(module)
    counts["f32_accumulating_sums"] = _accumulate_sums_in_f32(module)
    _simplify(module)
    return counts


def _simplify(module) -> None:
    import torch_mlir.dialects.torch  # noqa: F401  registers torch-mlir's passes, StableHLO's among them
    from torch_mlir.passmanager import PassManager

    with module.context:
        PassManager.parse(SIMPLIFY).run(module.operation)


def _ops_named(module, name: str, accept: Callable = lambda op: True) -> list:
    """Every op called `name` in `module`, nested regions included, that `accept` takes."""
    return walk_ops(module, lambda op: op.name == name and accept(op))


def walk_ops(module, accept: Callable) -> list:
    """Every op of `module`, nested regions included, that `accept` takes, in the order they appear.

    MLIR's own walk (pre-order: an op before the ops of its regions), not one in Python over regions,
    blocks and ops: an export walks its modules a dozen times.
    """
    from torch_mlir import ir

    found = []

    def visit(op):
        found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return [op for op in found[1:] if accept(op)]  # found[0]: the module itself


def _owner_name(value) -> str | None:
    owner = value.owner
    owner = getattr(owner, "operation", owner)
    return getattr(owner, "name", None)


def _owner(value):
    owner = value.owner
    return getattr(owner, "operation", owner)


def _element_type(value) -> str:
    from torch_mlir import ir

    return str(ir.RankedTensorType(value.type).element_type)


def _replace(op, name: str, result_type, operands=(), **attributes):
    """Create `name` before `op`, make its result replace `op`'s, erase `op`."""
    from torch_mlir import ir

    with ir.InsertionPoint(op), op.location:
        new = ir.Operation.create(name, results=[result_type], operands=list(operands), attributes=attributes)
    op.results[0].replace_all_uses_with(new.results[0])
    op.erase()
    return new


def _arith_constants_to_stablehlo(module) -> int:
    from torch_mlir import ir

    found = _ops_named(module, "arith.constant")
    with module.context, ir.Location.unknown():
        for op in found:
            _replace(op, "stablehlo.constant", op.results[0].type, value=op.attributes["value"])
    return len(found)


def _fold_f64_constants(module, name: str) -> int:
    """`name` (reshape or convert) of an f64 (or integer, converted to float) constant -> one constant."""
    from torch_mlir import ir

    def foldable(op) -> bool:
        # f64 constants, and the integer scalars of Python ints (`x * 2`) converted to floats.
        source = op.operands[0]
        element, result = _element_type(source), _element_type(op.results[0])
        floats = (*FLOAT_NUMPY, "bf16") if _is_splat(source) else tuple(FLOAT_NUMPY)
        return (_owner_name(source) == "stablehlo.constant"
                and (element == "f64" or (element.startswith("i") and result in floats))
                and (result in floats or result.startswith("i")))

    found = _ops_named(module, name, foldable)
    with module.context, ir.Location.unknown():
        for op in found:
            target = ir.RankedTensorType(op.results[0].type)
            values = np.array(ir.DenseElementsAttr(_owner(op.operands[0]).attributes["value"]))
            element = str(target.element_type)
            if element == "bf16":  # numpy has no bf16: one value (a scalar of the model), rounded as convert does
                _replace(op, "stablehlo.constant", target, value=ir.DenseElementsAttr.get_splat(
                    target, ir.FloatAttr.get(target.element_type, _to_bfloat16(float(values.reshape(-1)[0])))))
                continue
            values = values.astype(FLOAT_NUMPY[element]) if element in FLOAT_NUMPY else _to_integer(values, element)
            _replace(op, "stablehlo.constant", target, value=_dense(values, target))
    return len(found)


def _is_splat(value) -> bool:
    from torch_mlir import ir

    owner = _owner(value)
    if getattr(owner, "name", None) != "stablehlo.constant":
        return False
    return ir.DenseElementsAttr(owner.attributes["value"]).is_splat


def _to_bfloat16(value: float) -> float:
    """`value` rounded to the nearest bfloat16 (ties to even), as stablehlo.convert rounds."""
    import torch

    return torch.tensor(value, dtype=torch.float64).to(torch.bfloat16).item()


def _dense(values: np.ndarray, target):
    """`values` as a DenseElementsAttr of type `target`; a splat when all are equal (a 0-d array would come out 1-d)."""
    from torch_mlir import ir

    element = target.element_type
    flat = values.reshape(-1)
    if flat.size == 1 or (flat.size and (flat == flat[0]).all()):
        scalar = flat[0]
        value = ir.IntegerAttr.get(element, int(scalar)) if values.dtype.kind in "iu" else ir.FloatAttr.get(element, float(scalar))
        return ir.DenseElementsAttr.get_splat(target, value)
    return ir.DenseElementsAttr.get(np.ascontiguousarray(values.reshape(target.shape)), type=element)


def _convert_selects_of_constants(module) -> int:
    """convert_f(select(p, a, b)) with a, b integer constants -> select(p, a', b') with a', b' float constants."""
    from torch_mlir import ir

    def integer_constant(value) -> bool:
        return _owner_name(value) == "stablehlo.constant" and _element_type(value).startswith("i")

    def foldable(op) -> bool:
        select = _owner(op.operands[0])
        return (_element_type(op.results[0]) in FLOAT_NUMPY and getattr(select, "name", None) == "stablehlo.select"
                and all(integer_constant(v) for v in list(select.operands)[1:]))

    found = _ops_named(module, "stablehlo.convert", foldable)
    with module.context, ir.Location.unknown():
        for op in found:
            target = ir.RankedTensorType(op.results[0].type)
            select = _owner(op.operands[0])
            constants = []
            for value in list(select.operands)[1:]:
                array = np.array(ir.DenseElementsAttr(_owner(value).attributes["value"]))
                kind = ir.RankedTensorType.get(ir.RankedTensorType(value.type).shape, target.element_type)
                with ir.InsertionPoint(op), op.location:
                    constants.append(ir.Operation.create("stablehlo.constant", results=[kind], attributes={
                        "value": _dense(array.astype(FLOAT_NUMPY[str(target.element_type)]), kind)}).results[0])
            _replace(op, "stablehlo.select", target, [select.operands[0], *constants])
    return len(found)


def _accumulate_dots_in_f32(module) -> int:
    """dot_general(a, b) : bf16 or f16 -> convert(dot_general(a, b) : f32): the sum in f32, rounded once.

    torch-mlir types a bf16 matmul's result bf16, which leaves the accumulation type to the consumer:
    XLA's CPU backend then sums in bf16 (a 5-step bf16 Newton-Schulz came out 0.19 relative RMSE from
    f32, against torch's 0.03). PyTorch sums bf16 and f16 products in f32 and rounds the result, and
    so does the TensorEngine (its PSUM accumulates in fp32); an f32 result type says so in the IR.
    """
    from torch_mlir import ir

    found = _ops_named(module, "stablehlo.dot_general", lambda op: _element_type(op.results[0]) in ("bf16", "f16"))
    with module.context, ir.Location.unknown():
        for op in found:
            low = ir.RankedTensorType(op.results[0].type)
            wide = ir.RankedTensorType.get(low.shape, ir.F32Type.get())
            attributes = {name: op.attributes[name] for name in op.attributes}
            with ir.InsertionPoint(op), op.location:
                summed = ir.Operation.create("stablehlo.dot_general", results=[wide], operands=list(op.operands),
                                             attributes=attributes)
            _replace(op, "stablehlo.convert", low, [summed.results[0]])
    return len(found)


def _accumulate_sums_in_f32(module) -> int:
    """reduce(x : bf16 or f16, add) -> convert(reduce(convert(x) : f32, add)): PyTorch's sums of bf16 and f16
    accumulate in f32 (a norm of 2,048 bf16 squares summed in bf16 is off by percents)."""
    from torch_mlir import ir

    def low_precision_sum(op) -> bool:
        body = [o.operation.name for o in op.regions[0].blocks[0].operations]
        return (len(op.operands) == 2 and body == ["stablehlo.add", "stablehlo.return"]
                and _element_type(op.results[0]) in ("bf16", "f16"))

    found = _ops_named(module, "stablehlo.reduce", low_precision_sum)
    with module.context, ir.Location.unknown():
        f32 = ir.F32Type.get()
        for op in found:
            low = ir.RankedTensorType(op.results[0].type)
            with ir.InsertionPoint(op), op.location:
                operands = [
                    ir.Operation.create("stablehlo.convert", operands=[value], results=[
                        ir.RankedTensorType.get(ir.RankedTensorType(value.type).shape, f32)]).results[0]
                    for value in op.operands
                ]
                summed = ir.Operation.create("stablehlo.reduce", results=[ir.RankedTensorType.get(low.shape, f32)],
                                             operands=operands, attributes={"dimensions": op.attributes["dimensions"]},
                                             regions=1)
                scalar = ir.RankedTensorType.get([], f32)
                block = summed.regions[0].blocks.append(scalar, scalar)
                with ir.InsertionPoint(block):
                    added = ir.Operation.create("stablehlo.add", results=[scalar], operands=list(block.arguments))
                    ir.Operation.create("stablehlo.return", operands=[added.results[0]])
            _replace(op, "stablehlo.convert", low, [summed.results[0]])
    return len(found)


def _to_integer(values: np.ndarray, element: str) -> np.ndarray:
    """f64 -> iN as stablehlo.convert does it: truncation toward zero."""
    bits = int(element.removeprefix("ui").removeprefix("i"))
    kind = "uint" if element.startswith("ui") else "int"
    return np.trunc(values).astype(f"{kind}{bits}")


def _positive_integer_constant(value) -> int | None:
    """c when `value` is (a broadcast of) convert(constant c : iN -> f64) with one element, c > 0."""
    owner = _owner(value)
    if getattr(owner, "name", None) == "stablehlo.broadcast_in_dim":
        owner = _owner(owner.operands[0])
    if getattr(owner, "name", None) != "stablehlo.convert" or not _element_type(owner.operands[0]).startswith("i"):
        return None
    if _owner_name(owner.operands[0]) != "stablehlo.constant":
        return None
    from torch_mlir import ir

    values = np.array(ir.DenseElementsAttr(_owner(owner.operands[0]).attributes["value"])).reshape(-1)
    return int(values[0]) if values.size == 1 and values[0] > 0 else None


def _floor_division_parts(op):
    """(x, c) when `op` is convert_iN(floor(divide(convert_f64(x : iN), c))), c a positive constant."""
    floor = _owner(op.operands[0])
    if getattr(floor, "name", None) != "stablehlo.floor" or _owner_name(floor.operands[0]) != "stablehlo.divide":
        return None
    divide = _owner(floor.operands[0])
    if _owner_name(divide.operands[0]) != "stablehlo.convert":
        return None
    x = _owner(divide.operands[0]).operands[0]
    c = _positive_integer_constant(divide.operands[1])
    return (x, c) if c is not None and str(x.type) == str(op.results[0].type) else None


def _integer_floor_divisions(module) -> int:
    """floor(x / c) in f64 -> q - (r < 0) with q, r the truncating quotient and remainder in x's type.

    stablehlo.divide and stablehlo.remainder on integers truncate (the
    remainder takes the dividend's sign), so for c > 0 the floor is q, minus
    one where r < 0.
    """
    from torch_mlir import ir

    found = [(op, parts) for op in _ops_named(module, "stablehlo.convert", lambda op: _element_type(op.results[0]).startswith("i"))
             if (parts := _floor_division_parts(op)) is not None]
    with module.context, ir.Location.unknown():
        for op, (x, c) in found:
            t = ir.RankedTensorType(x.type)
            flags = ir.RankedTensorType.get(t.shape, ir.IntegerType.get_signless(1), loc=op.location)

            def create(name, operands=(), result=t, **attributes):
                return ir.Operation.create(name, results=[result], operands=list(operands), attributes=attributes).results[0]

            def splat(v):
                return ir.DenseElementsAttr.get_splat(t, ir.IntegerAttr.get(t.element_type, v))

            with ir.InsertionPoint(op), op.location:
                divisor, zero, one = (create("stablehlo.constant", value=splat(v)) for v in (c, 0, 1))
                quotient = create("stablehlo.divide", [x, divisor])
                remainder = create("stablehlo.remainder", [x, divisor])
                negative = create("stablehlo.compare", [remainder, zero], result=flags,
                                  comparison_direction=ir.Attribute.parse("#stablehlo<comparison_direction LT>"))
                floor = create("stablehlo.subtract", [quotient, create("stablehlo.select", [negative, one, zero])])
            op.results[0].replace_all_uses_with(floor)
            op.erase()
    return len(found)


def dense_literal_hooks():
    """An FxImporterHooks writing tensor literals as inline DenseElementsAttr (see the module docstring)."""
    from torch_mlir import ir
    from torch_mlir.extras.fx_importer import TORCH_DTYPE_TO_MLIR_TYPE, FxImporterHooks

    class DenseLiterals(FxImporterHooks):
        def resolve_literal(self, gni, literal, info):
            import torch

            if not isinstance(literal, torch.Tensor) or literal.dtype not in TORCH_DTYPE_TO_MLIR_TYPE \
                    or literal.dtype == torch.bfloat16 or literal.numel() <= 1:
                return None  # the importer's default path: one element is a splat dense<...> already
            array = np.ascontiguousarray(literal.detach().cpu().numpy())
            element = TORCH_DTYPE_TO_MLIR_TYPE[literal.dtype]()
            attr = ir.DenseElementsAttr.get(array, type=element, shape=list(array.shape))
            result = gni._cc.tensor_to_vtensor_type(literal)
            return ir.Operation.create("torch.vtensor.literal", results=[result], attributes={"value": attr}).result

    return DenseLiterals()
