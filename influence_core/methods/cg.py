"""Influence by conjugate gradients on matrix-free curvature products."""

from __future__ import annotations

import torch

from ..solvers import SolveInfo, conjugate_gradient
from .base import InfluenceFunctionModel


class CgInfluence(InfluenceFunctionModel):
    """Solves (C + λI) X = G for all rows of G at once with vectorised CG; never forms C.

    Memory O(k·p) for k right-hand sides; each iteration is one pass of curvature-vector products over the
    training data, so it needs the training data at solve time (kept from `fit`, or given to `load_state_dict`).
    """

    name = "cg"

    def __init__(self, *args, rtol: float = 1e-7, atol: float = 0.0, maxiter: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rtol, self.atol, self.maxiter = rtol, atol, maxiter
        self.last_solve: SolveInfo | None = None

    def _fit(self) -> None:
        self._operator = self.curvature_operator()

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        self._operator = self.curvature_operator()

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        lam = self.regularization
        solution, self.last_solve = conjugate_gradient(
            lambda v: self._operator.matmat(v) + lam * v,
            features,
            rtol=self.rtol,
            atol=self.atol,
            maxiter=self.maxiter,
        )
        return solution
