"""torch's functional collectives as StableHLO collectives: a legalisation torch-mlir does not have.

torch-mlir (20261001) imports `torch.ops._c10d_functional.*` as opaque
`torch.operator` ops and its torch-backend pipeline refuses them. We rewrite
them in the raw torch-dialect module, before any torch-mlir pipeline runs:

    %r = torch.operator "torch._c10d_functional.X"(%x, ...)
 -> %b = torch_c.to_builtin_tensor %x
    %c = stablehlo.<collective> %b {replica_groups = ...}   (a combiner region for reductions)
    %r = torch_c.from_builtin_tensor %c

then torch-mlir's own pipelines finish the lowering; the StableHLO ops pass
through them and the casts fold away.

    all_to_all_single(x, out, in, g)    all_to_all split_dimension 0, concat_dimension 0, split_count W
                                        (equal splits only: W pieces of dim 0 / W each way)
    all_gather_into_tensor(x, W, g)     all_gather all_gather_dim 0
    reduce_scatter_tensor(x, op, W, g)  reduce_scatter scatter_dimension 0, combiner op
    all_reduce(x, op, g)                all_reduce, combiner op
    wait_tensor(x)                      x
    op: sum -> add, max -> maximum, min -> minimum, product -> multiply, avg -> add then / W (floats)

Replica groups come from the process group the collective names (its ranks,
and the same partition of the world for its sibling groups), or, with no
process group in this process, from the sizes in the graph (one group of
all W replicas). No rank is written into the module: it is the same program
on every rank, which is what an SPMD compile of W replicas takes. The
module is a cross-replica program (no channel handles), the form XLA runs
with num_replicas = W.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import is_collective, resolve_process_group
from laplace_passes.lowering.clean_stablehlo import walk_ops

PREFIXES = ("torch._c10d_functional.", "torch._c10d_functional_autograd.")
LOWERED = ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "wait_tensor")
COMBINERS = {"sum": "stablehlo.add", "avg": "stablehlo.add", "max": "stablehlo.maximum",
             "min": "stablehlo.minimum", "product": "stablehlo.multiply"}
# Loads the torch_c dialect into a context: it comes with its passes, not with `torch.register_dialect`.
LOAD_TORCH_C = "builtin.module(torch-func-backend-type-conversion)"
TORCH_BACKEND = ("builtin.module(func.func(torch-match-quantized-custom-ops), "
                 "torchdynamo-export-to-torch-backend-pipeline{ extra-library=})")

ReplicaGroups = list[list[int]]


class CollectiveLoweringError(ValueError):
    """A collective this legalisation has no StableHLO form for; the message says which and why."""


def has_collectives(gm: torch.fx.GraphModule) -> bool:
    return any(is_collective(node) for node in gm.graph.nodes)


def replica_groups(group_name: str, group_size: int | None) -> ReplicaGroups:
    """The replica groups of the process group `group_name`: it and its siblings, partitioning the world.

    Without a process group (an export outside a distributed job), one group of `group_size` replicas.
    """
    import torch.distributed as dist

    process_group = resolve_process_group(group_name)
    if process_group is None:
        if group_size is None:
            raise CollectiveLoweringError(
                f"the collective's group {group_name!r} is not a process group of this process and the graph does "
                "not give its size: lower it inside the distributed job that traced it")
        return [list(range(group_size))]
    ranks = dist.get_process_group_ranks(process_group)
    world = dist.get_world_size()
    size = len(ranks)
    aligned = ranks == list(range(ranks[0], ranks[0] + size)) and ranks[0] % size == 0 and world % size == 0
    if not aligned:
        raise CollectiveLoweringError(
            f"process group {group_name!r} holds ranks {ranks}: StableHLO replica groups must partition the world, "
            "and only contiguous groups of one size (dist.new_subgroups) are known here")
    return [list(range(start, start + size)) for start in range(0, world, size)]


def import_with_collectives(gm: torch.fx.GraphModule, context, hooks):
    """`gm` (with functional collectives) -> a StableHLO module, function `main`, through torch-mlir."""
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo
    from torch_mlir.compiler_utils import OutputType, lower_mlir_module, run_pipeline_with_repro_report
    from torch_mlir.extras.fx_importer import FxImporter
    from torch_mlir.passmanager import PassManager

    _stablehlo.register_dialect(context)
    with context:
        PassManager.parse(LOAD_TORCH_C).run(ir.Module.create(ir.Location.unknown()).operation)
    importer = FxImporter(context=context, hooks=hooks)
    importer.import_stateless_graph(gm.graph, func_name="main")
    module = importer.module
    legalize_collectives(module, replica_groups)
    run_pipeline_with_repro_report(module, TORCH_BACKEND, "Lowering TorchFX IR -> Torch Backend IR")
    return lower_mlir_module(False, OutputType.STABLEHLO, module)


def legalize_collectives(module, groups_of: Callable[[str, int | None], ReplicaGroups]) -> dict[str, int]:
    """Rewrite every functional collective of a raw torch-dialect module in place; how many of each."""
    from torch_mlir import ir

    counts: dict[str, int] = {}
    with module.context, ir.Location.unknown():
        for op in _collective_ops(module):
            kind = _operator_name(op).split(".", 2)[2]
            if kind not in LOWERED:
                raise CollectiveLoweringError(
                    f"torch.ops._c10d_functional.{kind} has no StableHLO form here (lowered: {', '.join(LOWERED)})")
            if kind == "wait_tensor":
                op.results[0].replace_all_uses_with(op.operands[0])
            else:
                _LOWER[kind](op, groups_of)
            op.erase()
            counts[kind] = counts.get(kind, 0) + 1
        _erase_dead_constants(module)
    return counts


# -- one rewrite per collective ------------------------------------------------------------------------


def _all_to_all_single(op, groups_of) -> None:
    x, output_splits, input_splits, group = op.operands
    outs = _constant_ints(output_splits, "all_to_all_single output_split_sizes")
    ins = _constant_ints(input_splits, "all_to_all_single input_split_sizes")
    groups = groups_of(_constant_str(group, "the group name"), len(ins))
    size = len(groups[0])
    source = _builtin_type(x.type)
    rows = source.shape[0] if source.rank else 0
    equal = [rows // size] * size
    if not source.rank or rows % size or ins != equal or outs != equal:
        raise CollectiveLoweringError(
            f"all_to_all_single with splits in {ins}, out {outs} over {size} ranks (dim 0 = {rows}): StableHLO's "
            f"all_to_all sends equal pieces, {equal} both ways")
    _replace(op, "stablehlo.all_to_all", groups, split_dimension=0, concat_dimension=0, split_count=size)


def _all_gather_into_tensor(op, groups_of) -> None:
    x, group_size, group = op.operands
    groups = _checked_groups(groups_of, group, _constant_int(group_size, "all_gather_into_tensor group_size"))
    if not _builtin_type(x.type).rank:
        raise CollectiveLoweringError("all_gather_into_tensor of a 0-d tensor")
    _replace(op, "stablehlo.all_gather", groups, all_gather_dim=0)


def _reduce_scatter_tensor(op, groups_of) -> None:
    x, reduce_op, group_size, group = op.operands
    groups = _checked_groups(groups_of, group, _constant_int(group_size, "reduce_scatter_tensor group_size"))
    _replace(op, "stablehlo.reduce_scatter", groups, combiner=_constant_str(reduce_op, "the reduce op"),
             scatter_dimension=0)


def _all_reduce(op, groups_of) -> None:
    x, reduce_op, group = op.operands
    groups = groups_of(_constant_str(group, "the group name"), None)
    _replace(op, "stablehlo.all_reduce", groups, combiner=_constant_str(reduce_op, "the reduce op"))


_LOWER = {
    "all_to_all_single": _all_to_all_single,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "all_reduce": _all_reduce,
}


def _checked_groups(groups_of, group, stated: int) -> ReplicaGroups:
    groups = groups_of(_constant_str(group, "the group name"), stated)
    if len(groups[0]) != stated:
        raise CollectiveLoweringError(f"the graph says {stated} ranks, its process group has {len(groups[0])}")
    return groups


def _replace(op, name: str, groups: ReplicaGroups, combiner: str | None = None, **dimensions: int) -> None:
    """op := from_builtin(name(to_builtin(op's tensor))), with a combiner region for reductions."""
    from torch_mlir import ir

    with ir.InsertionPoint(op), op.location:
        operand = ir.Operation.create("torch_c.to_builtin_tensor", results=[_builtin_type(op.operands[0].type)],
                                      operands=[op.operands[0]]).results[0]
        element = ir.RankedTensorType(operand.type).element_type
        attributes = {"replica_groups": _groups_attribute(groups), **{k: _i64(v) for k, v in dimensions.items()}}
        new = ir.Operation.create(name, results=[_builtin_type(op.results[0].type)], operands=[operand],
                                  attributes=attributes, regions=1 if combiner else 0)
        result = new.results[0]
        if combiner is not None:
            _combiner_region(new, element, combiner)
            if combiner == "avg":
                result = _divided(result, len(groups[0]))
        back = ir.Operation.create("torch_c.from_builtin_tensor", results=[op.results[0].type], operands=[result])
        op.results[0].replace_all_uses_with(back.results[0])


def _combiner_region(new_op, element, combiner: str) -> None:
    from torch_mlir import ir

    if combiner not in COMBINERS:
        raise CollectiveLoweringError(f"reduce op {combiner!r} (lowered: {', '.join(COMBINERS)})")
    if combiner == "avg" and str(element) not in ("f16", "bf16", "f32", "f64"):
        raise CollectiveLoweringError(f"an 'avg' reduction of {element} values (floating point only)")
    scalar = ir.RankedTensorType.get([], element)
    block = new_op.regions[0].blocks.append(scalar, scalar)
    with ir.InsertionPoint(block):
        combined = ir.Operation.create(COMBINERS[combiner], results=[scalar], operands=list(block.arguments))
        ir.Operation.create("stablehlo.return", operands=[combined.results[0]])


def _divided(value, count: int):
    from torch_mlir import ir

    tensor_type = ir.RankedTensorType(value.type)
    splat = ir.DenseElementsAttr.get_splat(tensor_type, ir.FloatAttr.get(tensor_type.element_type, float(count)))
    divisor = ir.Operation.create("stablehlo.constant", results=[tensor_type], attributes={"value": splat})
    return ir.Operation.create("stablehlo.divide", results=[tensor_type], operands=[value, divisor.results[0]]).results[0]


# -- reading the raw module ------------------------------------------------------------------------------


def _operator_name(op) -> str:
    from torch_mlir import ir

    return ir.StringAttr(op.attributes["name"]).value


def _collective_ops(module) -> list:
    return walk_ops(module, lambda op: op.name == "torch.operator" and _operator_name(op).startswith(PREFIXES))


def _erase_dead_constants(module) -> None:
    """The constants and lists that fed only the rewritten collectives."""
    names = {"torch.constant.int", "torch.constant.str", "torch.prim.ListConstruct", "torch.constant.none"}
    while True:
        dead = [op for op in walk_ops(module, lambda op: op.name in names) if all(not list(r.uses) for r in op.results)]
        if not dead:
            return
        for op in dead:
            op.erase()


def _defining(value):
    owner = value.owner
    return getattr(owner, "operation", owner)


def _constant(value, name: str, what: str):
    op = _defining(value)
    if getattr(op, "name", None) != name:
        raise CollectiveLoweringError(f"{what} must be a constant, got {getattr(op, 'name', value)}")
    return op


def _constant_int(value, what: str) -> int:
    from torch_mlir import ir

    return ir.IntegerAttr(_constant(value, "torch.constant.int", what).attributes["value"]).value


def _constant_str(value, what: str) -> str:
    from torch_mlir import ir

    return ir.StringAttr(_constant(value, "torch.constant.str", what).attributes["value"]).value


def _constant_ints(value, what: str) -> list[int]:
    return [_constant_int(v, what) for v in _constant(value, "torch.prim.ListConstruct", what).operands]


_VTENSOR = re.compile(r"^!torch\.vtensor<\[([^\]]*)\],([A-Za-z0-9_]+)>$")


def _builtin_type(torch_type):
    """!torch.vtensor<[8,3],si64> -> tensor<8x3xi64>: what torch-mlir's type conversion makes of it."""
    from torch_mlir import ir

    match = _VTENSOR.match(str(torch_type))
    if not match:
        raise CollectiveLoweringError(f"a collective of a value of type {torch_type}")
    dims, dtype = match.groups()
    shape = [int(d) for d in dims.split(",")] if dims else []
    if any(d < 0 for d in shape):
        raise CollectiveLoweringError(f"a collective of a tensor of dynamic shape {torch_type}")
    # Signed integers become signless (si64 -> i64); ui8 stays ui8 (torch-mlir's conversion keeps it).
    return ir.RankedTensorType.get(shape, ir.Type.parse(re.sub(r"^si(\d+)$", r"i\1", dtype)))


def _groups_attribute(groups: ReplicaGroups):
    from torch_mlir import ir

    rows = ", ".join("[" + ", ".join(map(str, g)) + "]" for g in groups)
    return ir.Attribute.parse(f"dense<[{rows}]> : tensor<{len(groups)}x{len(groups[0])}xi64>")


def _i64(value: int):
    from torch_mlir import ir

    return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), value)
