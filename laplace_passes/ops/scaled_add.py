"""`laplace::add_scaled(input, other, alpha)`: ``torch.add(input, other, alpha=alpha)`` with `alpha` a 0-d tensor.

    new_param = add_scaled(param, update, neg_lr)     # neg_lr: a graph input, not a constant

Why an op: ``torch.add``'s `alpha` takes a Python number, which a compiled
graph bakes in as a constant (a new learning rate is a new graph). Written
out as ``input + other * alpha``, the graph rounds twice (the product, then
the sum) where ``torch.add(..., alpha=)`` rounds once (its CPU kernel
multiplies and adds in one fused step), so an optimizer step would differ
from the eager one in the last bit. This op runs ``torch.add`` itself,
eagerly and in any graph that executes ATen ops (aot_eager, Inductor's
fallback for ops it has no lowering for), so the numbers are
``torch.add``'s. Graphs lowered to StableHLO get ``input + other * alpha``
(`ExpandScaledAdds` in `laplace_passes/lowering/legalize.py`): a device
program has no Python op, and its rounding is the device's anyway.

`input` and `other` have one shape; the result has the dtype `torch.add`
gives them (an fp32 `input` and a bf16 `other`: fp32). `alpha` is a 0-d
floating tensor on the CPU or on `input`'s device. No gradient: it is for
optimizer steps, which run without one.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("laplace::add_scaled", mutates_args=())
def add_scaled(input: Tensor, other: Tensor, alpha: Tensor) -> Tensor:
    """``torch.add(input, other, alpha=alpha.item())``: one rounding, as the eager op."""
    _check(input, other, alpha)
    return torch.add(input, other, alpha=alpha.item())


@add_scaled.register_fake
def _add_scaled_fake(input: Tensor, other: Tensor, alpha: Tensor) -> Tensor:
    _check(input, other, alpha)
    return torch.empty_like(input, dtype=torch.result_type(input, other))


def _check(input: Tensor, other: Tensor, alpha: Tensor) -> None:
    if input.shape != other.shape or alpha.dim() != 0 or not alpha.is_floating_point():
        raise ValueError(f"laplace::add_scaled takes input and other of one shape and a 0-d floating alpha, got "
                         f"{tuple(input.shape)}, {tuple(other.shape)} and {alpha.dtype} {tuple(alpha.shape)}")


ADD_SCALED = torch.ops.laplace.add_scaled.default  # the node target in graphs
