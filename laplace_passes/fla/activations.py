"""fla's activation kernels in standard PyTorch ops.

`swish`, `sigmoid`, `logsigmoid` and `swiglu` are `torch.autograd.Function`s
in fla whose forward and backward each call one Triton kernel function
(`swish_fwd`, `swish_bwd`, ...). Those kernel functions are replaced, so
Dynamo traces fla's own autograd.Function with these bodies: the backward is
the explicit derivative written here, as in fla. `swiglu_linear`, `powglu` and
`powglu_linear` are plain functions and are replaced whole (autograd of the
formula). Everything is computed in fp32 and returned in the input's dtype,
as fla's kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _silu_and_derivative(x: Tensor) -> tuple[Tensor, Tensor]:
    """silu(x) and d silu / dx = s (1 + x (1 - s)) with s = sigmoid(x), in fp32."""
    s = torch.sigmoid(x)
    return x * s, s * (1 + x * (1 - s))


def swish_fwd(x, output_contiguous=False):
    return F.silu(x.float()).to(x.dtype)


def swish_bwd(x, dy, output_contiguous=False):
    _, derivative = _silu_and_derivative(x.float())
    return (dy.float() * derivative).to(x.dtype)


def sigmoid_fwd(x, output_contiguous=False):
    return torch.sigmoid(x.float()).to(x.dtype)


def sigmoid_bwd(x, dy, output_contiguous=False):
    s = torch.sigmoid(x.float())
    return (dy.float() * s * (1 - s)).to(x.dtype)


def logsigmoid_fwd(x, temperature=1.0, output_contiguous=False):
    return (F.logsigmoid(x.float()) / temperature).to(x.dtype)


def logsigmoid_bwd(x, dy, temperature=1.0, output_contiguous=False):
    return (dy.float() * (1 - torch.sigmoid(x.float())) / temperature).to(x.dtype)


def swiglu_fwd(x, y, output_contiguous=False):
    return (F.silu(x.float()) * y.float()).to(x.dtype)


def swiglu_fwdbwd(x, y, g, use_weight=False, output_contiguous=False):
    """Gradients of swish(x) * y for the incoming gradient g; with `use_weight` also the forward value."""
    silu, derivative = _silu_and_derivative(x.float())
    gf, yf = g.float(), y.float()
    dx = (gf * yf * derivative).to(x.dtype)
    dy = (gf * silu).to(y.dtype)
    if use_weight:
        return dx, dy, (silu * yf).to(x.dtype)
    return dx, dy


def swiglu_linear(x, y, weight, bias):
    return F.linear(swiglu_fwd(x, y), weight, bias)


def powglu(x, y, power=3.0):
    """g(x) * y with g(x) = x ** (power / (sqrt(x) + 1)) * sigmoid(x) for x > 0, x * sigmoid(x) otherwise."""
    xf = x.float()
    positive = xf > 0
    safe = torch.where(positive, xf, torch.ones_like(xf))  # log and sqrt see only positive values
    exponent = power / (torch.sqrt(safe) + 1)
    gate = torch.where(positive, torch.exp(exponent * torch.log(safe)), xf) * torch.sigmoid(xf)
    return (gate * y.float()).to(x.dtype)


def powglu_linear(x, y, weight, bias, power=3.0):
    return F.linear(powglu(x, y, power), weight, bias)


_OPS = "fla.modules.activations.ops"
SUBSTITUTES = {
    f"{_OPS}.swish_fwd": swish_fwd,
    f"{_OPS}.swish_bwd": swish_bwd,
    f"{_OPS}.sigmoid_fwd": sigmoid_fwd,
    f"{_OPS}.sigmoid_bwd": sigmoid_bwd,
    f"{_OPS}.logsigmoid_fwd": logsigmoid_fwd,
    f"{_OPS}.logsigmoid_bwd": logsigmoid_bwd,
    f"{_OPS}.swiglu_fwd": swiglu_fwd,
    f"{_OPS}.swiglu_fwdbwd": swiglu_fwdbwd,
    f"{_OPS}.swiglu_linear": swiglu_linear,
    f"{_OPS}.powglu": powglu,
    f"{_OPS}.powglu_linear": powglu_linear,
}
