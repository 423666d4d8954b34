"""The op tables every pass reads (laplace_passes/infra/op_facts.py) against torch's own definitions."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from laplace_passes.infra.op_facts import (
    CASTS, MATMUL_FACTORS, VALUE_COPIES, VIEW_OPS, is_cast, is_value_copy, is_view, matmul_factors, op_name,
    overload_packet_name, short_op_name,
)

aten = torch.ops.aten


@pytest.mark.parametrize("packet", sorted(VIEW_OPS, key=str), ids=str)
def test_every_view_op_returns_an_alias_of_its_input(packet):
    schemas = [getattr(packet, name)._schema for name in packet.overloads()]
    assert any(ret.alias_info is not None for schema in schemas for ret in schema.returns), packet


@pytest.mark.parametrize("op", sorted(VALUE_COPIES, key=str), ids=str)
def test_value_copies_give_their_input_s_values(op):
    x = torch.randn(3, 4)
    assert torch.equal(op(x), x)


@pytest.mark.parametrize("op", sorted(CASTS, key=str), ids=str)
def test_casts_change_only_the_dtype(op):
    x = torch.randn(3, 4)
    cast = op(x, dtype=torch.float64) if op is aten._to_copy.default else op(x, torch.float64)
    assert cast.dtype == torch.float64 and torch.equal(cast, x.double())


def traced(fn, *inputs) -> torch.fx.GraphModule:
    return make_fx(fn)(*inputs)


@pytest.mark.parametrize("packet", sorted(MATMUL_FACTORS, key=str), ids=str)
def test_the_factor_positions_are_what_the_op_multiplies(packet):
    gen = torch.Generator().manual_seed(0)
    batched = packet in (aten.bmm, aten.baddbmm)
    a = torch.randn(*([2] if batched else []), 3, 4, generator=gen)
    b = torch.randn(*([2] if batched else []), 4, 5, generator=gen)
    bias = torch.randn(5, generator=gen)
    args = (bias, a, b) if packet in (aten.addmm, aten.baddbmm) else (a, b)
    gm = traced(lambda *xs: packet.default(*xs), *args)
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    placeholders = {n: x for n, x in zip(gm.graph.find_nodes(op="placeholder"), args)}
    first, second = (placeholders[f] for f in matmul_factors(node))
    product = packet.default(*args) - (bias if len(args) == 3 else 0)
    torch.testing.assert_close(product, first @ second)


def test_names_casts_and_views_of_a_traced_graph():
    gm = traced(lambda x: (x.t() @ x).to(torch.float64).clone().sum(), torch.randn(3, 3))
    nodes = {op_name(n): n for n in gm.graph.nodes if n.op == "call_function"}
    assert set(nodes) == {"aten.t.default", "aten.mm.default", "aten._to_copy.default", "aten.clone.default",
                          "aten.sum.default"}
    assert is_view(nodes["aten.t.default"]) and not is_view(nodes["aten.mm.default"])
    assert is_cast(nodes["aten._to_copy.default"]) and is_value_copy(nodes["aten.clone.default"])
    assert overload_packet_name(nodes["aten.mm.default"]) == "aten.mm"
    assert matmul_factors(nodes["aten.sum.default"]) is None
    assert short_op_name(nodes["aten.mm.default"]) == "mm.default"
    method = torch.fx.symbolic_trace(lambda x: x.add_(1))
    assert [short_op_name(n) for n in method.graph.nodes if n.op == "call_method"] == ["add_"]
