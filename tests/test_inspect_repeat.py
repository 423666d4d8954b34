"""`inspect` can run any number of times on one function (Dynamo's cache lives on code objects)."""

import torch

import laplace_passes


def test_inspect_more_times_than_dynamos_recompile_limit():
    def f(q, k, v, gk):
        return laplace_passes.gla(q, k, v, gk)[0]

    q = torch.randn(1, 16, 1, 4)
    limit = 2  # Dynamo's default is 8: a lower limit shows the same in fewer (4-second) inspects
    with torch._dynamo.config.patch(recompile_limit=limit):
        for _ in range(limit + 3):
            report = laplace_passes.inspect(f, q, q, q, -q.abs(), target="cpu")
            assert [s.status for s in report.sites] == ["retiled"]
