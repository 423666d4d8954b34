"""Finding GLA sites in an FX graph.

A site is a `laplace::gla` node. Calls to `laplace_passes.gla` produce one
directly; calls to flash-linear-attention's GLA functions become one through
the Dynamo substitutions of `laplace_passes.fla.install`, with `origin`
naming the fla function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

GLA_TARGETS = (torch.ops.laplace.gla, torch.ops.laplace.gla.default)
GLA_ARG_NAMES = ("q", "k", "v", "gk", "initial_state", "scale", "origin")


@dataclass
class GlaSite:
    node: torch.fx.Node
    q: torch.fx.Node
    k: torch.fx.Node
    v: torch.fx.Node
    gk: torch.fx.Node
    initial_state: torch.fx.Node | None
    scale: float
    origin: str

    def tensor_inputs(self) -> list[torch.fx.Node]:
        inputs = [self.q, self.k, self.v, self.gk]
        return inputs + ([self.initial_state] if self.initial_state is not None else [])


def is_gla_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in GLA_TARGETS


def bind_site(node: torch.fx.Node) -> GlaSite:
    values = dict(zip(GLA_ARG_NAMES, node.args))
    values.update(node.kwargs)
    return GlaSite(node=node, **{name: values.get(name) for name in GLA_ARG_NAMES})

