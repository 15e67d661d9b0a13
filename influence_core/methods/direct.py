"""Exact influence from the explicit curvature matrix and its Cholesky factor."""

from __future__ import annotations

import torch

from ..errors import NumericalError
from .base import InfluenceFunctionModel


class DirectInfluence(InfluenceFunctionModel):
    """Builds C (Hessian or Gauss-Newton) explicitly, factorises C + λI in float64 once, and solves with it.

    Exact up to round-off; memory O(p²) and time O(p³), so meant for models up to a few thousand parameters
    and as the reference the other methods are checked against.
    """

    name = "direct"
    thread_safe = True

    def _fit(self) -> None:
        matrix = self.curvature_operator().dense().to(torch.float64)
        matrix.diagonal().add_(self.regularization)
        factor, info = torch.linalg.cholesky_ex(matrix)
        if int(info) != 0:
            smallest = torch.linalg.eigvalsh(matrix)[0].item() - self.regularization
            raise NumericalError(
                f"C + λI is not positive definite (smallest eigenvalue of C is {smallest:.3e}, λ={self.regularization}). "
                f"Raise method.regularization above {abs(smallest):.1e}, or use second_order_mode='gauss_newton'"
            )
        self._factor = factor

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"cholesky": self._factor}

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        self._factor = state["cholesky"].to(torch.float64)

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        solved = torch.cholesky_solve(features.to(torch.float64).T, self._factor.to(features.device)).T
        return solved.to(features.dtype)
