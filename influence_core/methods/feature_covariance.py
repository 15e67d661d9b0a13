"""TRAK's curvature in a projected space: the uncentred covariance of the projected training gradients."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ..batches import count_rows
from ..work import Work

if TYPE_CHECKING:
    from .influence_model import InfluenceFunctionModel


class FeatureCovariance:
    """(1/n) Σ φ_i φ_iᵀ of the projected gradients φ, built in one pass over the data on first use and shared by
    all blocks."""

    def __init__(self, model: "InfluenceFunctionModel") -> None:
        self.model = model
        self._matrix: torch.Tensor | None = None

    def features(self) -> Iterator[torch.Tensor]:
        data = self.model.train
        if data is None:
            raise RuntimeError("the projected curvature needs the training data: fit(train) first")
        for x, y in data:
            yield self.model.features_of(x, y)

    def matrix(self) -> torch.Tensor:
        if self._matrix is None:
            total = None
            for f in self.features():
                f = f.to(torch.float64)
                total = f.T @ f if total is None else total + f.T @ f
            assert total is not None and self.model.train is not None
            self._matrix = total / count_rows(self.model.train)
        return self._matrix

    def block(self, sl: slice, name: str) -> "CovarianceBlock":
        return CovarianceBlock(self, sl, name)


class CovarianceBlock:
    """One block of the projected covariance, with the interface solvers use (dim, dense, matmat, gradient_batches)."""

    psd = True

    def __init__(self, covariance: FeatureCovariance, block: slice, name: str) -> None:
        self.covariance, self.block, self.name = covariance, block, name
        self.dim = block.stop - block.start

    def dense(self) -> torch.Tensor:
        return self.covariance.matrix()[self.block, self.block].to(self.dtype)

    def matmat(self, vectors: torch.Tensor) -> torch.Tensor:
        return vectors @ self.dense().to(vectors.dtype)

    def gradient_batches(self) -> Iterator[torch.Tensor]:
        for f in self.covariance.features():
            yield f[:, self.block]

    @property
    def work(self) -> Work:
        return self.covariance.model.objective.work

    @property
    def n(self) -> int:
        assert self.covariance.model.train is not None
        return count_rows(self.covariance.model.train)

    @property
    def dtype(self) -> torch.dtype:
        return self.covariance.model.objective.space.dtype

    @property
    def device(self) -> torch.device:
        return self.covariance.model.objective.space.device
