"""The Adam recipe: its settings, and training a model with them from its current (initial) weights."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .. import examples
from ..batches import ArrayBatches
from ..objective import Objective
from ..task import Task
from .schedule import BatchSchedule

SHUFFLE_BLOCK_ROWS = 65536  # the training set is read block by block: memory stays flat as it grows
LrDecay = Literal["constant", "linear", "cosine"]  # how the step size goes from learning_rate towards 0 (see AdamRecipe)


@dataclass(frozen=True)
class AdamRecipe:
    """torch.optim.Adam (default betas and eps) with L2 weight decay (wd·θ added to each gradient), on mini-batch mean
    losses in the seeded BatchSchedule. With W = round(warmup·T) warm-up steps of the T, step t < W has size lr·t/W
    (step 0 is exactly 0); the steps after follow the decay over the remaining T' = T − W steps, at t' = t − W: the
    step size is `learning_rate` throughout (constant), or decays from it towards 0: lr·(1 − t'/T') (linear) or
    lr·(1 + cos(πt'/T'))/2 (cosine), as Hugging Face's get_linear_schedule_with_warmup (and its cosine twin) do."""

    epochs: int
    batch_size: int
    learning_rate: float
    weight_decay: float
    seed: int
    block_rows: int = SHUFFLE_BLOCK_ROWS
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    decay: LrDecay = "constant"
    warmup: float = 0.0  # the share of the steps that warm up from a step size of exactly 0

    def warmup_steps(self, total: int) -> int:
        """W: the steps of the `total` that warm up."""
        return round(self.warmup * total)

    def schedule(self, n_rows: int) -> BatchSchedule:
        """Which rows each step takes, for a training set of n_rows."""
        return BatchSchedule(self.seed, n_rows, self.batch_size, self.block_rows)

    def steps(self, n_rows: int) -> int:
        """Optimiser steps of the whole training."""
        return self.epochs * self.schedule(n_rows).steps_per_epoch()

    def step_size(self, t: int, total: int) -> float:
        """The learning rate of step t (0-based) of `total`: one Python float, so training and MAGIC's replay use the
        same bits."""
        warm = self.warmup_steps(total)
        if t < warm:
            return self.learning_rate * t / warm
        t, total = t - warm, total - warm
        if self.decay == "linear":
            return self.learning_rate * (1 - t / total)
        if self.decay == "cosine":
            return self.learning_rate * 0.5 * (1 + math.cos(math.pi * t / total))
        return self.learning_rate


def train(model: nn.Module, task: Task, recipe: AdamRecipe, x: Any, y: Any, weights: torch.Tensor | None = None) -> None:
    """Fit the model from its current weights with the recipe, reading one block of rows at a time, and leave it in
    eval mode. `weights` (n,): each batch's loss is Σ w_i ℓ_i / batch size in the same schedule (MAGIC's
    counterfactual: weight 0 removes a row and keeps every batch); None: the task's mean loss."""
    objective = Objective(model, task)
    trained = [p for p in model.parameters() if p.requires_grad]  # frozen weights (a LoRA model's base) stay as they are
    optimiser = torch.optim.Adam(trained, lr=recipe.learning_rate, betas=recipe.betas, eps=recipe.eps, weight_decay=recipe.weight_decay)
    rows = ArrayBatches(x, y, recipe.block_rows)
    total, t = recipe.steps(len(rows)), 0
    model.train()
    for blocks in recipe.schedule(len(rows)).epochs(recipe.epochs):
        for block in blocks:
            xs, ys = objective.to_model(*rows.rows(block.start, block.stop))
            for idx in block.batches:
                optimiser.param_groups[0]["lr"], t = recipe.step_size(t, total), t + 1
                optimiser.zero_grad()
                outputs = task.output(examples.call(model, examples.take(xs, idx)))
                loss = task.mean_loss(outputs, ys[idx]) if weights is None else (task.loss(outputs, ys[idx]) * weights[block.start + idx].to(outputs)).mean()
                loss.backward()
                optimiser.step()
    model.eval()
