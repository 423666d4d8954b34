"""The passes, listed in the order they run: no registry, no import side effects."""

from __future__ import annotations

from laplace_passes.config import CompileConfig
from laplace_passes.fx.retile import RetileGLA
from laplace_passes.passes import GraphPass


def dynamo_passes(config: CompileConfig) -> list[GraphPass]:
    """Passes over the torch-level graph Dynamo captured, before AOT Autograd."""
    passes: list[GraphPass] = []
    if config.retile_gla:
        passes.append(RetileGLA(config.chunk_size, config.target.sub_chunk_size))
    return passes


def aten_passes(config: CompileConfig, kind: str) -> list[GraphPass]:
    """Passes over each ATen graph (forward, backward, inference) AOT Autograd produces."""
    return []
