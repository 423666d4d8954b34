"""Which tensors a node of an FX graph writes in place, and which memory they share.

A proof about a value read off the graph (NOTE [gates proven <= 0]) holds
for the value the graph computed, not for what a later in-place write leaves
in its memory: after ``g = F.logsigmoid(x); g.view(-1).add_(5.0)`` Dynamo
still hands the GLA op the node ``g``. The writes come in many spellings,
and Dynamo graphs, AOT graphs and make_fx graphs use different ones:

    call_method   add_, copy_, ... (a name ending in one "_"), __setitem__, __iadd__, ...
    call_function operator.setitem, operator.iadd, ...; torch.relu_ and other names
                  ending in one "_"; out=...; inplace=True; an OpOverload whose
                  schema marks an argument written (aten.copy_, aten.index_put_, ...)
    call_module   a module may write to any of its inputs

Which tensors alias which is read off the nodes' fake tensors, whose views
(and ``.data``) share their base's fake storage.
"""

from __future__ import annotations

import inspect
import itertools
import operator
from typing import Iterable, Iterator

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from laplace_passes.infra.fx_helpers import fake_tensor, fake_value, input_source, tensor_values
from laplace_passes.infra.op_facts import base_op_name, tensor_method_name

_IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift, operator.imatmul,
})
_OPERATOR_MODULES = frozenset({operator.__name__, operator.not_.__module__})  # "operator", "_operator"
_IN_PLACE_DUNDERS = frozenset(f"__{op.__name__}__" for op in _IN_PLACE_OPERATORS)


def written_operands(node: torch.fx.Node) -> list:
    """The arguments of `node` it writes in place (nodes, or other values when it writes to those)."""
    written = list(tree_leaves(node.kwargs["out"])) if node.kwargs.get("out") is not None else []
    if node.op == "call_module":
        return written + list(node.all_input_nodes)
    if node.op == "call_method":
        if _in_place_name(node.target):
            written.extend(_named_op_writes(node, node.target))
        elif node.target in _IN_PLACE_DUNDERS:
            written.append(node.args[0])
        return written
    if node.op != "call_function":
        return written
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return written + _schema_writes(node, target._schema)
    # operator.not_, and_, or_, is_ end in "_" for being keywords, not for writing: of the operator
    # module only the augmented assignments and setitem write.
    name = "" if getattr(target, "__module__", None) in _OPERATOR_MODULES else getattr(target, "__name__", "")
    if _in_place_name(name):
        return written + _named_op_writes(node, getattr(target, "_qualified_op_name", f"aten::{name}"))
    # torch.Tensor.__iadd__(g, x), as a pass may write it, writes g as ``g += x`` does.
    if target in _IN_PLACE_OPERATORS or _asks_in_place(node) or tensor_method_name(target) in _IN_PLACE_DUNDERS:
        written.extend(tree_leaves(node.args[0] if node.args else node.kwargs.get("input")))
    return written


def is_tensor_free(value) -> bool:
    """Whether `value` (a node) is known to hold no tensor (a SymBool, SymInt, number): nothing to alias."""
    fake = fake_value(value) if isinstance(value, torch.fx.Node) else value
    return fake is not None and not tensor_values(fake)


def storage_of(value) -> StorageWeakRef | None:
    """The memory `value` (a node) lives in, by its fake tensor; None when unknown."""
    fake = fake_tensor(value)
    if fake is None:
        return None
    try:
        return StorageWeakRef(fake.untyped_storage())
    except (NotImplementedError, RuntimeError):  # a tensor subclass without a storage
        return None


def in_place_writes(nodes: Iterable[torch.fx.Node]) -> Iterator[tuple[torch.fx.Node, torch.fx.Node, StorageWeakRef | None]]:
    """(writer, written, the written memory or None when unknown) for each tensor node one of `nodes` writes in
    place."""
    for node in nodes:
        for written in written_operands(node):
            if isinstance(written, torch.fx.Node) and not is_tensor_free(written):
                yield node, written, storage_of(written)


def written_from_outside(region: set[torch.fx.Node], before: torch.fx.Node,
                         sources: Iterable[torch.fx.Node] = ()) -> str | None:
    """Why the values of `region` are not what its nodes compute: a node outside it, before `before` in graph
    order, writes in place to memory a node of `region` lives in (`m[i, j] = False` on a mask after it is
    built, `D.masked_fill_(...)` whose result nothing reads); None when none does. A write the region reads
    as a value (`(q @ k^T).masked_fill_(m, 0)` read on) is its own. Memory of `sources` (read at run time, not
    from how it was built) is left to `written_while_read`."""
    theirs = {storage for s in sources if (storage := storage_of(s)) is not None}
    owned = {storage for node in region if (storage := storage_of(node)) is not None and storage not in theirs}
    earlier = itertools.takewhile(lambda n: n is not before, before.graph.nodes)
    for node, written, storage in in_place_writes(n for n in earlier if n not in region):
        if storage is not None and storage in theirs:
            continue
        if written in region or (storage is not None and storage in owned):
            return f"{node.name} writes in place to {_named(written)} before it is read"
    return None


def written_while_read(region: set[torch.fx.Node], sources: set[torch.fx.Node], anchor: torch.fx.Node) -> str | None:
    """Why a rewrite of `region` that reads `sources` just before `anchor` would not see what the region read:
    a node outside `region` writes in place to a source's memory between two of the reads that must agree, the
    region's reads of that memory and the rewrite's at `anchor` (`g.mul_(2)` after D is built from g, after a
    token loop and before its stacked outputs are read, or halfway through a loop whose steps are read one by
    one); None when none does. A write before every read, or after, is seen alike."""
    nodes = list(anchor.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    spans = _spans_read(region, sources, position)
    if not spans:
        return None
    for span in spans.values():  # the GLA call's own read, at the anchor
        span[0], span[1] = min(span[0], position[anchor]), max(span[1], position[anchor])
    first, last = min(lo for lo, _ in spans.values()), max(hi for _, hi in spans.values())
    between = (n for n in nodes[first + 1 : last] if n not in region)
    for node, written, storage in in_place_writes(between):
        span = spans.get(_memory(written, storage))
        if span is not None and span[0] < position[node] < span[1]:
            return f"{node.name} writes in place to {_named(written)} while it is read"
    return None


def _memory(node: torch.fx.Node, storage: StorageWeakRef | None) -> tuple:
    """What a node's value lives in, as a key: its memory when known, else the node itself."""
    return ("storage", storage) if storage is not None else ("node", node)


# Ops that read a tensor's shape, dtype or device only: `q.new_zeros(...)` before a loop does not read q's values.
_METADATA_READS = frozenset({
    "new_zeros", "new_ones", "new_empty", "new_full", "size", "dim", "numel", "zeros_like", "ones_like",
    "empty_like", "full_like", "sym_size", "sym_numel", "sym_stride", "stride", "storage_offset",
})


def _reads_values(node: torch.fx.Node) -> bool:
    """Whether `node` reads its inputs' values, not only their shapes (`_METADATA_READS`, `getattr(x, "shape")`)."""
    return base_op_name(node) not in _METADATA_READS and not (node.op == "call_function" and node.target is getattr)


def _spans_read(region: set[torch.fx.Node], sources: set[torch.fx.Node], position: dict) -> dict[tuple, list[int]]:
    """For each source's memory, the first and last positions at which a node of `region` reads it (directly or
    through a view)."""
    memories = {_memory(s, storage_of(s)) for s in sources}
    spans: dict[tuple, list[int]] = {}
    for node in filter(_reads_values, region):
        for read in node.all_input_nodes:
            memory = _memory(read, storage_of(read))
            if memory in memories:
                span = spans.setdefault(memory, [position[node], position[node]])
                span[0], span[1] = min(span[0], position[node]), max(span[1], position[node])
    return spans


def _named(written: torch.fx.Node) -> str:
    """The written tensor as the user named it, and the view written through: "g (through getitem_100)"."""
    base = _base(written)
    name = input_source(base) if base.op == "placeholder" else base.name  # "self.gamma", not l_self_buffers_gamma_
    return name if base is written else f"{name} (through {written.name})"


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory `node` views (`g` for `g[:, 3:]`, `g.view(-1)`, `g.data`): what the user named."""
    storage = storage_of(node)
    while storage is not None and node.args and isinstance(node.args[0], torch.fx.Node) \
            and storage_of(node.args[0]) == storage:
        node = node.args[0]
    return node


def owns_its_memory(node: torch.fx.Node) -> bool:
    """Whether `node`'s value lives in memory of its own: not a view, not the storage of any of its inputs
    (an in-place op's value is its input's memory)."""
    value, storage = fake_tensor(node), storage_of(node)
    if value is None or storage is None or value._is_view():  # a view (of an unbind's tuple too) is its base's
        return False
    others = (storage_of(i) for i in node.all_input_nodes)
    return all(other is None or not other == storage for other in others)


def _in_place_name(name) -> bool:
    """`add_`, `relu_`, `_foreach_mul_`: PyTorch's spelling of an in-place op (a dunder is not one)."""
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def _asks_in_place(node: torch.fx.Node) -> bool:
    """`F.relu(x, inplace=True)`, `F.dropout(x, 0.1, True, True)`: an `inplace` argument set."""
    if node.kwargs.get("inplace") is True:
        return True
    signature = _signature_with_inplace(node.target)
    if signature is None:
        return False
    try:
        return signature.bind(*node.args, **node.kwargs).arguments.get("inplace") is True
    except TypeError:  # arguments the function would not take: Dynamo does not record such a call
        return False


_SIGNATURES: dict = {}


def _signature_with_inplace(target) -> inspect.Signature | None:
    """`target`'s signature when it has an `inplace` parameter; looked up once per target (graphs are large)."""
    key = id(target)
    if key not in _SIGNATURES:
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):  # a builtin without a signature
            signature = None
        keep = signature is not None and "inplace" in signature.parameters
        _SIGNATURES[key] = (target, signature if keep else None)  # the target kept alive: its id stays unique
    return _SIGNATURES[key][1]


def _named_op_writes(node: torch.fx.Node, name: str) -> list:
    """What an in-place op called by name (`torch._foreach_mul_`, `x.add_`) writes: every argument any
    of the ATen op's overloads marks written (`_amp_foreach_non_finite_check_and_unscale_` writes its
    tensor list and `found_inf`), each tensor of a list or tuple; its first argument when no ATen op
    has the name (a module's own `scale_`)."""
    qualified = name if "::" in name else f"aten::{name}"
    written_arguments = {(index, argument.name)
                         for schema in _schemas(qualified)
                         for index, argument in enumerate(schema.arguments)
                         if argument.alias_info is not None and argument.alias_info.is_write}
    if not written_arguments:
        written_arguments = {(0, "self")}
    written = []
    for index, argument_name in sorted(written_arguments):
        value = node.args[index] if index < len(node.args) else node.kwargs.get(argument_name)
        if value is None and index == 0:
            value = node.kwargs.get("input")
        written.extend(tree_leaves(value))
    return written


_SCHEMAS: dict = {}


def _schemas(qualified_name: str) -> list:
    if qualified_name not in _SCHEMAS:
        try:
            _SCHEMAS[qualified_name] = torch._C._jit_get_schemas_for_operator(qualified_name)
        except RuntimeError:  # no such operator
            _SCHEMAS[qualified_name] = []
    return _SCHEMAS[qualified_name]


def _schema_writes(node: torch.fx.Node, schema) -> list:
    written = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
        written.extend(tree_leaves(value))
    return written
