"""The GLA language model with its recurrence written in plain PyTorch: "your model, unchanged".

`model_zoo.build("plain-tiny")` is `tiny` (same layers, same parameter names
and initialisation, so one's weights load into the other) whose attention
computes GLA as a team porting its own model would write it first: a
`torch._higher_order_ops.scan` over the tokens carrying the state
S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t, with the readout o_t = scale q_t S_t.
Nothing in its forward calls this project: under `torch.compile(backend=
"laplace")` the recognition pass finds each layer's loop by what it
computes and makes it a GLA site (docs/DESIGN.md section 3.8).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._higher_order_ops.scan import scan

from model_zoo.gla_lm import GatedLinearAttention, GLAConfig, GLALM


def scanned_gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial_state: Tensor | None = None):
    """GLA as a scan over tokens: q, k, g [B, T, H, K], v [B, T, H, V] -> (o [B, T, H, V], final state fp32)."""
    B, T, H, K = q.shape
    state = q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32) if initial_state is None else initial_state.float()

    def step(S, xs):
        q_t, k_t, v_t, g_t = xs
        S = S * g_t.exp()[..., None] + k_t[..., :, None] * v_t[..., None, :]
        return S, (q_t[..., :, None] * S).sum(-2) * K ** -0.5

    per_token = [x.float().movedim(1, 0) for x in (q, k, v, g)]
    state, o = scan(step, state, per_token)
    return o.movedim(0, 1).to(q.dtype), state


class PlainGatedLinearAttention(GatedLinearAttention):
    """`GatedLinearAttention` whose recurrence is `scanned_gla`: the same layer in plain PyTorch."""

    def recurrence(self, q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Tensor | None,
                   output_final_state: bool) -> tuple[Tensor, Tensor | None]:
        o, state = scanned_gla(q, k, v, gk, initial_state)
        return o, (state if output_final_state else None)


class PlainGLALM(GLALM):
    """`GLALM` with every layer's attention a `PlainGatedLinearAttention`."""

    def __init__(self, config: GLAConfig, **kwargs) -> None:
        super().__init__(config, **kwargs)
        for layer in self.layers:
            plain = PlainGatedLinearAttention.__new__(PlainGatedLinearAttention)
            plain.__dict__.update(layer.attn.__dict__)  # the same submodules and parameters, another forward
            layer.attn = plain
