"""A plain loss callable as a Task, and the names of the built-in tasks."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.func import vmap

from ..errors import ConfigError
from .base import Task
from .builtin import Classification, LanguageModelling, Regression

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BUILTIN: dict[str, type[Task]] = {
    "cross_entropy": Classification,
    "classification": Classification,
    "mse": Regression,
    "regression": Regression,
    "language_modelling": LanguageModelling,
}


class LossTask(Task):
    """`loss(outputs, targets)` → the batch's mean loss, as a Task: per-example losses by vmap over single examples,
    the generic exact and sampled Fisher (see Task)."""

    def __init__(self, fn: LossFn) -> None:
        self.fn = fn

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vmap(lambda o, t: self.fn(o.unsqueeze(0), t.unsqueeze(0)))(outputs, targets)

    def mean_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.fn(outputs, targets)

    def check(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        targets = targets[: len(outputs)]
        try:
            self.fn(outputs, targets)
        except (RuntimeError, IndexError, ValueError) as exc:
            raise ConfigError(
                "model",
                f"model outputs of shape {tuple(outputs.shape)} do not fit labels of shape {tuple(targets.shape)} ({exc})",
                "make the loss accept the model's outputs and the labels",
            ) from None


def resolve_task(loss: Task | LossFn | str) -> Task:
    """The Task for a Task, a built-in name ('cross_entropy' = 'classification', 'mse' = 'regression',
    'language_modelling'), or a mean-loss callable (F.cross_entropy is classification)."""
    if isinstance(loss, Task):
        return loss
    if loss is F.cross_entropy:
        return Classification()
    if callable(loss):
        return LossTask(loss)
    try:
        return BUILTIN[loss]()
    except KeyError:
        raise ConfigError("model.loss", f"unknown loss {loss!r}", f"use one of {sorted(BUILTIN)}, a Task or a loss callable") from None
