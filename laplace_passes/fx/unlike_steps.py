"""Why one step of a loop is not read as step 0 is: the reason a declined loop's row gives.

The steps of a token loop must be one computation at successive positions
(`laplace_passes.fx.per_step`). When a step's queries, keys, gates or select
condition are not, the reason says which step and role differ, and, for
the ways users commonly write such a role, what to write instead:

* a role that reads two positions of one tensor, a token shift (`doc[:, t]
  != doc[:, t - 1]`, `k[:, t] - k[:, t - 1]`): computed for every token
  before the loop and indexed at the step, it is read;
* a comparison with the step's number (`t < lengths`): the same comparison
  with `torch.arange(T)`, made before the loop;
* a tensor of symbolic sizes: NOTE [loops declined at symbolic sizes] in
  `laplace_passes.driver.shapes`.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from laplace_passes.fx.algebra_terms import SYMBOLIC_SIZE
from laplace_passes.fx.per_step import step_index
from laplace_passes.infra.fx_helpers import fake_tensor, input_source, is_static

Node = torch.fx.Node

COMPARISONS = frozenset({operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, torch.eq,
                         torch.ne, torch.lt, torch.le, torch.gt, torch.ge, "eq", "ne", "lt", "le", "gt", "ge"})
WITHIN = 4  # ops between a role's node and the index or comparison it computes from


def unlike_step_0(index: int, role: str, nodes: list[Node], first: list[Node], memo: dict) -> str:
    """Why step `index`'s `role` (its nodes; `first`, step 0's) is not read like step 0's."""
    for node in nodes:
        for source in node.all_input_nodes:
            if fake_tensor(source) is not None and not is_static(fake_tensor(source)):
                return f"step {index}'s {role} is not read as a position along {source.name}: {SYMBOLIC_SIZE}"
    for node in nodes:
        shift = _two_positions(node, memo)
        if shift is not None:
            tensor, positions = shift
            return (f"its {role} ({node.name}) reads {tensor} at positions {positions[0]} and {positions[-1]} in "
                    f"one step, where a step reads each input at one: {_shift_advice(role, tensor)}")
    compared = _the_step_number(first, nodes, index)
    if compared is not None:
        return (f"step {index}'s {role} compares the step's number with a tensor ({compared.name}), which is not "
                "read as a position: the same comparison made once before the loop, with torch.arange(T) in "
                "place of the step's number (`valid = torch.arange(T) < lengths[:, None]`), and indexed at the "
                "step (`valid[:, t]`), is read")
    return f"step {index}'s {role} is not computed like step 0's (another op, or other dimensions)"


def _shift_advice(role: str, tensor: str) -> str:
    if role in ("skip", "reset"):
        return (f"the condition computed for every token before the loop (`starts = F.pad({tensor}[:, 1:] != "
                f"{tensor}[:, :-1], (1, 0))` for a change of document) and indexed at the step is read")
    return (f"the value computed for every token before the loop (a token shift: `{tensor} - F.pad({tensor}, "
            "...)[:, :-1]` along the tokens) and indexed at the step is read")


def _two_positions(node: Node, memo: dict) -> tuple[str, list[int]] | None:
    """(a tensor, the positions of it that `node` reads) when it reads two or more of one tensor."""
    positions: dict[Node, set[int]] = {}
    for index in _indices_read(node, memo, WITHIN):
        found = step_index(index, memo)
        positions.setdefault(found.key[1], set()).update(found.steps)
    for tensor, read in positions.items():
        if len(read) > 1:
            return (input_source(tensor) if tensor.op == "placeholder" else tensor.name), sorted(read)
    return None


def _indices_read(node: Node, memo: dict, depth: int) -> set[Node]:
    """The indices of a position (`x[:, t]`) that `node` computes from, within `depth` ops."""
    if step_index(node, memo) is not None:
        return {node}
    if depth == 0:
        return set()
    return {i for arg in node.all_input_nodes for i in _indices_read(arg, memo, depth - 1)}


def _the_step_number(first: list[Node], nodes: list[Node], index: int) -> Node | None:
    """The comparison of step `index` that compares with a number where step 0's compares with that number
    less `index` (`t < lengths` with the loop's `t`); None when there is none."""
    for a, b in zip(_ops_within(first), _ops_within(nodes)):
        if a.target != b.target or a.target not in COMPARISONS or len(a.args) != len(b.args):
            continue
        numbers = [(x, y) for x, y in zip(a.args, b.args) if isinstance(x, (int, float)) and type(x) is type(y)]
        if any(y - x == index for x, y in numbers):
            return b
    return None


def _ops_within(nodes: list[Node]) -> list[Node]:
    """`nodes` and the ops they compute from, within WITHIN ops, breadth first."""
    found, frontier = [], list(nodes)
    for _ in range(WITHIN):
        found += [n for n in frontier if n.op in ("call_function", "call_method")]
        frontier = [i for n in frontier for i in n.all_input_nodes]
    return found
