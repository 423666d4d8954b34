"""fla's normalisation kernels in standard PyTorch ops.

fla's `RMSNorm`, `LayerNorm`, `GroupNorm` and `FusedRMSNormGated` /
`FusedLayerNormGated`, and the norm-then-linear forms (`rms_norm_linear`,
`rms_norm_swish_gate_linear`: HGRN2's, LightNet's and GSA's output
projections), call one Triton kernel family with options: a residual
added first (the "prenorm" form returns the sum as the new residual), the
residual kept in fp32, groups, and a swish or sigmoid output gate. Their
arithmetic, read from the kernels: everything in fp32; the residual sum is
normalised before it is rounded to the residual's dtype; the output is cast to
x's dtype.

Autograd of these formulas is exact and as stable as fla's explicit backward
(every step is a smooth fp32 function of its inputs), so no hand-written
backward is needed here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    eps: float,
    is_rms_norm: bool,
    residual: Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    num_groups: int = 1,
    gate: Tensor | None = None,
    activation: str | None = None,
):
    """fla's fused (residual +) norm (* gate); returns y, or (y, new residual) when `prenorm`."""
    summed = x.float() if residual is None else x.float() + residual.float()
    if residual is not None:
        new_residual = summed.to(residual.dtype)
    elif residual_in_fp32:
        new_residual = summed
    else:
        new_residual = x  # fla hands x itself back when nothing was added
    y = _normalise(summed, weight, bias, eps, is_rms_norm, num_groups)
    if gate is not None:
        y = y * _gate_factor(gate.float(), activation)
    y = y.to(x.dtype)
    return (y, new_residual) if prenorm else y


def _normalise(x: Tensor, weight, bias, eps: float, is_rms_norm: bool, num_groups: int) -> Tensor:
    shape = x.shape
    if x.shape[-1] % num_groups:
        raise ValueError(f"num_channels {x.shape[-1]} must be divisible by num_groups {num_groups}")
    x = x.unflatten(-1, (num_groups, shape[-1] // num_groups))
    if not is_rms_norm:
        x = x - x.mean(-1, keepdim=True)
    y = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)).flatten(-2)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


def _gate_factor(g: Tensor, activation: str | None) -> Tensor:
    if activation in ("swish", "silu"):
        return F.silu(g)
    if activation == "sigmoid":
        return torch.sigmoid(g)
    raise ValueError(f"unsupported gate activation {activation!r}: fla's gated norms take swish, silu or sigmoid")


# Substitutes, with the signatures of fla 0.6.0's functions (fla.modules.norm).

def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    return norm(x, weight, bias, eps=eps, is_rms_norm=True, residual=residual, prenorm=prenorm,
                residual_in_fp32=residual_in_fp32)


def layer_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, is_rms_norm=False):
    return norm(x, weight, bias, eps=eps, is_rms_norm=is_rms_norm, residual=residual, prenorm=prenorm,
                residual_in_fp32=residual_in_fp32)


def group_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False,
               is_rms_norm=False, num_groups=1):
    return norm(x, weight, bias, eps=eps, is_rms_norm=is_rms_norm, residual=residual, prenorm=prenorm,
                residual_in_fp32=residual_in_fp32, num_groups=num_groups)


def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                   eps=1e-6):
    return norm(x, weight, bias, eps=eps, is_rms_norm=True, residual=residual, prenorm=prenorm,
                residual_in_fp32=residual_in_fp32, gate=g, activation=activation)


def layer_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                     eps=1e-6):
    return norm(x, weight, bias, eps=eps, is_rms_norm=False, residual=residual, prenorm=prenorm,
                residual_in_fp32=residual_in_fp32, gate=g, activation=activation)


def _then_linear(normed, linear_weight, linear_bias, prenorm: bool):
    """fla's norm-then-linear kernels: the weights cast to the norm output's dtype (as without autocast)."""
    y, new_residual = normed
    out = F.linear(y, linear_weight.to(y.dtype), None if linear_bias is None else linear_bias.to(y.dtype))
    return (out, new_residual) if prenorm else out


def layer_norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-5,
                      prenorm=False, residual_in_fp32=False, is_rms_norm=False, num_groups=1):
    normed = norm(x, norm_weight, norm_bias, eps=eps, is_rms_norm=is_rms_norm, residual=residual, prenorm=True,
                  residual_in_fp32=residual_in_fp32, num_groups=num_groups)
    return _then_linear(normed, linear_weight, linear_bias, prenorm)


def rms_norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-5,
                    prenorm=False, residual_in_fp32=False):
    return layer_norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, residual, eps, prenorm,
                             residual_in_fp32, is_rms_norm=True)


def layer_norm_swish_gate_linear(x, g, norm_weight, norm_bias, linear_weight, linear_bias, residual=None,
                                 prenorm=False, residual_in_fp32=False, eps=1e-6):
    normed = norm(x, norm_weight, norm_bias, eps=eps, is_rms_norm=False, residual=residual, prenorm=True,
                  residual_in_fp32=residual_in_fp32, gate=g, activation="swish")
    return _then_linear(normed, linear_weight, linear_bias, prenorm)


def rms_norm_swish_gate_linear(x, g, norm_weight, norm_bias, linear_weight, linear_bias, residual=None,
                               prenorm=False, residual_in_fp32=False, eps=1e-6):
    normed = norm(x, norm_weight, norm_bias, eps=eps, is_rms_norm=True, residual=residual, prenorm=True,
                  residual_in_fp32=residual_in_fp32, gate=g, activation="swish")
    return _then_linear(normed, linear_weight, linear_bias, prenorm)


SUBSTITUTES = {
    "fla.modules.norm.layernorm.layer_norm_linear": layer_norm_linear,
    "fla.modules.norm.layernorm.rms_norm_linear": rms_norm_linear,
    "fla.modules.norm.fused_norm_gate.layer_norm_swish_gate_linear": layer_norm_swish_gate_linear,
    "fla.modules.norm.fused_norm_gate.rms_norm_swish_gate_linear": rms_norm_swish_gate_linear,
    "fla.modules.norm.layernorm.rms_norm": rms_norm,
    "fla.modules.norm.layernorm.layer_norm": layer_norm,
    "fla.modules.norm.layernorm.group_norm": group_norm,
    "fla.modules.norm.fused_norm_gate.rms_norm_gated": rms_norm_gated,
    "fla.modules.norm.fused_norm_gate.layer_norm_gated": layer_norm_gated,
}
