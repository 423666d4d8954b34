"""fla's fused cross-entropy losses in standard PyTorch ops.

Per row, with l = softcap(logit_scale * logits) in fp32 (softcap(z) = c tanh(z / c)):

    lse  = logsumexp(l)
    loss = lse - (1 - s) l[target] - s mean(l) + z,   z = lse_square_scale * lse^2

(s: label smoothing); rows whose target is `ignore_index` contribute 0.
`cross_entropy_loss` returns the unreduced fp32 rows (loss including z, and
z); autograd of the formula is fla's backward exactly. The fused *linear*
cross entropy never materialises all logits at once: like fla, it walks the
rows in chunks, computing each chunk's loss and its gradients with respect to
x, the weight and the bias in the forward, and saves only those gradients
(`_LinearCrossEntropy`, an explicit backward); the optional L2-warp gradient
is added as in fla.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _transform(logits: Tensor, logit_scale: float, logit_softcapping: float | None) -> Tensor:
    z = logits.float() * logit_scale
    if logit_softcapping is not None:
        z = logit_softcapping * torch.tanh(z / logit_softcapping)
    return z


def _rows(l: Tensor, target: Tensor, label_smoothing: float, lse_square_scale: float, ignore_index: int):
    """(loss, z, lse) per row from transformed fp32 logits `l`; ignored rows are 0."""
    valid = target != ignore_index
    lse = torch.logsumexp(l, dim=-1)
    picked = l.gather(-1, torch.where(valid, target, 0)[:, None]).squeeze(-1)
    loss = lse - (1 - label_smoothing) * picked
    if label_smoothing > 0:
        loss = loss - label_smoothing * l.mean(-1)
    z = lse_square_scale * lse * lse
    zero = l.new_zeros(())
    return torch.where(valid, loss + z, zero), torch.where(valid, z, zero), lse


def cross_entropy_loss(logits, target, label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
                       logit_softcapping=None, ignore_index=-100, inplace_backward=False, process_group=None):
    """Unreduced fp32 (loss, z_loss) rows, as fla's `cross_entropy_loss`; z_loss is not differentiable."""
    _no_process_group(process_group)
    l = _transform(logits, logit_scale, logit_softcapping)
    loss, z, _ = _rows(l, target, label_smoothing, lse_square_scale, ignore_index)
    return loss, z.detach()


def _no_process_group(process_group) -> None:
    if process_group is not None:
        raise NotImplementedError("vocabulary-parallel cross entropy (process_group) has no laplace replacement")


def fused_cross_entropy_forward(self, input, target):
    """`FusedCrossEntropyLoss.forward` without its CUDA-only assertion: reduce the rows as fla does."""
    loss, z_loss = cross_entropy_loss(
        input, target, label_smoothing=self.label_smoothing, logit_scale=self.logit_scale,
        lse_square_scale=self.lse_square_scale, logit_softcapping=self.logit_softcapping,
        ignore_index=self.ignore_index, process_group=self.process_group,
    )
    if self.reduction != "none":
        loss, z_loss = loss.sum(), z_loss.sum()
        if self.reduction == "mean":
            total = (target != self.ignore_index).sum()
            loss, z_loss = loss / total, z_loss / total
    return (loss, z_loss) if self.return_z_loss else loss


def fused_linear_cross_entropy_loss(
    x, target, weight, bias=None, ignore_index=-100, label_smoothing=0.0, logit_scale=1.0, logit_softcapping=None,
    num_chunks=8, reduction="mean", use_l2warp=False, l2_penalty_factor=1e-4, accumulate_grad_in_fp32=True,
    process_group=None,
):
    """Scalar fp32 loss of `linear(x, weight, bias)` against `target` (x: [N, H]), fla's semantics."""
    _no_process_group(process_group)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    settings = (ignore_index, label_smoothing, logit_scale, logit_softcapping, num_chunks, reduction,
                use_l2warp, l2_penalty_factor, accumulate_grad_in_fp32)
    return _LinearCrossEntropy.apply(x, target, weight, bias, settings)


def fused_linear_cross_entropy_forward(self, x, target, weight, bias=None):
    """`FusedLinearCrossEntropyLoss.forward` (fla runs it outside the graph; here it is traced)."""
    return fused_linear_cross_entropy_loss(
        x.reshape(-1, x.shape[-1]), target.reshape(-1), weight, bias, ignore_index=self.ignore_index,
        label_smoothing=self.label_smoothing, logit_scale=self.logit_scale,
        logit_softcapping=self.logit_softcapping, num_chunks=self.num_chunks, reduction=self.reduction,
        use_l2warp=self.use_l2warp, l2_penalty_factor=self.l2_penalty_factor,
        accumulate_grad_in_fp32=self.accumulate_grad_in_fp32, process_group=self.process_group,
    )


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss in the forward, with the gradients it implies; the backward only scales them."""

    @staticmethod
    def forward(ctx, x, target, weight, bias, settings):
        loss, dx, dw, db = _loss_and_gradients(x, target, weight, bias, *settings)
        ctx.save_for_backward(dx, dw, db)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dx, dw, db = ctx.saved_tensors
        scale = lambda g: None if g is None else (g * grad_loss).to(g.dtype)  # noqa: E731
        return scale(dx), None, scale(dw), scale(db), None


def _chunk_rows(N: int, H: int, V: int, num_chunks: int) -> int:
    """Rows per chunk, as fla picks them: logits of one chunk about the size of x."""
    chunks = min(num_chunks, math.ceil(V / H))
    return 1 << max(0, math.ceil(math.log2(math.ceil(N / chunks))))


def _loss_and_gradients(x, target, weight, bias, ignore_index, label_smoothing, logit_scale, logit_softcapping,
                        num_chunks, reduction, use_l2warp, l2_penalty_factor, accumulate_grad_in_fp32):
    N, H = x.shape
    grad_dtype = torch.float32 if accumulate_grad_in_fp32 else weight.dtype
    valid = target != ignore_index
    total = valid.sum().clamp_min(1)
    row_weight = (1.0 / total.float()) if reduction == "mean" else x.new_ones((), dtype=torch.float32)
    losses, dxs = [], []
    dw = weight.new_zeros(weight.shape, dtype=grad_dtype)
    db = None if bias is None else bias.new_zeros(bias.shape, dtype=grad_dtype)
    rows = _chunk_rows(N, H, weight.shape[0], num_chunks)
    for start in range(0, N, rows):
        xc, tc = x[start:start + rows], target[start:start + rows]
        logits = F.linear(xc, weight, bias)
        l = _transform(logits, logit_scale, logit_softcapping)
        loss, _, lse = _rows(l, tc, label_smoothing, 0.0, ignore_index)
        dlogits = _row_gradient(logits, l, tc, lse, label_smoothing, logit_scale, logit_softcapping, ignore_index)
        dlogits = (dlogits * row_weight).to(x.dtype)
        if use_l2warp:
            dlogits = dlogits + _l2warp_gradient(logits, l2_penalty_factor / N)
        losses.append(loss)
        dxs.append(dlogits @ weight)
        dw = dw + dlogits.t().to(grad_dtype) @ xc.to(grad_dtype)
        if db is not None:
            db = db + dlogits.sum(0, dtype=grad_dtype)
    loss = torch.cat(losses).sum()
    if reduction == "mean":
        loss = loss / total
    return loss, torch.cat(dxs), dw.to(weight.dtype), None if db is None else db.to(bias.dtype)


def _row_gradient(logits, l, target, lse, label_smoothing, logit_scale, logit_softcapping, ignore_index):
    """d loss_row / d logits (fp32): softmax minus the (smoothed) target, through softcap and scale."""
    V = l.shape[-1]
    valid = target != ignore_index
    grad = torch.exp(l - lse[:, None])
    one_hot = F.one_hot(torch.where(valid, target, 0), V).to(grad.dtype)
    grad = grad - (1 - label_smoothing) * one_hot - label_smoothing / V
    if logit_softcapping is not None:
        grad = grad * (1 - torch.tanh(logits.float() * logit_scale / logit_softcapping) ** 2)
    return torch.where(valid[:, None], grad * logit_scale, grad.new_zeros(()))


def _l2warp_gradient(logits: Tensor, factor: float) -> Tensor:
    """L2-warp: push the largest logit of each row down by factor * its value (fla's `l2_warp`)."""
    largest, index = logits.max(-1, keepdim=True)
    return torch.zeros_like(logits).scatter(-1, index, largest * factor)


_OPS = "fla.modules.fused_cross_entropy.ops"
_LINEAR = "fla.modules.fused_linear_cross_entropy.ops"
SUBSTITUTES = {
    f"{_OPS}.cross_entropy_loss": cross_entropy_loss,
    f"{_LINEAR}.fused_linear_cross_entropy_loss": fused_linear_cross_entropy_loss,
}
# Module methods: Dynamo does not substitute bound methods of nn.Modules, so these replace the
# class attribute (see laplace_passes.fla.install).
METHODS = {
    f"{_OPS}.FusedCrossEntropyLoss.forward": fused_cross_entropy_forward,
    f"{_LINEAR}.FusedLinearCrossEntropyLoss.forward": fused_linear_cross_entropy_forward,
}
