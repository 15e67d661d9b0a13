"""The reverse pass: d(measurement_q)/d(w_i) for a block of queries q and every training example i, carried back
through every Adam step (parameters and both moments) with the block's cotangents batched by vmap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import grad, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import examples
from ..task import Task
from ..training import AdamRecipe
from .adam import AdamState, Tensors
from .replay import Replay, ReplayWork, as_tensor


@dataclass
class Metagradients:
    """`scores` (Q, n): −n·d(measurement_q)/d(w_i), so positive means helpful and removing i raises query q's
    measurement by about score/n; `final`: the trained parameters the replay reached; `work`: what it cost."""

    scores: torch.Tensor
    final: Tensors
    work: ReplayWork


def metagradients(
    model: nn.Module, task: Task, recipe: AdamRecipe, x: Any, y: Any, x_query: Any, y_query: Any, checkpoint_every: int | None = None,
) -> Metagradients:
    """MAGIC scores of the queries for the training of `model` (at its initial weights) by `recipe` on (x, y), all
    loss weights 1: one forward pass keeping checkpoints, then one reverse pass replaying each segment between them.
    The model is left untouched. The states are the trained run's own (the default attention kernels); each step is
    differentiated on the math kernel, as the fused ones have no second derivative."""
    replay = Replay(model, task, recipe, x, y, checkpoint_every)
    w = torch.ones(replay.n, dtype=replay.objective.space.dtype, device=replay.objective.space.device)
    kept, final = replay.checkpoints(w)
    measured = _measurement_grads(replay, final.params, x_query, y_query)
    queries = len(next(iter(measured.values())))
    adjoint = AdamState(measured, _zeros(final.exp_avg, queries), _zeros(final.exp_avg_sq, queries))  # the moments do not reach the measurement
    dw = torch.zeros(queries, replay.n, dtype=w.dtype, device=w.device)
    for start in reversed(range(0, replay.steps, replay.every)):
        states = replay.segment(kept, start, w)
        for t in reversed(range(start, start + len(states))):
            rows = replay.rows[t]
            with sdpa_kernel(SDPBackend.MATH):
                _, pullback = vjp(replay.step_fn(t), states.pop(), w[rows])
                adjoint, dw_rows = vmap(pullback)(adjoint)
            dw.index_add_(1, rows.to(dw.device), dw_rows)
            replay.work.reverse_steps += 1
        del kept[start]
    return Metagradients(-replay.n * dw, final.params, replay.work)


def _measurement_grads(replay: Replay, params: Tensors, x_query: Any, y_query: Any) -> Tensors:
    """∇θ of each query's measurement (summed over its positions) at the trained parameters: (Q, ...) per parameter."""
    objective, task = replay.objective, replay.task
    xq, yq = objective.to_model(examples.map_inputs(x_query, as_tensor), as_tensor(y_query))

    def measurement(p: Tensors, xi: Any, yi: torch.Tensor) -> torch.Tensor:
        return task.measurement(objective.outputs(p, examples.single(xi)), yi.unsqueeze(0)).sum()

    return vmap(grad(measurement), in_dims=(None, 0, 0))(params, xq, yq)


def _zeros(part: Tensors, queries: int) -> Tensors:
    return {k: torch.zeros(queries, *t.shape, dtype=t.dtype, device=t.device) for k, t in part.items()}
