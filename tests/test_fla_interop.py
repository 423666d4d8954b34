"""flash-linear-attention calls, compiled with the laplace backend, are re-tiled and agree with fla.

On CPU only fla's `naive_*` functions run eagerly (its Triton kernels need a
GPU), so `naive_recurrent_gla` is the oracle for all three entry points: once
re-tiled, `chunk_gla` and `fused_recurrent_gla` run here too.
"""

import pytest
import torch

import laplace_passes
from tests.gla_cases import make_inputs, output_cotangents, relative_rmse

naive_module = pytest.importorskip("fla.ops.gla.naive")
fla_gla = pytest.importorskip("fla.ops.gla")


class FlaAttention(torch.nn.Module):
    """A user's module calling one of fla's GLA functions."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v, gk, h0):
        o, state = self.fn(q, k, v, gk, initial_state=h0, output_final_state=True)
        return o * 1.0, state


def run(module, inputs):
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, state = module(*leaves)
    do, dstate = output_cotangents(*inputs[0].shape, inputs[2].shape[-1])
    grads = torch.autograd.grad((o * do).sum() + (state * dstate).sum(), leaves)
    return [o, state, *grads]


FLA_FUNCTIONS = {
    "fla.naive_recurrent_gla": naive_module.naive_recurrent_gla,
    "fla.chunk_gla": fla_gla.chunk_gla,
    "fla.fused_recurrent_gla": fla_gla.fused_recurrent_gla,
}


@pytest.mark.parametrize("origin", sorted(FLA_FUNCTIONS))
def test_fla_call_is_retiled_and_matches_fla(origin):
    inputs = make_inputs(2, 256, 2, 32, 16, gate_divisor=0.1)
    expected = run(FlaAttention(naive_module.naive_recurrent_gla), inputs)
    compiled = laplace_passes.compile(FlaAttention(FLA_FUNCTIONS[origin]), target="trn2")
    actual = run(compiled, inputs)
    for name, a, e in zip(["o", "state", "dq", "dk", "dv", "dgk", "dh0"], actual, expected):
        assert relative_rmse(a, e) <= 0.005, name

    (site,) = compiled.laplace_report.sites
    assert (site.origin, site.status) == (origin, "retiled")
    assert site.plan == {"T": 256, "chunk_size": 128, "n_chunks": 2, "padding": 0}
    assert not any("fla" in str(n.target) for n in compiled.laplace_report.graph("after").graph.nodes)


def test_plain_torch_compile_after_enabling_fla_sites():
    assert "fla.naive_recurrent_gla" in laplace_passes.fx.enable_fla_sites()
    inputs = make_inputs(1, 100, 1, 8, 8)
    module = FlaAttention(naive_module.naive_recurrent_gla)
    report = laplace_passes.Report()
    # dynamic=False: this module's code was compiled at other shapes above, and
    # Dynamo would otherwise recompile with a symbolic T (a declined site).
    compiled = torch.compile(module, backend="laplace", dynamic=False, options={"target": "cpu", "report": report})
    o, state = compiled(*inputs)
    o_ref, state_ref = module(*inputs)
    assert relative_rmse(o, o_ref) < 1e-5 and relative_rmse(state, state_ref) < 1e-5
    assert [(s.origin, s.plan["n_chunks"]) for s in report.sites] == [("fla.naive_recurrent_gla", 2)]


def test_fla_default_scale_is_preserved():
    """fla's chunk_gla takes `scale`; None means K ** -0.5, an explicit value is honoured."""
    q, k, v, gk, h0 = make_inputs(1, 64, 1, 16, 8)

    def explicit(q, k, v, gk):
        return fla_gla.chunk_gla(q, k, v, gk, scale=0.5)[0]

    compiled = laplace_passes.compile(explicit, target="cpu")
    expected, _ = laplace_passes.gla(q, k, v, gk, scale=0.5)
    assert relative_rmse(compiled(q, k, v, gk), expected) < 1e-5

    def default(q, k, v, gk):
        return fla_gla.chunk_gla(q, k, v, gk)[0]

    K = q.shape[-1]
    expected, _ = laplace_passes.gla(q, k, v, gk, scale=K**-0.5)  # 0.25 here, not 0.5
    assert relative_rmse(laplace_passes.compile(default, target="cpu")(q, k, v, gk), expected) < 1e-5


@pytest.mark.parametrize("backend,origin", [("aot_eager", "fla.chunk_gla"), ("eager", "fla.fused_recurrent_gla")])
def test_another_backend_runs_the_reference_op_in_place_of_fla(backend, origin):
    """README: while installed, fla calls compiled by another backend use the replacements too.

    The graph Dynamo hands the other backend holds the `laplace::gla` op (whose
    kernel is the token recurrence) and no fla function; it runs where fla's
    Triton kernels cannot, and agrees with fla's naive_recurrent_gla.
    """
    laplace_passes.fla.install(import_fla=True)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    inputs = make_inputs(1, 24, 2, 8, 4, gate_divisor=0.5)
    actual = run(torch.compile(FlaAttention(FLA_FUNCTIONS[origin]), backend=counter, fullgraph=True), inputs)
    expected = run(FlaAttention(naive_module.naive_recurrent_gla), inputs)
    for name, a, e in zip(["o", "state", "dq", "dk", "dv", "dgk", "dh0"], actual, expected):
        assert relative_rmse(a, e) <= 1e-5, name
    (graph,) = counter.graphs
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.laplace.gla.default in targets or torch.ops.laplace.gla in targets, targets
    assert not any("fla" in getattr(t, "__module__", "") for t in targets), targets


def test_importing_laplace_passes_installs_nothing_and_the_backend_lookup_does():
    """The one moment fla's replacements go in is when a compile starts (compile_fx.prepare_to_trace)."""
    import sys

    from tests import processes

    script = (
        "import fla, torch, laplace_passes\n"
        "from laplace_passes.fla import replaced\n"
        "print(len(replaced()))\n"
        "torch.compile(lambda x: x + 1, backend='laplace')\n"
        "print(len(replaced()), 'fla.chunk_gla' in replaced())\n"
    )
    done = processes.run([sys.executable, "-c", script], timeout=120)
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split("\n")[:2]
    assert before == "0" and after.endswith(" True") and int(after.split()[0]) > 10, done.stdout
