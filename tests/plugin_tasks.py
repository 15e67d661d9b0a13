"""Tasks the pipeline's tests name by dotted path (`model.task_class: tests.plugin_tasks:...`)."""

from __future__ import annotations

import torch

from influence_core.task import Classification


class WeightedClassification(Classification):
    """Cross-entropy weighted per class (a task the built-ins do not offer): each example's loss, and so its
    measurement, is scaled by its label's weight."""

    def __init__(self, weights: list[float]) -> None:
        super().__init__()
        self.weights = torch.tensor(weights)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().loss(outputs, targets) * self.weights.to(outputs)[targets]


class BatchMeanLoss(Classification):
    """A mistake issue 35 met: the loss of the whole batch (one scalar), not one value per example."""

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().loss(outputs, targets).mean()


def not_a_task() -> object:
    return object()
