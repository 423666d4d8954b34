"""Facts about ops that several passes read, held once: which ops only view, copy or cast a value, which
multiply matrices and where their factors are, which fill a tensor with one value, and how an op is named.

Every table is data a pass dispatches on (`is_view(node)`, `matmul_factors(node)`), so a torch upgrade
that adds a view op or renames an overload is mended here. `tests/test_op_facts.py` checks the tables
against torch's own schemas (a view op returns an alias; a matmul's factor positions multiply).
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten
prims = torch.ops.prims
Node = torch.fx.Node

# -- views, copies, casts -----------------------------------------------------------------------------

# Ops (overload packets) that only change how memory is read: no instructions, no memory of their own.
VIEW_OPS = frozenset({
    aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.t, aten.expand,
    aten.unsqueeze, aten.squeeze, aten.select, aten.slice, aten.alias, aten.detach, aten.as_strided,
    aten.split, aten.split_with_sizes, aten.unbind, aten.diagonal, aten._reshape_alias, aten.movedim,
    aten.view_as, aten.expand_as, aten.unflatten, aten.flatten, aten.lift_fresh,
})
# Ops whose output equals their input up to layout or memory format.
VALUE_COPIES = frozenset({
    aten.clone.default, aten.alias.default, aten.contiguous.default, aten.lift_fresh_copy.default,
    aten.detach.default,
})
# A dtype (and layout, device) change of the whole input.
CASTS = frozenset({aten._to_copy.default, prims.convert_element_type.default})
RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
SPLITS = frozenset({
    aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
    aten.tensor_split.indices, aten.tensor_split.sections, aten.split.sizes,
})


def is_view(node: Node) -> bool:
    """An op that only changes how memory is read (no instructions, no memory of its own)."""
    return getattr(node.target, "overloadpacket", None) in VIEW_OPS


def is_cast(node: Node) -> bool:
    """A dtype / layout / device change of the whole input, nothing else (no other kwargs)."""
    if node.op != "call_function":
        return False
    if node.target is aten._to_copy.default:
        return set(node.kwargs) <= {"dtype", "memory_format", "layout", "device", "non_blocking"}
    return node.target is prims.convert_element_type.default


def is_value_copy(node: Node) -> bool:
    """An op whose value is its first input's (a copy, a cast, a clone)."""
    return node.op == "call_function" and (node.target in VALUE_COPIES or is_cast(node))


# -- matrix products ----------------------------------------------------------------------------------

# Overload packet -> the positions of the two factors (addmm / baddbmm carry the bias first).
MATMUL_FACTORS = {aten.mm: (0, 1), aten.bmm: (0, 1), aten.addmm: (1, 2), aten.baddbmm: (1, 2)}
MATMULS = frozenset({aten.mm.default, aten.bmm.default})
ADD_MATMULS = frozenset({aten.addmm.default, aten.baddbmm.default})


def matmul_factors(node: Node) -> tuple | None:
    """The two factors of a matrix product (mm, bmm, addmm, baddbmm), None for any other node."""
    positions = MATMUL_FACTORS.get(getattr(node.target, "overloadpacket", None))
    return None if positions is None else (node.args[positions[0]], node.args[positions[1]])


# -- fills ---------------------------------------------------------------------------------------------

# Tensors filled with one value: a splat constant (and a broadcast) once lowered.
CONSTANT_FILLS = frozenset({
    aten.scalar_tensor.default, aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
    aten.empty_strided.default, aten.full_like.default, aten.zeros_like.default, aten.ones_like.default,
    aten.empty_like.default,
})

# -- names ---------------------------------------------------------------------------------------------


def op_name(node: Node) -> str:
    """"aten.mm.default" for an op overload, the function's (or higher-order op's) name otherwise."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target._schema.name.replace('::', '.')}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def short_op_name(node: Node) -> str:
    """"sub", "logsigmoid", "add_": a method's name, a function's `__name__`; what users wrote."""
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def tensor_method_name(target) -> str:
    """"expand" for ``torch.Tensor.expand`` used as a function's target (as a pass may insert a method call);
    "" for any other target."""
    name = getattr(target, "__name__", "")
    return name if name and getattr(torch.Tensor, name, None) is target else ""


def base_op_name(node: Node) -> str:
    """"squeeze" for x.squeeze, torch.squeeze and aten.squeeze.dim alike: the method's name, or the name of the
    function or of an overload's packet; "" for a node that calls nothing (a placeholder, a get_attr)."""
    if node.op == "call_method":
        return node.target
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet or node.target, "__name__", "")


def overload_packet_name(node: Node) -> str:
    """"aten.mm" for an op overload; "" for anything else."""
    target = node.target
    return target._schema.name.replace("::", ".") if isinstance(target, torch._ops.OpOverload) else ""
