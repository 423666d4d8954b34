"""The re-tiling pass: every GLA site becomes chunked GLA at the target's chunk size.

NOTE [retile_gla: before and after]
Before (one site, T = 2048, trn2):

    gla = torch.ops.laplace.gla.default(q, k, v, gk, None, 0.0884, 'laplace.gla')
    o = gla[0]
    state = gla[1]

After (16 chunks of 128 tokens, sub-chunks of 16; see `laplace_passes.chunked`):

    check_gates = torch.ops.laplace.check_gates.default(gk)
    view = aten.view(transpose(pad(q)), [B, H, 16, 128, K]) ...
    cumsum = aten.cumsum(gates, -2)                 # G inside each chunk
    ... sub-chunk scores, tril(A) @ V ...
    mul_15 = aten.mul(exp_last_15, add_14); add_15 = aten.add(mul_15, update_15)   # 16 state updates
    o = aten.transpose(...)
    state = add_15

Declined sites keep their `laplace::gla` node (the token recurrence: correct,
slow) and the report says why: a sequence length or head size that is not
static, inputs the op rejects, or a tuple result used as a whole.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from laplace_passes.chunked import chunk_plan, chunked_gla
from laplace_passes.fx.sites import GlaSite, bind_site, fake_value, is_gla_node, tuple_users
from laplace_passes.passes import GraphPass, PassOutcome
from laplace_passes.report import SiteRecord


class RetileGLA(GraphPass):
    """Replace each `laplace::gla` node by the chunked computation, inlined."""

    name = "retile_gla"

    def __init__(self, chunk_size: int, sub_chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.sub_chunk_size = sub_chunk_size
        # Layers share shapes: trace the chunked form once per signature.
        self._traces: dict[tuple, torch.fx.GraphModule] = {}

    def call(self, gm: torch.fx.GraphModule) -> PassOutcome:
        records, declined = [], []
        for node in [n for n in gm.graph.nodes if is_gla_node(n)]:
            # Bind just before rewriting: inlining an earlier site replaced the
            # getitem nodes a later site may read (GLA layers feed each other).
            record = self._rewrite(gm, bind_site(node))
            records.append(record)
            if record.status == "declined":
                declined.append(f"{record.node}: {record.reason}")
        retiled = sum(r.status == "retiled" for r in records)
        if records:
            gm.graph.eliminate_dead_code()
        summary = f"{retiled} of {len(records)} GLA sites re-tiled at chunk {self.chunk_size}"
        return PassOutcome(gm, modified=retiled > 0, summary=summary, declined=declined, sites=records)

    def _rewrite(self, gm: torch.fx.GraphModule, site: GlaSite) -> SiteRecord:
        record = SiteRecord(graph="", node=site.node.name, origin=site.origin, status="declined")
        values = [fake_value(n) for n in site.tensor_inputs()]
        reason = _static_shape_problem(values)
        if reason is None:
            reason = _user_problem(site.node)
        if reason is not None:
            record.reason = reason
            return record
        q, v = values[0], values[2]
        B, T, H, K = q.shape
        record.shape = {"B": B, "H": H, "K": K, "V": v.shape[-1], "dtype": str(q.dtype).removeprefix("torch.")}
        record.plan = chunk_plan(T, self.chunk_size)
        try:
            traced = self._trace(site, values)
        except (TypeError, ValueError) as error:  # the op's own argument checks
            record.reason = f"inputs rejected by chunked_gla: {error}"
            return record
        _inline(gm, site, traced)
        record.status = "retiled"
        return record

    def _trace(self, site: GlaSite, values: list) -> torch.fx.GraphModule:
        key = (tuple((tuple(t.shape), t.dtype, t.device) for t in values), site.scale)
        if key not in self._traces:
            fn = partial(
                _chunked_site,
                chunk_size=self.chunk_size,
                sub_chunk_size=self.sub_chunk_size,
                scale=site.scale,
            )
            examples = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in values]
            # Outside Dynamo's tracing context: its fake mode carries a shape
            # environment that would turn our static shapes into symbols.
            with torch._guards.tracing(None):
                self._traces[key] = make_fx(fn, tracing_mode="fake")(*examples)
        return self._traces[key]


def _chunked_site(q, k, v, gk, initial_state=None, *, chunk_size, sub_chunk_size, scale):
    o, state = chunked_gla(
        q, k, v, gk, chunk_size=chunk_size, sub_chunk_size=sub_chunk_size, scale=scale,
        initial_state=initial_state, output_final_state=True,
    )
    return o, state


def _static_shape_problem(values: list) -> str | None:
    if any(v is None for v in values):
        return "no shape information on the inputs (graph was not traced with fake tensors)"
    q = values[0]
    for name, size in zip("BTHK", q.shape):
        if not isinstance(size, int):
            return (f"{name} = {size} is dynamic; the chunk plan needs a static shape "
                    "(compile with dynamic=False or mark the dimension static)")
    return None


def _user_problem(node: torch.fx.Node) -> str | None:
    if tuple_users(node) is None:
        return "the (o, state) tuple is used as a whole, not through indexing"
    return None


def _inline(gm: torch.fx.GraphModule, site: GlaSite, traced: torch.fx.GraphModule) -> None:
    """Copy `traced` into `gm` in place of the site node."""
    graph = gm.graph
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    value_map = dict(zip(placeholders, site.tensor_inputs()))
    with graph.inserting_before(site.node):
        for node in traced.graph.nodes:
            if node.op == "get_attr":
                value_map[node] = _copy_attribute(gm, traced, node)
        outputs = graph.graph_copy(traced.graph, value_map)
    for index, user in tuple_users(site.node).items():
        user.replace_all_uses_with(outputs[index])
        graph.erase_node(user)
    graph.erase_node(site.node)


def _copy_attribute(gm: torch.fx.GraphModule, traced: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node:
    value = getattr(traced, node.target)
    name = f"_laplace_{node.target}"
    suffix = 0
    while hasattr(gm, f"{name}_{suffix}"):
        suffix += 1
    gm.register_buffer(f"{name}_{suffix}", value)
    return gm.graph.get_attr(f"{name}_{suffix}")
