"""Shared helpers for tests that compile a language model: token ids, the loss, logits and gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tokens(T: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """Token ids [batch, T] of the tiny model's vocabulary (128), reproducible."""
    return torch.randint(0, 128, (batch, T), generator=torch.Generator().manual_seed(seed))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, run=None):
    """Logits and parameter gradients of `run` (default: the model itself) on `ids`."""
    model.zero_grad(set_to_none=True)
    logits = (run if run is not None else model)(ids)
    lm_loss(logits, ids).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def capture_inner():
    """An inner compiler that keeps every graph it is handed, and the list it keeps them in."""
    seen = []

    def capture(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    return capture, seen
