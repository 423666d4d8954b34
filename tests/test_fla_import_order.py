"""fla imported before laplace_passes, after it, or inside a model's forward: the compile works the same.

Each case runs in a fresh interpreter (the order of first imports is the point), against fla's own
reference code: `naive_recurrent_gla` for the lazy import, eager fla with Triton's kernels swapped for
fla's references (tests/fla_family_oracle.py) for RWKV6, whose token shift fla runs outside any graph.
"""

import sys
import textwrap
from pathlib import Path

import pytest

from tests import processes

pytest.importorskip("fla.models")

ROOT = Path(__file__).resolve().parents[1]

LAZY_IMPORT = """
    import sys, torch
    import laplace_passes
    assert "fla" not in sys.modules

    class ImportsFlaInForward(torch.nn.Module):
        def forward(self, q, k, v, g):
            import fla.ops.gla as fla_gla      # first imported here, while Dynamo traces
            return fla_gla.chunk_gla(q, k, v, g)[0]

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    g = (-torch.rand(1, 40, 2, 8, generator=gen)).requires_grad_()
    compiled = torch.compile(ImportsFlaInForward(), backend="laplace", options={"target": "cpu"})
    out = compiled(q, k, v, g)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, g))

    from fla.ops.gla.naive import naive_recurrent_gla
    expected = naive_recurrent_gla(q, k, v, g)[0]
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v, g))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    report = laplace_passes.last_report()
    assert [site.status for site in report.sites] == ["retiled"], str(report)
    print("OK", report.sites[0].origin)
"""

FLA_FIRST = """
    import sys, torch
    import fla.models                      # fla before laplace_passes: its token shift is bound already
    assert "laplace_passes" not in sys.modules
    import laplace_passes, model_zoo
    from tests.fla_family_oracle import reference_kernels

    torch.manual_seed(0)
    model = model_zoo.build("fla-rwkv6-tiny")
    ids = torch.randint(0, 128, (2, 24))
    compiled = torch.compile(model, backend="laplace", options={"target": "cpu"})
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with reference_kernels():
        expected = model(input_ids=ids, labels=ids).loss
        expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-5)
    sites = laplace_passes.last_report().sites
    assert len(sites) == 2 and all(site.status == "retiled" for site in sites), sites
    print("OK", len(sites))
"""


@pytest.mark.parametrize("script", [LAZY_IMPORT, FLA_FIRST], ids=["fla-imported-in-forward", "fla-imported-first"])
def test_the_import_order_does_not_matter(script):
    result = processes.run([sys.executable, "-c", textwrap.dedent(script)], timeout=300, cwd=ROOT)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
