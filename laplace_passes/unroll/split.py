"""A partitioned graph: a driver graph that calls each partition in order.

NOTE [partitioned graph: before and after]
Before (an ATen backward graph over the budget):

    def forward(self, primals_2, view_1, ..., tangents_1):
        ... 9,000 nodes ...
        return (None, grad_1, ..., grad_31)

After (two partitions; each a GraphModule that returns a tuple):

    def forward(self, primals_2, view_1, ..., tangents_1):
        laplace_partition_0 = self.laplace_partition_0(view_1, ..., tangents_1)
        getitem = laplace_partition_0[0]; ...          # values the later partitions read
        laplace_partition_1 = self.laplace_partition_1(primals_2, getitem, ...)
        getitem_7 = laplace_partition_1[0]; ...
        return (None, getitem_7, ..., getitem_3)

`compile_graph` hands each partition to the inner compiler separately and
installs the compiled callables in the driver, which then runs them in
order: the same ATen ops as the uncut graph, each after the values it reads.
The partitioner may order independent ops differently from the uncut graph,
so ops that draw random numbers (dropout in a graph whose RNG is not
functionalised) may draw in another order; everything else computes the
same values.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Callable

import torch
import torch._guards
import torch.fx
from functorch.compile import make_boxed_func

from laplace_passes.infra.fx_helpers import FAKE_KEYS, fake_value
from laplace_passes.unroll.compiled_bodies import compile_ahead
from laplace_passes.unroll.partition import PartitionPlan

PARTITION_PREFIX = "laplace_partition_"


def split_graph(gm: torch.fx.GraphModule, plan: PartitionPlan) -> torch.fx.GraphModule:
    """The driver GraphModule for `plan`; `gm` is left unchanged."""
    members: list[list[torch.fx.Node]] = [[] for _ in range(plan.count)]
    for node in gm.graph.nodes:
        if node in plan.part_of:
            members[plan.part_of[node]].append(node)
    output = gm.graph.output_node()

    views = plan.input_views
    driver = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = driver.node_copy(node)
    modules: dict[str, torch.nn.Module] = {}
    for index, nodes in enumerate(members):
        part, inputs, outputs = _partition_graph(gm, nodes, index, plan, output, views)
        name = f"{PARTITION_PREFIX}{index}"
        modules[name] = part
        call = driver.call_module(name, tuple(env[x] for x in inputs))
        call.meta["laplace_partition"] = index
        for position, value in enumerate(outputs):
            item = driver.call_function(operator.getitem, (call, position))
            item.meta = {k: v for k, v in value.meta.items() if k in (*FAKE_KEYS, "tensor_meta")}
            env[value] = item
    for node in gm.graph.nodes:  # attributes and views of inputs the output returns directly
        if node.op == "get_attr" and _reaches_output(node, views, output):
            env[node] = driver.get_attr(node.target)
            modules[node.target] = operator.attrgetter(node.target)(gm)
        elif node in views and _reaches_output(node, views, output):
            env[node] = driver.node_copy(node, env.__getitem__)
    driver.output(torch.fx.node.map_arg(output.args[0], env.__getitem__))
    return torch.fx.GraphModule(modules, driver, class_name="PartitionedGraph")


def _partition_graph(gm, nodes: list, index: int, plan: PartitionPlan, output: torch.fx.Node, views: set):
    """One partition as a GraphModule; the outside values it reads and the values it returns."""
    graph = torch.fx.Graph()
    local: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: list[torch.fx.Node] = []

    def read(value: torch.fx.Node) -> torch.fx.Node:
        if value in local:
            return local[value]
        if value.op == "get_attr":
            local[value] = graph.node_copy(value)
        elif value in views:  # this partition's own view of a graph input
            local[value] = graph.node_copy(value, read)
        else:  # a graph input, or a value of an earlier partition
            local[value] = graph.placeholder(value.name)
            local[value].meta = dict(value.meta)
            inputs.append(value)
        return local[value]

    for node in nodes:
        local[node] = graph.node_copy(node, read)
    outputs = [n for n in nodes if _read_later(n, index, plan, output)]
    graph.output(tuple(local[n] for n in outputs))
    return torch.fx.GraphModule(gm, graph, class_name=f"Partition{index}"), inputs, outputs


def _reaches_output(node: torch.fx.Node, views: set, output: torch.fx.Node) -> bool:
    """The output returns `node`, or a view of it made in the driver."""
    return any(user is output or (user in views and _reaches_output(user, views, output)) for user in node.users)


def _read_later(node: torch.fx.Node, index: int, plan: PartitionPlan, output: torch.fx.Node) -> bool:
    return any(user is output or plan.part_of.get(user, index) > index for user in node.users)


def partition_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        n for n in gm.graph.nodes
        if n.op == "call_module" and isinstance(n.target, str) and n.target.startswith(PARTITION_PREFIX)
    ]


class CompiledPartition(torch.nn.Module):
    """What the driver calls in place of a partition: its compiled (boxed) function.

    A compiled partition assumes its inputs have the strides it was compiled
    for (those of the traced graph), but the partition before it may return
    a value laid out otherwise (Inductor picks its own layout for outputs
    that are not the graph's): such an input is copied into the expected
    layout first.
    """

    def __init__(self, compiled: Callable, examples: list) -> None:
        super().__init__()
        self.compiled = compiled
        self.strides = [tuple(x.stride()) if isinstance(x, torch.Tensor) else None for x in examples]

    def forward(self, *args):
        return self.compiled([_with_strides(x, stride) for x, stride in zip(args, self.strides, strict=True)])


def _with_strides(value, stride: tuple[int, ...] | None):
    if stride is None or not isinstance(value, torch.Tensor) or value.stride() == stride or value.numel() <= 1:
        return value
    laid_out = torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device)
    return laid_out.copy_(value)


def compile_graph(inner, gm: torch.fx.GraphModule, example_inputs: list, kind: str,
                  bodies_ahead: bool = True) -> Callable:
    """Compile `gm` with the inner compiler; a partitioned graph partition by partition.

    `bodies_ahead`: compile its chunk-loop bodies with it (`compiled_bodies.compile_ahead`).
    """
    calls = partition_calls(gm)
    if not calls:
        if inner.compiles_loop_bodies and bodies_ahead:  # NOTE [kernel builds beside the codegen] in infra/kernel_batches.py
            compile_ahead(gm, kind)
        return inner.compile(gm, example_inputs, kind)
    for call in calls:
        part = gm.get_submodule(call.target)
        examples = [fake_value(n) for n in part.graph.nodes if n.op == "placeholder"]
        with _compiling_a_partition():
            compiled = inner.compile(part, examples, kind)
        setattr(gm, call.target, CompiledPartition(compiled, examples))
    return make_boxed_func(gm.forward)


@contextlib.contextmanager
def _compiling_a_partition():
    """Hide from the inner compiler what AOT Autograd's tracing context says of the whole graph.

    * Output strides: Inductor reports the strides of a graph's outputs to
      AOT Autograd, once per compile (it asserts the list is empty). A
      partition's outputs are not the graph's: unreported, AOT Autograd keeps
      the traced graph's strides, which Inductor keeps for the graph outputs.
    * Donated buffers: the positions of backward inputs Inductor may
      overwrite. They index the whole graph's inputs, not a partition's: a
      partition would overwrite a value a later partition still reads.
      Inductor's FX graph cache does not key on them, so it is bypassed for
      partitions: a cached compile made with donation would come back.
    """
    from torch._inductor import config as inductor_config

    context = torch._guards.TracingContext.try_get()
    if context is None:
        yield
        return
    metadata = context.fw_metadata
    saved_donated = getattr(metadata, "bw_donated_idxs", None)
    if saved_donated is not None:
        metadata.bw_donated_idxs = []
    try:
        with output_strides_unreported(), inductor_config.patch(fx_graph_cache=False):
            yield
    finally:
        if saved_donated is not None:
            metadata.bw_donated_idxs = saved_donated


@contextlib.contextmanager
def output_strides_unreported():
    """Within it, Inductor reports no output strides to AOT Autograd's tracing context (nor asserts on them).

    Inductor appends the strides of each graph it compiles to the context's
    list, asserting it empty first; a compile within this reports nothing.
    """
    context = torch._guards.TracingContext.try_get()
    if context is None:
        yield
        return
    saved, context.output_strides = context.output_strides, None
    try:
        yield
    finally:
        context.output_strides = saved
