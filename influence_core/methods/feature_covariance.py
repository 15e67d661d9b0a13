"""TRAK's curvature in a projected space: the uncentred covariance of the projected training gradients."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..batches import Batches, count_rows
from ..objective import Objective
from ..work import Work


class FeatureCovariance:
    """(1/n) Σ φ_i φ_iᵀ of the projected gradients φ, built in one pass over the data on first use and shared by
    all blocks. `features_of` maps a batch (x, y) to its projected gradients; `objective` counts the work and gives
    the dtype and device."""

    def __init__(self, train: Batches | None, features_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], objective: Objective) -> None:
        self.train, self.features_of, self.objective = train, features_of, objective
        self._matrix: torch.Tensor | None = None

    def features(self) -> Iterator[torch.Tensor]:
        if self.train is None:
            raise RuntimeError("the projected curvature needs the training data: fit(train) first")
        for x, y in self.train:
            yield self.features_of(x, y)

    def matrix(self) -> torch.Tensor:
        if self._matrix is None:
            total = None
            for f in self.features():
                f = f.to(torch.float64)
                total = f.T @ f if total is None else total + f.T @ f
            assert total is not None and self.train is not None
            self._matrix = total / count_rows(self.train)
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
        return self.covariance.objective.work

    @property
    def n(self) -> int:
        assert self.covariance.train is not None
        return count_rows(self.covariance.train)

    @property
    def dtype(self) -> torch.dtype:
        return self.covariance.objective.space.dtype

    @property
    def device(self) -> torch.device:
        return self.covariance.objective.space.device
