"""A Dynamo graph's backward generated in the helper process while this process compiles its forward.

    ahead = BackwardAhead.for_graph(config, example_inputs)   None where it does not apply (see below)
    ahead.partition_fn                  AOT Autograd's partitioner, keeping the backward graph it makes
    ahead.send(forward, prepare_backward)
                                        in the forward's compile: the backward's codegen request to the
                                        helper; `prepare_backward(gm, example_inputs)` runs the backward's
                                        passes and its inner compile
    with ahead.answering(graph_name):   in the backward's compile: its codegen loaded from the helper when
        ...                             the request is the one sent

NOTE [backward graphs generated in the helper process]
AOT Autograd cuts the joint graph into the forward and the backward before
it compiles either; the backward is compiled at the first `.backward()`,
after the forward's compile and its first run. Inductor's codegen is
Python, one graph at a time per process, and on a Neuron target's training
step the two graphs weigh the same (tiny's at T = 2048 on trn2: 1,339 and
2,589 nodes, about 20 s of Inductor each on a 2-core machine). So as the
forward's compile starts, `send` runs the backward's own compile on a copy
of the backward graph, with the layouts its inputs were traced with: our
passes (into a report of its own) and the inner compiler up to Inductor's
codegen, whose request goes to the helper process of
`laplace_passes.unroll.body_helper`. The helper generates and compiles it
(`laplace_passes.infra.remote_codegen`, Inductor's own transport), and
builds its kernels into the shared Inductor cache, while this process
compiles and runs the forward. When the backward compiles for real, its
codegen request is compared with the one sent (NOTE [what makes two codegens
the same]): equal, the helper's compiled graph is loaded (its kernels from
the cache); different (the forward's compile chose other strides for a
saved tensor), or the helper failed, the codegen runs here as it always did.
Everything around the codegen (our passes, the report, Inductor's
post-compile steps) runs here in both cases (the backward's GLA body traced
once for both: NOTE [traces shared within a fake mode] in
`laplace_passes/unroll/chunk_loops.py`), so the report and the compiled
backward are those of a compile without the helper; Inductor's codegen of
the same request generates the same kernels (tests/test_backward_ahead.py
compares gradients bit for bit). Only the backward's decomposition for
Inductor is not repeated: the one made as it was sent is kept and taken by
the same graph with inputs of the same layouts (`inner.decomposing_ahead`).
The send runs as the backward's compile will: without grad, outside AOT
Autograd's Python dispatcher (which decomposes some ops otherwise) and
with no output strides being reported (a backward Inductor's FX graph
cache already holds completes its compile within the send, and nothing is
sent).

It applies with the inner compiler "inductor", a graph that differentiates,
the helper on (`body_helper.BodyHelper.enabled`: two usable cores or more)
and a forward of MIN_FORWARD_NODES nodes or more
after the passes; of a backward the budget pass cut into partitions, the
first partition is sent (each partition is a codegen of its own).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Callable, Iterator

import torch
from torch._dispatch.python import no_python_dispatcher

from laplace_passes.driver.config import CompileConfig
from laplace_passes.infra import logs
from laplace_passes.infra.inner import decomposing_ahead
from laplace_passes.infra.remote_codegen import answering_codegen, captured_codegen
from laplace_passes.infra.report import copy_graphs
from laplace_passes.unroll.body_helper import HELPER
from laplace_passes.unroll.split import output_strides_unreported

# Below this many nodes in the forward (after the passes) the backward is generated here: the helper's start
# (seconds of imports, on a core the builds use) would cost more than the codegen it takes off this process.
MIN_FORWARD_NODES = 1000


class BackwardAhead:
    """One Dynamo graph's backward: kept from the partitioner, sent to the helper, loaded from it."""

    def __init__(self, partition_fn: Callable) -> None:
        self._partition = partition_fn
        self._backward: torch.fx.GraphModule | None = None
        self.answers: dict[str, Future] = {}

    @classmethod
    def for_graph(cls, config: CompileConfig, example_inputs: list) -> "BackwardAhead | None":
        differentiates = torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in example_inputs)
        if not (config.inner.codegen_elsewhere and config.inner.partition_fn is not None and differentiates
                and HELPER.enabled()):
            return None
        return cls(config.inner.partition_fn)

    def partition_fn(self, *args, **kwargs):
        forward, backward = self._partition(*args, **kwargs)
        self._backward = backward
        return forward, backward

    def send(self, forward: torch.fx.GraphModule, prepare_backward: Callable[[torch.fx.GraphModule, list], object]
             ) -> bool:
        """The backward's codegen request to the helper, for a `forward` of MIN_FORWARD_NODES or more; False when
        it was not sent (a failure's reason logged)."""
        backward, self._backward = self._backward, None
        if backward is None or len(forward.graph.nodes) < MIN_FORWARD_NODES:
            return False
        HELPER.start()  # its imports overlap the backward's passes below
        try:
            examples = [n.meta.get("val") for n in backward.graph.find_nodes(op="placeholder")]
            copied = copy_graphs(backward)  # its subgraphs too: the passes change what they are given
            # As the backward compiles (no grad, and not inside AOT Autograd's trace, whose Python dispatcher
            # decomposes some ops differently), so its graph is decomposed once: the one kept is reused.
            # (A backward in Inductor's FX graph cache completes its compile in the send: its strides are not the
            # forward's to report.)
            with torch.no_grad(), no_python_dispatcher(), decomposing_ahead(), output_strides_unreported():
                request = captured_codegen(lambda: prepare_backward(copied, examples))
            if request.key is None:
                raise ValueError("its codegen request holds what cannot be compared with the real one")
            future = HELPER.submit_codegen(request.payload())
        except Exception as error:  # noqa: BLE001 - the backward is then compiled here, at its first call
            logs.log.info("the backward graph not sent to the helper process (%s: %s); it compiles here",
                          type(error).__name__, error)
            return False
        if future is None:
            return False
        self.answers[request.key] = future
        return True

    @contextlib.contextmanager
    def answering(self, graph_name: str) -> Iterator[None]:
        """Within it, the backward's codegen loads the helper's answer when its request is the one sent."""
        with answering_codegen(self.answers) as loaded:
            yield
        if loaded:
            logs.log.info("%s: its code generated in the helper process", graph_name)

