"""Hyper-parameters of ShardedMuon: torch.optim.Muon's (with its checks and defaults) and AdamW's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

# torch.optim.Muon's defaults (torch/optim/_muon.py).
EPS = 1e-7
DEFAULT_A = 3.4445
DEFAULT_B = -4.7750
DEFAULT_C = 2.0315
DEFAULT_NS_STEPS = 5

# torch.optim.AdamW's defaults, used for non-2D parameters.
ADAMW_DEFAULTS = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 1e-2,
    "amsgrad": False,
}

# A param group's Muon settings, in the order `check_muon_hparams` takes them.
MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")


class StepSizes(NamedTuple):
    """The numbers one Muon step scales by, as torch.optim.Muon computes them from a group's settings.

    NOTE [step sizes are inputs of the compiled step]
    These are what a schedule changes between steps (learning rate, weight
    decay, momentum). `ShardedMuon` hands them to its compiled shard step as
    one float32 tensor, a graph input, so a new learning rate runs the same
    compiled graph instead of recompiling it (and, past Dynamo's recompile
    limit, running uncompiled). float32 holds each exactly as torch.optim.Muon's
    eager ops use it: they cast the Python float to float32 before using it
    (a float32 Tensor lr: torch.optim.Muon computes its step sizes in float32,
    and so does `MuonHParams.of`).
    Everything else (Nesterov, Newton-Schulz's coefficients, steps and eps,
    the shapes) stays a constant of the graph.
    """

    one_minus_momentum: Any  # momentum buffer: buf.lerp(grad, 1 - momentum)
    momentum: Any  # Nesterov: grad.lerp(buf, momentum)
    decay: Any  # param * (1 - lr * weight_decay)
    neg_adjusted_lr: Any  # param + (-adjusted_lr) * update


@dataclass(frozen=True)
class MuonConstants:
    """What a compiled shard step is specialised on when its step sizes are inputs (`StepSizes`)."""

    nesterov: bool
    ns_coefficients: tuple[float, float, float]
    ns_steps: int
    eps: float


@dataclass(frozen=True)
class MuonHParams:
    """Hyper-parameters of one Muon matrix (from its param group)."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_coefficients: tuple[float, float, float]
    ns_steps: int
    eps: float
    adjusted_lr: float
    # 1 - lr * weight_decay where it is not that product in Python floats (a Tensor lr); None: computed from them.
    decay: float | None = None

    @classmethod
    def of(cls, group: dict[str, Any], rows: int, cols: int) -> MuonHParams:
        """The settings of a rows x cols matrix in param group `group`.

        A Tensor lr stays a 0-d tensor in torch.optim.Muon (``_to_scalar``), so ``1 - lr * weight_decay`` and
        ``lr * adjust_ratio`` are computed in the tensor's dtype (float32 for a float32 lr), then used as
        numbers: they are computed here with the same tensor ops, then kept as the Python floats they equal.
        """
        lr = group["lr"]
        weight_decay = group["weight_decay"]
        if isinstance(lr, Tensor):
            lr = lr.detach().squeeze()
            decay = float(1 - lr * weight_decay)
        else:
            lr, decay = float(lr), None
        return cls(
            lr=float(lr),
            weight_decay=weight_decay,
            momentum=group["momentum"],
            nesterov=bool(group["nesterov"]),
            ns_coefficients=tuple(group["ns_coefficients"]),
            ns_steps=group["ns_steps"],
            eps=group["eps"],
            adjusted_lr=float(adjust_lr(lr, group["adjust_lr_fn"], rows, cols)),
            decay=decay,
        )

    def step_sizes(self) -> StepSizes:
        """This matrix's step sizes as Python floats, computed as torch.optim.Muon computes them."""
        decay = 1 - self.lr * self.weight_decay if self.decay is None else self.decay
        return StepSizes(1 - self.momentum, self.momentum, decay, -self.adjusted_lr)

    def constants(self) -> MuonConstants:
        """The settings that stay constants of a compiled step whose step sizes are inputs."""
        return MuonConstants(self.nesterov, self.ns_coefficients, self.ns_steps, self.eps)


def adjust_lr(lr: float | Tensor, adjust_lr_fn: str | None, rows: int, cols: int) -> float | Tensor:
    """torch.optim.Muon's learning-rate adjustment for a (rows, cols) matrix (a 0-d tensor for a Tensor lr)."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def check_muon_hparams(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn) -> None:
    # torch.optim.Muon's checks ...
    _check_lr_and_decay(lr, weight_decay, "Tensor lr must be 1-element", "Learning rate should be >= 0 but is: {}",
                        "weight decay should be >= 0 but is: {}")
    if not 0.0 <= momentum:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if adjust_lr_fn is not None and adjust_lr_fn not in ["original", "match_rms_adamw"]:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
    # ... and the ones it only makes inside the step (here: before any
    # communication, so a bad value cannot fail one rank mid-step).
    if not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(f"ns_steps must be an int in [0, 100), got {ns_steps!r}")
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(f"ns_coefficients must be 3 values (a, b, c), got {ns_coefficients!r}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")


def check_adamw_hparams(lr, betas, eps, weight_decay, amsgrad) -> None:
    """torch.optim.AdamW's checks, with "AdamW:" in front."""
    _check_lr_and_decay(lr, weight_decay, "AdamW: Tensor lr must be 1-element", "AdamW: invalid learning rate: {}",
                        "AdamW: invalid weight_decay value: {}")
    if not 0.0 <= eps:
        raise ValueError(f"AdamW: invalid epsilon value: {eps}")
    if len(tuple(betas)) != 2:
        raise ValueError(f"AdamW: betas must be a pair, got {betas!r}")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"AdamW: invalid beta parameter at index {index}: {beta}")
    if not isinstance(amsgrad, bool):
        raise ValueError(f"AdamW: amsgrad must be a bool, got {amsgrad!r}")


def _check_lr_and_decay(lr, weight_decay, tensor_lr: str, bad_lr: str, bad_decay: str) -> None:
    """What Muon and AdamW both check, each with torch's own words for it."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(tensor_lr)
    if not 0.0 <= lr:
        raise ValueError(bad_lr.format(lr))
    if not 0.0 <= weight_decay:
        raise ValueError(bad_decay.format(weight_decay))


def adamw_settings(adamw_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """AdamW's defaults updated with `adamw_kwargs`, checked (unknown keys are a TypeError)."""
    adamw = dict(ADAMW_DEFAULTS)
    if adamw_kwargs is not None:
        if not isinstance(adamw_kwargs, dict):
            raise TypeError(f"ShardedMuon: adamw_kwargs must be a dict, got {type(adamw_kwargs).__name__}")
        unknown = sorted(set(adamw_kwargs) - set(ADAMW_DEFAULTS))
        if unknown:
            raise TypeError(f"ShardedMuon: unknown adamw_kwargs {unknown}; accepted: {sorted(ADAMW_DEFAULTS)}")
        adamw.update(adamw_kwargs)
    adamw["betas"] = tuple(adamw["betas"])
    check_adamw_hparams(**adamw)
    return adamw


def check_group(group: dict[str, Any]) -> None:
    """A param group's settings (Muon's and AdamW's), as `ShardedMuon.add_param_group` receives them."""
    check_muon_hparams(*(group[k] for k in MUON_KEYS))
    check_adamw_hparams(group["adamw_lr"], group["adamw_betas"], group["adamw_eps"],
                        group["adamw_weight_decay"], group["adamw_amsgrad"])
    use_muon = group["use_muon"]
    if use_muon not in (None, True, False):
        raise ValueError(f"ShardedMuon: use_muon must be None, True or False, got {use_muon!r}")
