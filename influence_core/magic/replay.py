"""The recipe's training replayed step by step from the initial weights, with every training example's loss weighted,
and the states kept only at checkpoints (every k-th step; k = ⌈√T⌉ unless given), recomputed in between on demand."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import grad

from .. import examples
from ..errors import ConfigError
from ..objective import Objective
from ..task import Task
from ..training import AdamRecipe
from .adam import AdamState, Tensors, adam_step


def check_replayable(model: nn.Module) -> None:
    """Refuse a model whose training step is not a function of the weights and the batch alone: dropout draws random
    masks, batch norm updates running statistics, so a replay would not retrace the training."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            raise ConfigError("model", f"module {name!r} is dropout (p={module.p}), whose random masks a replay of the training cannot retrace", "use a model without dropout (or p=0) for method magic")
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            raise ConfigError("model", f"module {name!r} is batch norm with running statistics, which training updates outside the optimiser", "use a model without batch norm (layer norm is fine) for method magic")


PROBE_ROWS = 8  # rows the randomness probe runs twice in training mode


def check_deterministic(model: nn.Module, x: Any) -> None:
    """Refuse a model whose forward pass in training mode draws random numbers (F.dropout, noise from torch.randn),
    which a replay cannot retrace: a few rows of x go through it under one seed twice and under another once, and a
    deterministic model gives the same outputs each time whatever the seed. torch's random state is left as it was."""
    first = next(model.parameters())
    rows = examples.map_inputs(examples.take(x, slice(0, PROBE_ROWS)), lambda t: _like(as_tensor(t), first))
    mode, outputs = model.training, []
    try:
        model.train()
        with torch.no_grad(), torch.random.fork_rng(devices=[first.device] if first.is_cuda else []):
            for seed in (0, 0, 1):
                torch.manual_seed(seed)
                outputs.append(_tensors(examples.call(model, rows)))
    finally:
        model.train(mode)
    scale = max((float(t.abs().max()) for t in outputs[0] if t.numel()), default=0.0)
    gap = max((float((a - b).abs().max()) for other in outputs[1:] for a, b in zip(outputs[0], other) if a.numel()), default=0.0)
    if gap > 1e-5 * scale:  # a GPU's reordered sums move outputs by far less
        raise ConfigError(
            "model", f"its forward pass in training mode is random: the same {examples.count(rows)} rows give outputs up to {gap:.3g} apart under two random seeds "
            "(dropout, e.g. F.dropout in forward, or noise drawn with torch.randn), so a replay of its training cannot retrace it",
            "set every dropout probability to 0 and remove the noise from forward for method magic, or choose another method (e.g. method.name: ekfac), which attributes the trained model in eval mode",
        )


def _like(t: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """Inputs on the parameter's device, floating ones in its dtype (integer ids stay integers)."""
    return t.to(device=parameter.device, dtype=parameter.dtype if t.is_floating_point() else t.dtype)


def _tensors(out: Any) -> list[torch.Tensor]:
    """The floating tensors of a model's output: a tensor, or those in a tuple, list or mapping (a Hugging Face output)."""
    if isinstance(out, torch.Tensor):
        return [out.detach().to(torch.float64)] if out.is_floating_point() else []
    values = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else []
    return [t for value in values for t in _tensors(value)]


def as_tensor(values: Any) -> torch.Tensor:
    """A tensor as it is; an array-like (numpy, Zarr) read whole."""
    return values if isinstance(values, torch.Tensor) else torch.from_numpy(np.asarray(values[...]))


@dataclass
class ReplayWork:
    """What a reverse pass cost: steps recomputed forward (the first pass included), steps differentiated backward,
    and the most training states held at once, in count and bytes."""

    forward_steps: int = 0
    reverse_steps: int = 0
    peak_states: int = 0
    peak_state_bytes: int = 0

    @property
    def replayed_steps(self) -> int:
        """Forward and reverse steps together: the work the pipeline's summary counts."""
        return self.forward_steps + self.reverse_steps

    def hold(self, states: int, state_bytes: int) -> None:
        self.peak_states = max(self.peak_states, states)
        self.peak_state_bytes = max(self.peak_state_bytes, states * state_bytes)


class Replay:
    """The recipe's steps over (x, y) for loss weights `w` (n,), from the model's current (initial) weights."""

    def __init__(self, model: nn.Module, task: Task, recipe: AdamRecipe, x: Any, y: Any, checkpoint_every: int | None = None) -> None:
        check_replayable(model)
        check_deterministic(model, x)
        self.objective = Objective(model, task)
        self.task, self.recipe = task, recipe
        self.x, self.y = self.objective.to_model(examples.map_inputs(x, as_tensor), as_tensor(y))
        self.n = len(self.y)
        self.rows = list(recipe.schedule(self.n).steps(recipe.epochs))
        self.every = checkpoint_every or max(1, math.ceil(math.sqrt(len(self.rows))))
        self.work = ReplayWork()

    @property
    def steps(self) -> int:
        return len(self.rows)

    def step_fn(self, t: int) -> Callable[[AdamState, torch.Tensor], AdamState]:
        """Step t (0-based) as a function of the state before it and the weights of its batch's rows."""
        rows = self.rows[t]
        xb, yb = examples.take(self.x, rows), self.y[rows]

        def weighted_loss(params: Tensors, w: torch.Tensor) -> torch.Tensor:
            return (self.task.loss(self.objective.outputs(params, xb), yb) * w).mean()

        def step(state: AdamState, w: torch.Tensor) -> AdamState:
            return adam_step(state, grad(weighted_loss)(state.params, w), self.recipe, t + 1, self.steps)

        return step

    def advance(self, state: AdamState, t: int, w: torch.Tensor) -> AdamState:
        """The state after step t, without a graph."""
        self.work.forward_steps += 1
        return self.step_fn(t)(state, w[self.rows[t]]).detached()

    def checkpoints(self, w: torch.Tensor) -> tuple[dict[int, AdamState], AdamState]:
        """The states before steps 0, k, 2k, ... and the final state."""
        state = AdamState.start(self.objective.params)
        kept: dict[int, AdamState] = {}
        for t in range(self.steps):
            if t % self.every == 0:
                kept[t] = state
                self.work.hold(len(kept), state.nbytes())
            state = self.advance(state, t, w)
        return kept, state

    def segment(self, kept: dict[int, AdamState], start: int, w: torch.Tensor) -> list[AdamState]:
        """The states before steps start..start+k-1, recomputed from the checkpoint before `start`."""
        states = [kept[start]]
        for t in range(start, min(start + self.every, self.steps) - 1):
            states.append(self.advance(states[-1], t, w))
        self.work.hold(len(kept) + len(states) - 1, states[0].nbytes())  # the segment's first state is the checkpoint
        return states
