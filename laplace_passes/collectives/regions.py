"""Regions: the nodes that compute one value from one input, to copy or compare.

The Muon rewrite moves computations (rebuilding a full matrix from shards,
Newton-Schulz, laying a result out per rank) onto other inputs. A `Region`
is such a computation: every node `output` depends on, back to `input`,
where the only other leaves are constants (nodes without tensor inputs,
such as `aten.zeros`). Copying a region onto a new input computes exactly
what the original computed, op for op; two regions with equal
`signature`s compute the same function of their inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import ancestors, is_collective
from laplace_passes.infra.pass_base import Declined

Node = torch.fx.Node


@dataclass(frozen=True)
class Region:
    input: Node
    nodes: tuple[Node, ...]  # in graph order, without `input`
    output: Node

    @property
    def node_set(self) -> frozenset[Node]:
        return frozenset(self.nodes)


class RegionError(Declined):
    """`output` is not a function of `input` and constants alone."""


def closed_region(input: Node, output: Node) -> Region:
    """The nodes between `input` and `output`; raises RegionError when another value leaks in."""
    if output is input:
        return Region(input, (), output)
    found: set[Node] = set()
    stack = [output]
    while stack:
        node = stack.pop()
        if node is input or node in found:
            continue
        if node.op != "call_function":
            raise RegionError(f"{output.name} depends on {node.name} ({node.op}), not only on {input.name}")
        if is_collective(node):
            raise RegionError(f"{output.name} depends on the collective {node.name}")
        found.add(node)
        stack.extend(node.all_input_nodes)
    if not any(input in n.all_input_nodes for n in found):
        raise RegionError(f"{output.name} does not depend on {input.name}")
    return Region(input, tuple(sorted(found)), output)  # fx nodes sort by their place in the graph


def copy_region(graph: torch.fx.Graph, region: Region, new_input: Node) -> Node:
    """Emit a copy of `region` computed from `new_input` at the graph's insertion point."""
    env: dict[Node, Node] = {region.input: new_input}
    for node in region.nodes:
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    return env[region.output]


def signature(region: Region) -> tuple:
    """Ops and literal arguments of `region`, with nodes named by position: equal means same function."""
    index = {region.input: "in", **{n: i for i, n in enumerate(region.nodes)}}

    def literal(value: Any) -> Any:
        if isinstance(value, Node):
            return ("node", index[value])
        if isinstance(value, (list, tuple)):
            return tuple(literal(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, literal(v)) for k, v in value.items()))
        if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return str(value)
        return value

    body = tuple((str(n.target), literal(n.args), literal(n.kwargs)) for n in region.nodes)
    return body, ("node", index[region.output]) if region.output is not region.input else "in"


def live_nodes(graph: torch.fx.Graph) -> set[Node]:
    """Nodes the output or a side effect depends on. Graphs traced without
    dead-code elimination (make_fx) keep unused casts and views around; the
    matchers look through them."""
    return ancestors(n for n in graph.nodes if n.op in ("output", "placeholder") or n.is_impure())


def live_users(node: Node, live: set[Node]) -> list[Node]:
    return [user for user in node.users if user in live]

