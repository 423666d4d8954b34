"""Copying one graph into another: the mechanics every unrolling shares.

A loop body (a scan's combine function, a while_loop's body, the traced
implementation of a chunk-loop op) is a GraphModule; unrolling copies it into
the host graph once per trip, with its placeholders bound to host values.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx

from laplace_passes.infra.fx_helpers import replace_uses


def inline_graph(
    host: torch.fx.GraphModule, body: torch.fx.GraphModule, inputs: Sequence[Any], provenance: dict
) -> list[Any]:
    """Copy `body` into `host` at the current insertion point; return its outputs as host values.

    `inputs` bind the body's placeholders in order (host nodes or Python
    constants). Attributes the body reads (constants, nested loop bodies)
    are copied onto `host` under fresh names.
    """
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise ValueError(f"loop body takes {len(placeholders)} inputs, got {len(inputs)}")
    value_map: dict[torch.fx.Node, Any] = dict(zip(placeholders, inputs))
    for node in body.graph.nodes:
        if node.op == "get_attr":
            value_map[node] = host.graph.get_attr(copy_attribute(host, body, node.target))
    result = host.graph.graph_copy(body.graph, value_map)
    for old, new in value_map.items():
        if isinstance(new, torch.fx.Node) and old.op not in ("placeholder",):
            for key, value in provenance.items():
                new.meta.setdefault(key, value)
    return list(result) if isinstance(result, (tuple, list)) else [result]


def copy_attribute(host: torch.fx.GraphModule, body: torch.fx.GraphModule, target: str) -> str:
    """Register `body`'s attribute `target` on `host` under a fresh name; return the name."""
    value = operator.attrgetter(target)(body)
    stem = "_laplace_" + target.replace(".", "_").lstrip("_")
    name, suffix = stem, 0
    while hasattr(host, name):
        suffix += 1
        name = f"{stem}_{suffix}"
    if isinstance(value, torch.nn.Module):
        host.add_submodule(name, value)
    elif isinstance(value, torch.Tensor):
        host.register_buffer(name, value)
    else:
        setattr(host, name, value)
    return name


def getitem_users(node: torch.fx.Node) -> dict[int, list[torch.fx.Node]] | None:
    """Output index -> the getitem nodes reading it; None when the result is used whole."""
    users: dict[int, list[torch.fx.Node]] = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return None
        users.setdefault(user.args[1], []).append(user)
    return users


def replace_tuple_result(graph: torch.fx.Graph, node: torch.fx.Node, outputs: Sequence[Any]) -> None:
    """Replace a tuple-producing node read through getitems by the values `outputs`, then erase it."""
    for index, users in getitem_users(node).items():
        for user in users:
            replace_uses(user, outputs[index])
            graph.erase_node(user)
    graph.erase_node(node)


def erase_unused(nodes: list[torch.fx.Node]) -> None:
    """Erase those of `nodes` nothing reads (newest first, so chains go too).

    Only the nodes an unrolling added or orphaned: a whole-graph dead-code
    pass could drop a user's in-place call whose result is unused.
    """
    for node in reversed(nodes):
        if node.graph is not None and not node.users and not node.is_impure() and node.op != "placeholder":
            node.graph.erase_node(node)
