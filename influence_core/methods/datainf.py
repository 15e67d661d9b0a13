"""DataInf (Kwon et al., 2024): a closed-form inverse from swapping the average and the inverse, per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks import BlockCurvature, BlockStructure
from .influence_model import BlockSolver, InfluenceFunctionModel
from .options import CurvatureOptions, ProjectedOptions, option


@dataclass(frozen=True, kw_only=True)
class DataInfOptions(CurvatureOptions, ProjectedOptions):
    block_structure: BlockStructure = option("layer_wise", "Blocks", "DataInf is meant per layer.")


class DataInfSolver(BlockSolver):
    """(1/n Σ g_i g_iᵀ + λI)⁻¹ v ≈ 1/n Σ (g_i g_iᵀ + λI)⁻¹ v = (v − 1/n Σ_i g_i (g_iᵀv)/(λ + ‖g_i‖²)) / λ.

    One pass over the training gradients per solve; no state. The swap is exact only for rank-one data, so this
    is an approximation whose error grows with λ small and with layer size: use it layer_wise.
    """

    product_is_psd = True

    def curvature_product(self, vectors: torch.Tensor) -> torch.Tensor:
        """The empirical Fisher (1/n) Σ g_i g_iᵀ that DataInf inverts approximately; one pass over the gradients."""
        out = torch.zeros_like(vectors)
        for grads in self.curvature.gradient_batches():
            grads = grads.to(vectors.dtype)
            out += (vectors @ grads.T) @ grads
        return out / self.curvature.n

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        correction = torch.zeros_like(features)
        n = self.curvature.n
        for grads in self.curvature.gradient_batches():
            grads = grads.to(features.dtype)
            weights = (features @ grads.T) / (self.lam + (grads * grads).sum(1))
            correction += weights @ grads / n
        self.curvature.work.solves += len(features)
        return (features - correction) / self.lam


class DataInfInfluence(InfluenceFunctionModel):
    """Empirical-Fisher curvature with DataInf's closed-form inverse; needs λ > 0, per layer by default (block_structure='layer_wise').

    Documented agreement (Pearson with layer-wise Direct Gauss-Newton, tests/unit/test_methods.py): ≥ 0.89 at
    λ = 10·trace(C)/p on linear regression, L2 logistic regression and an MLP on digits; only 0.2-0.97 at
    λ = 0.01·trace(C)/p, where it behaves like the gradient dot product.
    """

    name = "datainf"
    title = "DataInf"
    summary = "DataInf: closed-form per-layer inverse of the empirical Fisher."
    Options = DataInfOptions
    needs_positive_regularization = True

    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        return DataInfSolver(curvature, lam)
