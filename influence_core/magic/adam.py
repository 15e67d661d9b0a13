"""One Adam step as a differentiable function of the parameters, Adam's moments and the step's loss weights: the same
operations, in the same order, as torch.optim.Adam's single-tensor step (so a replay follows the trained weights bit
for bit), out of place so that autograd and torch.func can take it apart."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..training import AdamRecipe

Tensors = dict[str, torch.Tensor]


class AdamState(NamedTuple):
    """The parameters and Adam's first and second moments after some number of steps."""

    params: Tensors
    exp_avg: Tensors
    exp_avg_sq: Tensors

    @classmethod
    def start(cls, params: Tensors) -> "AdamState":
        """The state before the first step: the initial parameters, zero moments."""
        return cls({k: p.detach().clone() for k, p in params.items()}, {k: torch.zeros_like(p) for k, p in params.items()}, {k: torch.zeros_like(p) for k, p in params.items()})

    def detached(self) -> "AdamState":
        return AdamState(*({k: t.detach() for k, t in part.items()} for part in self))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for part in self for t in part.values())


def sqrt_with_zero_slope_at_zero(v: torch.Tensor) -> torch.Tensor:
    """√v with the derivative 0 where v is 0 (a moment that never moved: its gradient is 0 there, so the subgradient is
    exact), where √'s own would be infinite and turn a zero cotangent into NaN."""
    positive = v > 0
    return torch.where(positive, torch.where(positive, v, torch.ones_like(v)).sqrt(), torch.zeros_like(v))


def adam_step(state: AdamState, grads: Tensors, recipe: AdamRecipe, step: int, total: int) -> AdamState:
    """Step number `step` (1-based) of `total` of Adam with L2 weight decay, as torch.optim.Adam takes it."""
    beta1, beta2 = recipe.betas
    bias1, bias2 = 1 - beta1 ** float(step), 1 - beta2 ** float(step)
    params, exp_avg, exp_avg_sq = {}, {}, {}
    for name, p in state.params.items():
        g = grads[name].add(p, alpha=recipe.weight_decay) if recipe.weight_decay != 0 else grads[name]
        exp_avg[name] = state.exp_avg[name].lerp(g, 1 - beta1)
        exp_avg_sq[name] = state.exp_avg_sq[name].mul(beta2).addcmul(g, g, value=1 - beta2)
        denom = (sqrt_with_zero_slope_at_zero(exp_avg_sq[name]) / bias2**0.5).add(recipe.eps)
        params[name] = p.addcdiv(exp_avg[name], denom, value=-(recipe.step_size(step - 1, total) / bias1))
    return AdamState(params, exp_avg, exp_avg_sq)
