"""What every StableHLO file handed to neuronx-cc must satisfy, read back from the file."""

import io
import re


def parsed_ops(path):
    """Each op of `main` as (name, result names, result types, operand names, derived from an i64 input, text).

    Parsed by IREE's MLIR; plain strings come back, so nothing outlives its MLIR context. Names and texts come
    from one AsmState of `main` (the same names and text as `get_name()` and `str(op)`): without it each call
    numbers the whole function again, 21 s instead of 0.2 s for the tiny model's two graphs at T = 256.
    """
    from iree.compiler import ir

    module = ir.Module.parse(path.read_text(), ir.Context())
    (main,) = [op for op in module.body.operations if op.operation.name == "func.func"]
    state = ir.AsmState(main)
    block = main.regions[0].blocks[0]
    from_inputs = {a.get_name(state) for a in block.arguments if "i64" in str(a.type)}
    ops = []
    for op in block.operations:
        operands = [o.get_name(state) for o in op.operands]
        results = [r.get_name(state) for r in op.results]
        derived = any(n in from_inputs for n in operands)
        if derived:
            from_inputs.update(results)
        text = io.StringIO()
        op.operation.print(state, file=text)
        ops.append((op.operation.name, results, [str(r.type) for r in op.results], operands, derived, text.getvalue()))
    return ops


def assert_neuron_clean(path):
    text = path.read_text()
    for forbidden in ("f64", "arith.", "dynamic_iota", "complex", "dense_resource"):
        assert forbidden not in text, f"{path.name}: {forbidden}"
    assert not re.search(r"tensor<[^>]*\?", text), f"{path.name}: a dynamic dimension"
    ops = parsed_ops(path)
    for name, results, types_, _, derived, op in ops:
        assert name.startswith("stablehlo.") or name == "func.return", (path.name, name)
        if not any("i64" in t for t in types_):
            continue
        if name == "stablehlo.constant":  # an i64 constant is fine as an operand of ops on the inputs
            users = [u for u in ops if results[0] in u[3]]
            assert users and all(u[4] for u in users), f"{path.name}: an i64 constant used off the inputs: {op}"
        else:
            assert derived, f"{path.name}: i64 not computed from an i64 input: {op}"
