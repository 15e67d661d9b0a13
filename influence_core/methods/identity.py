"""Gradient dot products: the curvature replaced by the identity (TracIn-style, no λ, no fitting)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks import BlockCurvature
from ..self_influence import SelfInfluencePlan, Sketch
from .influence_model import BlockSolver, InfluenceFunctionModel
from .options import MethodOptions, ProjectedOptions


@dataclass(frozen=True, kw_only=True)
class IdentityOptions(MethodOptions, ProjectedOptions):
    """No λ and no curvature options: there is no curvature."""


class IdentitySolver(BlockSolver):
    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        return features


class IdentityInfluence(InfluenceFunctionModel):
    """score = ∇ℓ(z_t)ᵀ ∇ℓ(z_i). Cheapest baseline; ignores curvature, so it over-weights high-curvature directions.

    Documented agreement (Pearson with layer-wise Direct Gauss-Newton, tests/unit/test_methods.py): ≥ 0.89 when
    λ = 10·trace(C)/p dominates the curvature; 0.2-0.96 at λ = 0.01·trace(C)/p.
    """

    name = "identity"
    title = "Gradient dot product"
    summary = "Gradient dot product: no curvature."
    Options = IdentityOptions

    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        return IdentitySolver(curvature, lam)

    def _exact_self_plan(self) -> SelfInfluencePlan:
        """‖∇ℓ(z_i)‖²: a sketch with no rows and the identity on everything else."""
        blocks = len(self.solvers)
        return Sketch(torch.zeros(0, self.feature_dim), torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.ones(blocks, dtype=torch.float64))
