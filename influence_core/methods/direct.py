"""Exact influence from the explicit curvature matrix and its Cholesky factor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..blocks import BlockCurvature
from ..errors import RegularizationError
from .influence_model import BlockSolver, InfluenceFunctionModel
from .options import CurvatureOptions, ProjectedOptions


@dataclass(frozen=True, kw_only=True)
class DirectOptions(CurvatureOptions, ProjectedOptions):
    """The shared curvature options, and an optional projection (TRAK)."""


class DirectSolver(BlockSolver):
    """Builds the block's C explicitly, factorises C + λI once in float64, and solves with the factor."""

    def fit(self) -> None:
        matrix = self.curvature.dense().to(torch.float64)
        self.scale = float(torch.linalg.matrix_norm(matrix))  # ‖C‖_F ≥ its largest eigenvalue, exact and O(p²)
        matrix.diagonal().add_(self.lam)
        factor, info = torch.linalg.cholesky_ex(matrix)
        if int(info) != 0:
            eigenvalues = torch.linalg.eigvalsh(matrix) - self.lam
            smallest, largest = eigenvalues[0].item(), eigenvalues[-1].item()
            raise RegularizationError(
                f"C + λI is not positive definite in block {self.curvature.name!r}: the smallest eigenvalue of C is {smallest:.3e}, the largest {largest:.3e}",
                self.lam, max(10 * abs(smallest), 1e-6 * abs(largest)), self.second_order_mode,
            )
        self.factor = factor

    def curvature_scale(self) -> float:
        return self.scale

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"cholesky": self.factor}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.factor = state["cholesky"].to(torch.float64)

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        solved = torch.cholesky_solve(features.to(torch.float64).T, self.factor.to(features.device)).T
        return solved.to(features.dtype)

    def sketch(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        """All eigenpairs of C = L Lᵀ − λI and its exact trace: the low-rank estimate keeps the top `rank`."""
        matrix = self.factor @ self.factor.T
        matrix.diagonal().sub_(self.lam)
        values, vectors = torch.linalg.eigh((matrix + matrix.T) / 2)
        return values, vectors, float(values.sum())


class DirectInfluence(InfluenceFunctionModel):
    """Exact up to round-off; memory O(p²) and time O(p³) per block, plus forming C (Gauss-Newton: n·K·p² GEMM flops
    for K outputs per example; Hessian: p·n curvature products), so meant for models up to a few thousand parameters
    and as the reference the other methods are checked against."""

    name = "direct"
    title = "Direct (exact; TRAK with a projection)"
    summary = "Explicit curvature and Cholesky solve: exact, for up to a few thousand parameters; with a projection, TRAK's (XᵀX/n + λI)⁻¹ in the projected space."
    Options = DirectOptions

    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        return DirectSolver(curvature, lam)

    cheap_solve: ClassVar[bool] = True  # self-influence's triangular solves cost Σ_b p_b² per example: each example's share of forming C, which the fit already paid
