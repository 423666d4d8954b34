"""The project's ATen-level passes inside a user's own Inductor compile.

Inductor runs custom passes over its post-grad graphs (forward, backward,
inference) when `torch._inductor.config.post_grad_custom_pre_pass` or
`post_grad_custom_post_pass` holds one:

    from torch._inductor.decomposition import select_decomp_table
    from laplace_passes.infra.inductor_passes import InductorPass
    from laplace_passes.unroll import UnrollLoops

    unroll = InductorPass(UnrollLoops("aten", decompositions=select_decomp_table()))
    with torch._inductor.config.patch(post_grad_custom_pre_pass=unroll):
        torch.compile(step, backend="inductor")(q, k, v, gk)   # chunk loops unrolled, then fused by Inductor
    unroll.results        # each graph's PassResult: summary, loops, declined

Inductor hands the pass a `torch.fx.Graph` to change in place, so only
passes that rewrite in place fit (all but the budget pass, which returns a
new module of partitions: refused here). `uuid` keys Inductor's FX graph
cache: the pass's class, its module's source and its plain settings, so a
cached compile is reused only with the same pass.

A pass that would specialise a dynamic graph's sizes (NOTE [passes add no
guards]) declines, its reason in `results`, as long as it had not changed the
graph yet; past that point its error is raised, as any other pass error is
here: Inductor compiles the graph it was handed, half rewritten or not.
"""

from __future__ import annotations

import inspect

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from laplace_passes.infra.guards import WouldSpecialise
from laplace_passes.infra.pass_base import GraphPass, PassResult, failure_reason, run_pass


class InductorPass(CustomGraphPass):
    """One `GraphPass` as an Inductor custom post-grad pass; its results are kept in `results`."""

    def __init__(self, graph_pass: GraphPass) -> None:
        if not isinstance(graph_pass, GraphPass):
            raise TypeError(f"InductorPass takes a laplace_passes GraphPass, got {type(graph_pass).__name__}")
        self.graph_pass = graph_pass
        self.results: list[PassResult] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        if not isinstance(gm, torch.fx.GraphModule):
            raise TypeError(f"laplace pass {self.graph_pass.name!r} needs a graph owned by a GraphModule")
        name = f"inductor graph {len(self.results)}"
        before = str(graph)
        try:
            result = run_pass(self.graph_pass, gm, name)
        except WouldSpecialise as error:  # NOTE [passes add no guards]
            if str(graph) != before:  # the graph is Inductor's to compile: one half rewritten cannot go on
                raise
            result = PassResult(gm, False, summary="declined: it would specialise the graph's sizes",
                                declined=[failure_reason(error)])
        if result.graph_module is not gm:
            raise RuntimeError(f"laplace pass {self.graph_pass.name!r} returned a new graph module; Inductor's "
                               "custom passes must rewrite the graph they are given in place")
        self.results.append(result)

    def uuid(self) -> bytes:
        source = inspect.getfile(type(self.graph_pass))
        settings = sorted((k, v) for k, v in vars(self.graph_pass).items()
                          if isinstance(v, (bool, int, float, str, type(None))))
        return get_hash_for_files((source, __file__)) + repr((type(self.graph_pass).__qualname__, settings)).encode()
