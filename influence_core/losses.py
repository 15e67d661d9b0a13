"""Loss functions by name; every loss returns the *mean* over the batch."""

from __future__ import annotations

from typing import Callable, Literal

import torch
import torch.nn.functional as F

from .errors import ConfigError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LossName = Literal["cross_entropy", "mse"]


def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error that accepts a trailing singleton output for 1-d targets."""
    return F.mse_loss(outputs.reshape(targets.shape), targets.to(outputs.dtype))


LOSSES: dict[str, LossFn] = {"cross_entropy": F.cross_entropy, "mse": _mse}


def resolve_loss(loss: LossFn | str) -> LossFn:
    """Return the loss callable for a name, or the callable itself."""
    if callable(loss):
        return loss
    try:
        return LOSSES[loss]
    except KeyError:
        raise ConfigError("model.loss", f"unknown loss {loss!r}", f"use one of {sorted(LOSSES)}") from None
