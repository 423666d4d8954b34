"""Models the CLI tests load through the `package.module:attr` form."""

import torch

import laplace_passes

NOT_A_MODEL = 3


def two_layer_gla():
    """A function with two GLA calls, and its example inputs."""

    def fn(q, k, v, gk):
        o, _ = laplace_passes.gla(q, k, v, gk)
        o, _ = laplace_passes.gla(o, k, v, gk)
        return o

    q = torch.randn(1, 100, 2, 8)
    return fn, (q, q.clone(), q.clone(), -q.abs())
