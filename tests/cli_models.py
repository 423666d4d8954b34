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


def spectrum():
    """An op torch-mlir has no lowering for (an FFT), and its example input."""
    return (lambda x: torch.fft.rfft(x).abs()), (torch.randn(2, 8),)


def branch():
    """A torch.cond between two functions of x: control flow, which torch-mlir does not lower."""

    def fn(x):
        return torch.cond(x.sum() > 0, lambda x: x * 2, lambda x: x - 1, (x,))

    return fn, (torch.randn(2, 8),)


def no_tensor_work():
    """A function Dynamo runs without compiling a graph (it computes nothing on tensors)."""
    return (lambda x: None), (torch.randn(3),)
