"""Curvature of the mean training loss as a matrix-free operator: H or Gauss-Newton times vectors."""

from __future__ import annotations

from typing import Literal

import torch

from .batches import Batches, count_rows
from .objective import Objective

SecondOrderMode = Literal["hessian", "gauss_newton"]


class CurvatureOperator:
    """`V ↦ V·C` for the curvature C of the *mean* loss over all training examples.

    Each batch's mean-loss curvature is weighted by its share of the examples (n_b / n), so batches of unequal
    size, or a single batch, give the same operator.
    """

    def __init__(self, objective: Objective, data: Batches | None, mode: SecondOrderMode = "hessian", max_vectors: int = 64) -> None:
        if mode not in ("hessian", "gauss_newton"):
            raise ValueError(f"second_order_mode must be 'hessian' or 'gauss_newton', not {mode!r}")
        self.objective, self.data, self.mode = objective, data, mode
        self.max_vectors = max_vectors
        self.dim = objective.space.dim
        self._n: int | None = None

    @property
    def batches(self) -> Batches:
        """The training data; methods restored without it cannot take curvature products."""
        if self.data is None:
            raise RuntimeError("this method needs the training data again: pass train= to load_state_dict")
        return self.data

    @property
    def n(self) -> int:
        """Number of training examples (counted once, on first use)."""
        if self._n is None:
            self._n = count_rows(self.batches)
        return self._n

    def batch_product(self, x: torch.Tensor, y: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
        """Rows of `vectors` times the curvature of one batch's mean loss."""
        if self.mode == "hessian":
            return self.objective.hessian_products(x, y, vectors)
        return self.objective.gauss_newton_products(x, y, vectors)

    def matmat(self, vectors: torch.Tensor) -> torch.Tensor:
        """Apply the curvature to each row of `vectors` (k, p), in one pass over the data."""
        out = torch.zeros_like(vectors)
        n = self.n
        for x, y in self.batches:
            weight = len(y) / n
            for start in range(0, len(vectors), self.max_vectors):
                block = slice(start, start + self.max_vectors)
                out[block] += weight * self.batch_product(x, y, vectors[block]).detach()
        return out
