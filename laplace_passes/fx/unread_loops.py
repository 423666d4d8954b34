"""Loops recognition cannot read, found so that the report still says why.

Recognition follows a state from step to step by value (`laplace_passes.fx.recurrence`):
S_t is a new node made from S_{t-1}. Two ways of writing a loop leave nothing
to follow, and without these rows the report's "recurrences" table would
not list the loop at all:

* a state updated in place, `S.mul_(a_t).add_(k_t v_t)` (under no_grad;
  with gradients eager refuses it): every step writes the same node, so no
  chain of states exists in the graph;
* sizes that are symbolic (a dimension marked dynamic, or Dynamo's automatic
  dynamic shapes after a second length): the canonical algebra reads static
  sizes only, so the loop's reason ends in a hint naming those sizes.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from laplace_passes.fx.in_place_writes import written_operands
from laplace_passes.infra.fx_helpers import dynamic_dims, fake_tensor
from laplace_passes.infra.op_facts import short_op_name
from laplace_passes.infra.report import RecurrenceRecord

Node = torch.fx.Node

# In-place arithmetic a state update is written with; a write into a slot (setitem, copy_, index_copy_)
# is how outputs are stored, not how a state is carried.
STATE_WRITES = frozenset({"mul_", "add_", "sub_", "div_", "addcmul_", "addcdiv_", "lerp_", "baddbmm_", "addmm_",
                          "addbmm_", "addr_"})


def in_place_state_rows(graph: torch.fx.Graph, chained: set[Node], min_steps: int) -> list[RecurrenceRecord]:
    """A declined row per tensor of two or more dimensions that in-place arithmetic writes at least
    `min_steps` times (with one method), unless a chain of states already holds those writes."""
    writes: dict[Node, dict[Node, None]] = {}  # per tensor, its writers in graph order, each once
    for node in graph.nodes:
        if not _state_write(node):
            continue
        for operand in written_operands(node):  # the operand, and what shares its memory
            if isinstance(operand, Node):
                writes.setdefault(_written_root(operand), {})[node] = None
    rows = []
    for root, writers in writes.items():
        counts = Counter(_state_write(w) for w in writers)
        value = fake_tensor(root)
        steps = max(counts.values())
        if steps < min_steps or value is None or value.dim() < 2 or root in chained or chained & set(writers):
            continue
        shape = [_size_text(d) for d in value.shape]
        methods = ", ".join(sorted(counts))
        rows.append(RecurrenceRecord(
            "", root.name, steps, shape, "declined",
            reason=f"a {steps}-step loop carrying a {shape} state, but its state {root.name} is updated in place "
                   f"({methods}): recognition follows a state passed from step to step as a new value; write "
                   "S = S * a + k v (a new tensor each step) to have it recognised"))
    return rows


def symbolic_size_hint(gm: torch.fx.GraphModule) -> str:
    """'' when every input's size is static; else what to add to a declined loop's reason."""
    symbolic = dynamic_dims(gm, include_specialised=False)  # a length specialised to one value is static here
    if not symbolic:
        return ""
    return (f" (the graph's inputs have symbolic sizes: {', '.join(symbolic[:4])}"
            f"{', ...' if len(symbolic) > 4 else ''}; recognition reads loops of static sizes, so "
            "torch.compile(..., dynamic=False) compiles one graph per shape in which it can)")


def _state_write(node: Node) -> str:
    """The in-place arithmetic method or function `node` calls (`STATE_WRITES`); '' for anything else."""
    name = short_op_name(node) if node.op in ("call_method", "call_function") else ""
    return name if name in STATE_WRITES else ""


def _written_root(node: Node) -> Node:
    """The tensor an in-place chain writes: `S.mul_(a).add_(b)` writes S through the node `mul_` returns."""
    while _state_write(node) and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def _size_text(d):
    return int(d) if is_concrete_int(d) else str(d)
