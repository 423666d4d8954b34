"""FX helpers every pass shares: fake values, provenance, value bytes, loop ops, collectives.

Passes read and write node metadata, and touch torch internals that move
between releases (fake tensor modes, higher-order ops, process groups by
name). All of that is here, once, so a pass speaks only of its own rewrite
and a torch upgrade is fixed in one file. This module imports nothing from
`laplace_passes`: every pass may import it.

Fake values. Every node of a traced graph carries the FakeTensor (or tuple
of them, or SymInt) it produces: AOT Autograd and make_fx keep it in
`meta["val"]`, Dynamo in `meta["example_value"]`. `fake_value` reads either;
`new_node` and `propagate_fake_value` give a node a pass creates its value,
computed from its inputs' values in their fake mode, so that later passes,
the size model and the inner compilers can read shapes from every node.
"""

from __future__ import annotations

import copy
import operator
import re
import threading
from typing import Any, Iterable

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.symbolic_shapes import is_concrete_int, optimization_hint
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree

aten = torch.ops.aten
Node = torch.fx.Node

# -- fake values -----------------------------------------------------------------------

FAKE_KEYS = ("val", "example_value")  # AOT / make_fx graphs, Dynamo graphs


def fake_key(graph: torch.fx.Graph) -> str:
    """Where this graph keeps fake values: AOT graphs use "val", Dynamo graphs "example_value"."""
    for node in graph.nodes:
        if node.op == "placeholder":
            return "val" if "val" in node.meta else "example_value"
    return "val"


def fake_value(node: Node) -> Any:
    """What a node produces at trace time (a FakeTensor, a tuple of them, a SymInt), None when unknown."""
    meta = node.meta
    return meta.get("val", meta.get("example_value"))


def fake_tensor(node: Any) -> torch.Tensor | None:
    """The node's fake tensor; None when `node` is not a node or produces no tensor."""
    value = fake_value(node) if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def has_fake_value(node: Node) -> bool:
    return any(key in node.meta for key in FAKE_KEYS)


def tensor_values(value: Any) -> list[torch.Tensor]:
    """The tensors in a fake value (nested tuples and lists flattened)."""
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensor_values(item)]
    return [value] if isinstance(value, torch.Tensor) else []


def is_static(value: Any) -> bool:
    """No symbolic size anywhere in the value (a tensor's shape, a size, a tuple of them)."""
    if isinstance(value, torch.Tensor):
        return all(isinstance(s, int) for s in value.shape)
    if isinstance(value, (tuple, list)):
        return all(is_static(v) for v in value)
    return not isinstance(value, torch.SymInt)


def size_hint(size: Any) -> int:
    """An int for a size that may be symbolic: its value in the example the graph was traced with.

    Reads the symbol's hint without adding a guard: estimates (instructions,
    bytes) made from it hold for the example, and the graph stays general.
    """
    return optimization_hint(size, fallback=1) if isinstance(size, torch.SymInt) else int(size)


def dynamic_dims(gm: torch.fx.GraphModule, include_specialised: bool = True) -> list[str]:
    """The graph's inputs with symbolic sizes, one "input dim i = symbol" entry per dimension.

    `include_specialised=False` leaves out the sizes that are symbols with one known value (a length Dynamo
    specialised to 70, say): what is left can take other values in this graph.
    """
    found = []
    symbolic = (lambda s: not isinstance(s, int)) if include_specialised else (lambda s: not is_concrete_int(s))
    for node in gm.graph.find_nodes(op="placeholder"):
        value = fake_value(node)
        if isinstance(value, torch.SymInt):
            continue  # a size passed as an input: named by the tensor dimensions it comes from
        for tensor in tensor_values(value):
            found += [f"{node.name} dim {i} = {s}" for i, s in enumerate(tensor.shape) if symbolic(s)]
    return found


def fake_mode_of(values: Iterable[Any], graph: torch.fx.Graph | None = None) -> FakeTensorMode | None:
    """The one fake mode the tensors among `values` belong to; None when they come from several.

    Without any fake tensor among `values` (an op that makes a tensor from
    sizes alone, `aten.full`), the mode of `graph`'s inputs, if given.
    """
    fakes = [x for x in pytree.tree_leaves(list(values)) if isinstance(x, FakeTensor)]
    if not fakes and graph is not None:
        fakes = [x for n in graph.find_nodes(op="placeholder") for x in tensor_values(fake_value(n))
                 if isinstance(x, FakeTensor)]
    if not fakes or len({id(f.fake_mode) for f in fakes}) != 1:
        return None
    return fakes[0].fake_mode


class GraphsByFakeMode:
    """Graphs kept by key for a later compile, each with the fake mode its values belong to; the newest `size`.

    `get` hands a graph only to a caller in the same fake mode (compared by
    identity; a mode is held while its graph is kept, so its identity is not
    reused meanwhile): a graph's fake values cannot join another mode's graph,
    and a graph of another mode makes its own. `take=True` removes it.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"GraphsByFakeMode keeps at least one graph, got size={size}")
        self.size = size
        self._graphs: dict[tuple, tuple[Any, torch.fx.GraphModule]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._graphs)

    def put(self, fake_mode: Any, key: Any, gm: torch.fx.GraphModule) -> None:
        with self._lock:
            while len(self._graphs) >= self.size:  # a graph never asked for again is not kept forever
                self._graphs.pop(next(iter(self._graphs)))
            self._graphs[(id(fake_mode), key)] = (fake_mode, gm)

    def get(self, fake_mode: Any, key: Any, take: bool = False) -> torch.fx.GraphModule | None:
        with self._lock:
            kept = self._graphs.get((id(fake_mode), key))
            if kept is None or kept[0] is not fake_mode:
                return None
            if take:
                del self._graphs[(id(fake_mode), key)]
            return kept[1]


class GraphsAcrossModes:
    """Graphs traced at static shapes, kept by key without their fake values and handed to any fake mode.

    A graph traced at static shapes is the same in every fake mode: only its
    values belong to one. `get` copies a kept graph and computes its values
    afresh from `inputs` (fake tensors of the caller's mode), which costs
    about a third of a make_fx trace: `val` and `tensor_meta` on every node,
    and `eager_input_vals` (its arguments' values, which Inductor reads for
    an op that needs its inputs' exact strides) where the trace had it.
    `put` keeps no meta entry holding a fake tensor, so no mode is kept
    alive. Graphs with attributes (constants) are not kept. The newest
    `size`, least recently used dropped first. The caller's key must say
    whatever else the trace depends on (`trace_state`).
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"GraphsAcrossModes keeps at least one graph, got size={size}")
        self.size = size
        self._graphs: dict[Any, tuple[torch.fx.GraphModule, frozenset[str]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._graphs)

    def put(self, key: Any, gm: torch.fx.GraphModule) -> None:
        if any(node.op == "get_attr" for node in gm.graph.nodes):
            return
        kept = _copy_graph(gm)
        with_input_values = frozenset(n.name for n in kept.graph.nodes if "eager_input_vals" in n.meta)
        for node in kept.graph.nodes:
            node.meta = {name: value for name, value in node.meta.items()
                         if name != "tensor_meta" and not _holds_fake_tensors(value)}
        with self._lock:
            self._graphs.pop(key, None)
            while len(self._graphs) >= self.size:
                self._graphs.pop(next(iter(self._graphs)))
            self._graphs[key] = (kept, with_input_values)

    def get(self, key: Any, inputs: list[torch.Tensor]) -> torch.fx.GraphModule | None:
        with self._lock:
            kept = self._graphs.pop(key, None)
            if kept is None:
                return None
            self._graphs[key] = kept  # the most recently used last
        gm = _copy_graph(kept[0])
        propagate_from_inputs(gm, inputs)
        for node in gm.graph.nodes:  # as make_fx leaves them
            if isinstance(node.meta.get("val"), torch.Tensor):
                node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])
            if node.name in kept[1]:
                node.meta["eager_input_vals"] = torch.fx.node.map_aggregate(
                    (node.args, node.kwargs), lambda a: a.meta.get("val") if isinstance(a, Node) else a)
        return gm


def trace_state() -> tuple:
    """What a make_fx trace depends on besides its inputs and decompositions: the Python dispatcher (on while
    AOT Autograd traces the backward for `inspect`, where views trace as `view`; off when the backward
    compiles at `.backward()`: `_unsafe_view`) and CPU autocast."""
    python_dispatcher = torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)
    return python_dispatcher, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")


def _holds_fake_tensors(value: Any) -> bool:
    return any(isinstance(leaf, FakeTensor) for leaf in pytree.tree_leaves(value))


def _copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule of a copy of `gm`'s graph: nodes and meta dicts are new, so neither changes the other."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph._codegen = copy.deepcopy(gm.graph._codegen)  # make_fx's: how a call's arguments and outputs are flattened
    # Its Python code is generated at its first call, if any: the passes read the graph (a tenth of a second
    # per body otherwise).
    return _LazyGraphModule(gm, graph)


def propagate_fake_value(node: Node) -> None:
    """Give a new call_function node its fake value: its op run on its inputs' fake values.

    Left unset when an input has no fake value or the inputs come from
    different fake modes (a body traced on its own, say): shapes are then
    read from the nodes that consume it. A `cond` gets its branches'
    values too (Inductor reads them); its own value is the true branch's.
    """
    if node.target is COND:  # its branches are get_attr nodes, without values of their own
        _propagate_cond(node)
        return
    if _takes_an_element(node):  # no op to run: and flattening a T-long tuple per element made T elements T^2
        node.meta[fake_key(node.graph)] = fake_value(node.args[0])[node.args[1]]
        return
    missing = []

    def to_fake(arg):
        if isinstance(arg, Node):
            if not has_fake_value(arg):
                missing.append(arg)
            return fake_value(arg)
        return arg

    args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), to_fake)
    mode = fake_mode_of((args, kwargs), node.graph)
    if missing or mode is None:
        return
    with mode:
        node.meta[fake_key(node.graph)] = node.target(*args, **kwargs)


def _takes_an_element(node: Node) -> bool:
    """`node` is ``source[i]`` of a node whose fake value is a tuple or list (an unbind's rows, a loop's results)."""
    source, index = (node.args + (None, None))[:2]
    return (node.target is operator.getitem and isinstance(source, Node) and isinstance(index, int)
            and isinstance(fake_value(source), (tuple, list)))


def _propagate_cond(cond: Node) -> None:
    operands = [fake_value(n) for n in cond.args[3]]
    mode = fake_mode_of(operands)
    if mode is None or any(v is None for v in operands):
        return
    gm = cond.graph.owning_module
    results = [
        FakeTensorProp(subgraph(gm, branch), mode=mode).propagate_dont_convert_inputs(*operands)
        for branch in cond.args[1:3]
    ]
    cond.meta[fake_key(cond.graph)] = tuple(results[0])


def fill_fake_values(nodes: Iterable[Node]) -> None:
    """`propagate_fake_value` for the call_function nodes among `nodes`, in graph order.

    Only new nodes are run on fake tensors: the rest of the graph kept its
    values, and a whole-graph propagation costs seconds on a large graph.
    """
    for node in sorted(n for n in nodes if n.op == "call_function"):
        propagate_fake_value(node)


def propagate_from_inputs(gm: torch.fx.GraphModule, example_inputs: list) -> None:
    """Fake values for every node of `gm`, computed from `example_inputs` (fake or real tensors)."""
    mode = detect_fake_mode(example_inputs)
    if mode is not None:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*example_inputs)
    else:
        FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*example_inputs)


# -- where nodes came from, and making new ones -------------------------------------------

# Meta that says where a node came from. Copied from the node a rewrite
# replaces onto every node it expands into, so per-layer accounting and
# error messages still point at the user's code.
PROVENANCE_KEYS = ("stack_trace", "nn_module_stack", "fwd_nn_module_stack", "source_fn_stack", "seq_nr")


def provenance_of(node: Node) -> dict:
    return {key: node.meta[key] for key in PROVENANCE_KEYS if key in node.meta}


def new_node(
    graph: torch.fx.Graph, target, args: tuple, kwargs: dict | None = None, *,
    name: str | None = None, provenance: dict | None = None, like: Node | None = None,
) -> Node:
    """A call_function node at the insertion point, with the given provenance and its fake value.

    The fake value is computed from the inputs' (`propagate_fake_value`), or
    taken from `like`, a node the new one replaces with the same shapes.
    """
    node = graph.create_node("call_function", target, args, kwargs or {}, name=name)
    node.meta.update(provenance or {})
    if like is None:
        propagate_fake_value(node)
    else:
        node.meta.update({key: like.meta[key] for key in FAKE_KEYS if key in like.meta})
    return node


def replace_uses(node: torch.fx.Node, value: Any) -> None:
    """Make every user of `node` read `value` (a node or a Python constant) instead."""
    if isinstance(value, torch.fx.Node):
        node.replace_all_uses_with(value)
        return
    for user in list(node.users):
        user.args = torch.fx.node.map_arg(user.args, lambda a: value if a is node else a)
        user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)


# -- sizes and views ----------------------------------------------------------------------

def value_bytes(node: Node) -> int:
    """Bytes of the tensors a node produces (0 when unknown or not a tensor); symbolic sizes at their hint."""
    return sum(tensor_bytes(t) for t in tensor_values(fake_value(node)))


def tensor_bytes(tensor: torch.Tensor) -> int:
    """A (fake) tensor's bytes, an int even when its sizes are symbolic (see `size_hint`)."""
    return size_hint(tensor.numel()) * tensor.element_size()


# -- loops, branches and their subgraphs ---------------------------------------------------

SCAN = torch.ops.higher_order.scan
WHILE_LOOP = torch.ops.higher_order.while_loop
COND = torch.ops.higher_order.cond
# Every higher-order op that runs a body repeatedly: what Neuron cannot compile.
LOOP_OPS = (SCAN, WHILE_LOOP, torch.ops.higher_order.map_impl, torch.ops.higher_order.associative_scan)
# The loops the unroll pass knows how to unroll.
UNROLLABLE_LOOP_OPS = (SCAN, WHILE_LOOP)


def is_loop(node: Node, ops: tuple = LOOP_OPS) -> bool:
    return node.op == "call_function" and node.target in ops


def hop_name(node: Node) -> str:
    """"scan", "while_loop", "cond", ... for a higher-order op; "" for anything else."""
    target = node.target
    return target.name() if isinstance(target, torch._ops.HigherOrderOperator) else ""


def subgraph(gm: torch.fx.GraphModule, attr: Node) -> torch.fx.GraphModule:
    """The submodule a get_attr node (a loop body, a cond branch) reads."""
    return operator.attrgetter(attr.target)(gm)


# Higher-order ops that call their body once, in the node's place: activation checkpointing
# (`torch.utils.checkpoint`) and the autocast and grad-mode regions Dynamo wraps in a body of their own.
# A rewrite inside such a body is a rewrite of the computation around it: NOTE [run-once bodies].
RUN_ONCE_OPS = (torch.ops.higher_order.tag_activation_checkpoint, torch.ops.higher_order.wrap,
                torch.ops.higher_order.wrap_with_autocast, torch.ops.higher_order.wrap_with_set_grad_enabled)


def run_once_bodies(gm: torch.fx.GraphModule, prefix: str = "") -> list[tuple[str, torch.fx.GraphModule]]:
    """("wrap_body_0.", body) for the body of each run-once op of `gm` (`RUN_ONCE_OPS`), nested ones too.

    NOTE [run-once bodies]: Dynamo puts the code under `torch.utils.checkpoint`
    (and under an autocast or grad-mode region inside one) into a body graph
    that the higher-order op calls once. A GLA written in plain PyTorch is
    there, not in the graph: the passes that look for loops walk these bodies
    as they walk the graph, and their records name the body
    ("wrap_body_0.mul_3"). Bodies of loops (scan, while_loop) are not listed:
    they run many times and are unrolled first.
    """
    found, seen = [], set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in RUN_ONCE_OPS:
            continue
        for attr in node.all_input_nodes:
            body = subgraph(gm, attr) if attr.op == "get_attr" else None
            if isinstance(body, torch.fx.GraphModule) and id(body) not in seen:
                seen.add(id(body))
                name = f"{prefix}{attr.target}."
                found += [(name, body), *run_once_bodies(body, name)]
    return found


def graph_and_run_once_bodies(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    """("", gm), then `run_once_bodies(gm)`: what the passes that look for loops walk (NOTE [run-once bodies])."""
    return [("", gm), *run_once_bodies(gm)]


def output_values(gm: torch.fx.GraphModule) -> list:
    """What the graph returns, as a list (a single value becomes a one-element list)."""
    result = gm.graph.output_node().args[0]
    return list(result) if isinstance(result, (tuple, list)) else [result]


def ancestors(nodes: Iterable[Any]) -> set[Node]:
    """The nodes among `nodes` and every node they read, directly or not."""
    found: set[Node] = set()
    stack = [n for n in nodes if isinstance(n, Node)]
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(node.all_input_nodes)
    return found


# -- names ---------------------------------------------------------------------------------


def is_collective(node: Node) -> bool:
    """A functional collective (`_c10d_functional.*`)."""
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional"


def resolve_process_group(name: Any):
    """The process group a functional collective names, or None (no process group here, an unknown name)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and isinstance(name, str)):
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError):  # a group name this process does not know
        return None


def input_source(placeholder: torch.fx.Node) -> str:
    """Where Dynamo took a graph input from, as the user would write it: "args[0][3]", "self.lm_head.weight",
    "DECAY" (a module-level global, G['DECAY'] to Dynamo), "pkg.gates.DECAY" (a global of another module
    that a function there read, G['__import_pkg_dot_gates'].DECAY to Dynamo)."""
    graph_arg = placeholder.meta.get("grapharg")
    name = getattr(getattr(graph_arg, "source", None), "name", None)
    if not isinstance(name, str):
        return placeholder.name
    name = re.sub(r"^G\['__import_(\w+)'\]", lambda m: m.group(1).replace("_dot_", "."), name)
    name = re.sub(r"^[LG]\['(\w+)'\]", r"\1", name)
    return re.sub(r"\._modules\['(\w+)'\]|\._parameters\['(\w+)'\]|\._buffers\['(\w+)'\]",
                  lambda m: "." + next(g for g in m.groups() if g), name)
