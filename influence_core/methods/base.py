"""The influence-model interface shared by every curvature method (pyDVL-style fit / factors / influences)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from typing_extensions import Self

from ..batches import Batches, Data, as_batches
from ..curvature import CurvatureOperator, SecondOrderMode
from ..errors import ConfigError
from ..losses import LossFn
from ..objective import Objective


class InfluenceFunctionModel(ABC):
    """score[t, i] = ∇ℓ(z_t)ᵀ (C + λI)⁻¹ ∇ℓ(z_i); positive means z_i helped the prediction on z_t.

    Subclasses choose the curvature approximation by implementing `precondition` (apply (C + λI)⁻¹ to feature
    rows) and, where they compress gradients, `gradient_features`. Results follow the parameters' dtype and device.
    """

    name: ClassVar[str]
    thread_safe: ClassVar[bool] = False
    needs_positive_regularization: ClassVar[bool] = False

    def __init__(
        self,
        model: nn.Module,
        loss: LossFn | str,
        regularization: float = 1e-3,
        *,
        second_order_mode: SecondOrderMode = "hessian",
        param_names: Iterable[str] | None = None,
        batch_size: int = 128,
    ) -> None:
        self.objective = Objective(model, loss, param_names)
        self.regularization = self._check_regularization(regularization)
        self.second_order_mode = second_order_mode
        self.batch_size = batch_size
        self.train: Batches | None = None
        self._fitted = False

    def _check_regularization(self, value: float) -> float:
        if value < 0 or (value == 0 and self.needs_positive_regularization):
            bound = "> 0" if self.needs_positive_regularization else ">= 0"
            raise ConfigError("method.regularization", f"{self.name} got λ={value}", f"use a value {bound}, e.g. 1e-3")
        return float(value)

    # -- fitting ---------------------------------------------------------------------------------
    def fit(self, train: Data) -> Self:
        """Compute the curvature state from training data (a DataLoader or an (x, y) tuple)."""
        self.train = as_batches(train, self.batch_size)
        x, y = next(iter(self.train))
        self.objective.check_outputs(x, y)
        self._fit()
        self._fitted = True
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fitted curvature state, to store and restore without fitting again."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor], train: Data | None = None) -> Self:
        """Restore a fitted state; matrix-free methods also need the training data back."""
        if train is not None:
            self.train = as_batches(train, self.batch_size)
        self._load(state)
        self._fitted = True
        return self

    @property
    def is_fitted(self) -> bool:
        return self._fitted

    def curvature_operator(self) -> CurvatureOperator:
        """The matrix-free curvature of the mean training loss at the model's parameters."""
        if self.train is None:
            raise RuntimeError(f"{type(self).__name__} needs training data: call fit() or load_state_dict(state, train)")
        return CurvatureOperator(self.objective, self.train, self.second_order_mode)

    @abstractmethod
    def _fit(self) -> None: ...

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the tensors `state_dict` returned; methods without state keep this."""

    # -- the two halves of a score -----------------------------------------------------------------
    def gradient_features(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-example representation, (n, p'): the flat loss gradient unless the method compresses it."""
        return torch.cat(
            [self.objective.per_sample_grads(x[i : i + self.batch_size], y[i : i + self.batch_size]) for i in range(0, len(x), self.batch_size)]
        )

    @abstractmethod
    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        """Apply (C + λI)⁻¹ to each row of `features` (n, p')."""

    # -- public API ------------------------------------------------------------------------------
    def _require_fitted(self) -> None:
        if not self._fitted:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(train) first")

    def influence_factors(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(C + λI)⁻¹ ∇ℓ for each query example: shape (n_test, p')."""
        self._require_fitted()
        return self.precondition(self.gradient_features(x, y))

    def influences_from_factors(self, factors: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Scores (n_test, n) of the examples (x, y) on the queries behind `factors`."""
        self._require_fitted()
        return factors @ self.gradient_features(x, y).T

    def influences(
        self, x_test: torch.Tensor, y_test: torch.Tensor, x: torch.Tensor | None = None, y: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Scores (n_test, n) of (x, y), or of the whole training set when they are omitted."""
        factors = self.influence_factors(x_test, y_test)
        if x is None or y is None:
            assert self.train is not None
            return torch.cat([self.influences_from_factors(factors, xb, yb) for xb, yb in self.train], dim=1)
        return self.influences_from_factors(factors, x, y)

    def self_influences(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """∇ℓ(z_i)ᵀ (C + λI)⁻¹ ∇ℓ(z_i) for each example: high values flag unusual or mislabelled points."""
        return self.scores_and_self_influences(None, x, y)[1]

    def scores_and_self_influences(
        self, factors: torch.Tensor | None, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Scores against `factors` and self-influences of (x, y) from a single gradient evaluation."""
        self._require_fitted()
        features = self.gradient_features(x, y)
        scores = None if factors is None else factors @ features.T
        return scores, (features * self.precondition(features)).sum(dim=1)
