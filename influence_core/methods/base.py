"""The influence-model interface shared by every curvature method (pyDVL-style fit / factors / influences).

A model splits its parameters into blocks (all of them, or one per layer); each block gets a `BlockSolver` that
applies (C_b + λ_b I)⁻¹, so the curvature is block-diagonal with its own λ per block under `layer_wise`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from typing_extensions import Self

from ..batches import Batches, Data, as_batches, count_rows
from ..blocks import BlockCurvature, BlockStructure, Regularization, block_regularization, layer_blocks, make_blocks
from ..curvature import CurvatureOperator, SecondOrderMode
from ..errors import ConfigError
from ..layers import capture, module_param_names, select_layers
from ..losses import LossFn
from ..objective import Objective
from ..projection import Projection, Projector, project_batch


class BlockSolver(ABC):
    """(C_b + λ_b I)⁻¹ for one parameter block, optionally in a compressed feature space."""

    def __init__(self, curvature: BlockCurvature, lam: float) -> None:
        self.curvature, self.lam = curvature, lam

    @property
    def feature_dim(self) -> int:
        return self.curvature.dim

    def fit(self) -> None:
        """Compute the block's curvature state; methods that only need products at solve time keep this."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` returned; stateless solvers keep this."""

    def features(self, grads: torch.Tensor) -> torch.Tensor:
        """The block's per-example representation: its gradient, unless the method compresses it."""
        return grads

    @abstractmethod
    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        """Apply (C_b + λ_b I)⁻¹ to each row of `features`."""


class InfluenceFunctionModel(ABC):
    """score[t, i] = ∇ℓ(z_t)ᵀ (C + λI)⁻¹ ∇ℓ(z_i); positive means z_i helped the prediction on z_t.

    Subclasses choose the curvature approximation through `make_solver`. Results follow the parameters' dtype
    and device.
    """

    name: ClassVar[str]
    supports_projection: ClassVar[bool] = True
    # torch.func.functional_call swaps tensors on the module during a call, so one module must not serve
    # two threads at once; a method that avoids this may declare itself thread-safe.
    thread_safe: ClassVar[bool] = False
    needs_positive_regularization: ClassVar[bool] = False

    def __init__(
        self,
        model: nn.Module,
        loss: LossFn | str,
        regularization: Regularization = 1e-3,
        *,
        second_order_mode: SecondOrderMode = "hessian",
        block_structure: BlockStructure = "full",
        modules: Iterable[str] | None = None,
        projection: Projection | None = None,
        param_names: Iterable[str] | None = None,
        batch_size: int = 128,
    ) -> None:
        self.projector: Projector | None = None
        self.feature_space = projection is not None  # curvature taken in the projected space (TRAK-style)
        if projection is not None:
            if not self.supports_projection:
                raise ConfigError("method.projection", f"{self.name} works on full gradients", "use direct (TRAK), identity, cg, arnoldi, nystroem, datainf or ekfac with a projection")
            layers = select_layers(model, modules)
            self.projector = projection.build(layers)
            param_names = [p for layer in layers for p in layer.param_names]
        elif param_names is None:
            param_names = module_param_names(model, modules)
        self.objective = Objective(model, loss, param_names)
        self.excluded_parameters = [n for n, p in model.named_parameters() if p.requires_grad and n not in self.objective.space.params]
        self.blocks = self._feature_blocks(block_structure) if self.projector else make_blocks(self.objective.space, block_structure)
        self.regularization = block_regularization(self.blocks, regularization, self.needs_positive_regularization, self.name)
        self.second_order_mode = second_order_mode
        self.block_structure = block_structure
        self.batch_size = batch_size
        self.train: Batches | None = None
        self.solvers: dict[str, BlockSolver] = {}
        self._fitted = False

    @property
    def feature_dim(self) -> int:
        """Size of the space curvature is taken in: p, or the projected dimension."""
        return max(sl.stop for sl in self.blocks.values())

    @abstractmethod
    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        """The solver of one block."""

    # -- fitting ---------------------------------------------------------------------------------
    def _feature_blocks(self, structure: BlockStructure) -> dict[str, slice]:
        """Blocks of the projected feature space: all of it, or one per tracked layer."""
        assert self.projector is not None
        slices, start = {}, 0
        for layer in self.projector.layers:
            dim = self.projector.layer_dim(layer)
            slices[layer.block] = slice(start, start + dim)
            start += dim
        return {"all": slice(0, start)} if structure == "full" else slices

    def _bind(self, train: Data | None) -> None:
        if train is not None:
            self.train = as_batches(train, self.batch_size)
        if self.feature_space:
            covariance = FeatureCovariance(self)
            curvatures = {name: covariance.block(sl, name) for name, sl in self.blocks.items()}
        else:
            operator = CurvatureOperator(self.objective, self.train, self.second_order_mode)
            curvatures = {name: BlockCurvature(operator, sl, name) for name, sl in self.blocks.items()}
        self.solvers = {name: self.make_solver(curvature, self.regularization[name]) for name, curvature in curvatures.items()}

    def fit(self, train: Data) -> Self:
        """Compute the curvature state from training data (a DataLoader or an (x, y) tuple)."""
        self._bind(train)
        assert self.train is not None
        x, y = next(iter(self.train))
        self.objective.check_outputs(x, y)
        for solver in self.solvers.values():
            solver.fit()
        self._fitted = True
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fitted curvature state, to store and restore without fitting again."""
        return {f"{block}/{key}": value for block, solver in self.solvers.items() for key, value in solver.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], train: Data | None = None) -> Self:
        """Restore a fitted state; methods that take curvature products at solve time need `train` back."""
        self._bind(train)
        for block, solver in self.solvers.items():
            prefix = f"{block}/"
            solver.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
        self._fitted = True
        return self

    @property
    def is_fitted(self) -> bool:
        return self._fitted

    def _require_fitted(self) -> None:
        if not self._fitted:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(train) first")

    # -- the two halves of a score -----------------------------------------------------------------
    def gradient_features(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-example representation (n, p'): the loss gradient, projected or compressed where the method does."""
        self._require_fitted()
        return self._raw_features(x, y)

    def _raw_features(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        parts = []
        for start in range(0, len(x), self.batch_size):
            xb, yb = x[start : start + self.batch_size], y[start : start + self.batch_size]
            if self.projector is not None:
                parts.append(project_batch(self.projector, self.capture(xb, yb)))
            else:
                grads = self.objective.per_sample_grads(xb, yb)
                parts.append(self._per_block(grads, self.blocks.values(), lambda s, g: s.features(g)))
        return torch.cat(parts)

    def capture(self, x: torch.Tensor, y: torch.Tensor):  # type: ignore[no-untyped-def]
        """Inputs and true-label output gradients of the tracked layers for one batch (counted as gradients)."""
        assert self.projector is not None
        x, y = self.objective.to_model(x, y)
        self.objective.gradient_rows += len(x)
        return capture(self.objective.model, self.projector.layers, self.objective.loss_fn, x, y)

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        """Apply (C + λI)⁻¹, block by block, to each row of `features` (n, p')."""
        self._require_fitted()
        return self._per_block(features, self._feature_slices(), lambda s, f: s.precondition(f))

    def _feature_slices(self) -> list[slice]:
        slices, start = [], 0
        for solver in self.solvers.values():
            slices.append(slice(start, start + solver.feature_dim))
            start += solver.feature_dim
        return slices

    def _per_block(self, rows: torch.Tensor, slices: Iterable[slice], apply: Any) -> torch.Tensor:
        parts = [apply(solver, rows[:, sl]) for solver, sl in zip(self.solvers.values(), slices)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    # -- public API ------------------------------------------------------------------------------
    def influence_factors(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(C + λI)⁻¹ ∇ℓ for each query example: shape (n_test, p')."""
        return self.precondition(self.gradient_features(x, y))

    def influences_from_factors(self, factors: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Scores (n_test, n) of the examples (x, y) on the queries behind `factors`."""
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
        features = self.gradient_features(x, y)
        scores = None if factors is None else factors @ features.T
        return scores, (features * self.precondition(features)).sum(dim=1)

    # -- per-module scores -------------------------------------------------------------------------
    def module_segments(self) -> dict[str, slice]:
        """The slice of the feature space that belongs to each module."""
        if self.projector is not None:
            return self._feature_blocks("layer_wise")
        if all(solver.feature_dim == sl.stop - sl.start for solver, sl in zip(self.solvers.values(), self.blocks.values())):
            return layer_blocks(self.objective.space)
        if self.block_structure == "layer_wise":
            return dict(zip(self.solvers, self._feature_slices()))
        raise ConfigError("method.block_structure", f"{self.name} mixes modules in its compressed features", "use block_structure='layer_wise' for per-module scores")

    def influences_by_module(self, x_test: torch.Tensor, y_test: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """Scores split by the module whose parameters carry them; they sum to `influences`."""
        factors, features = self.influence_factors(x_test, y_test), self.gradient_features(x, y)
        return {module: factors[:, sl] @ features[:, sl].T for module, sl in self.module_segments().items()}


class FeatureCovariance:
    """The uncentred covariance of the projected training gradients, (1/n) Σ φ_i φ_iᵀ: TRAK's curvature in the
    projected space. Built in one pass over the data on first use and shared by all blocks."""

    def __init__(self, model: InfluenceFunctionModel) -> None:
        self.model = model
        self._matrix: torch.Tensor | None = None

    def matrix(self) -> torch.Tensor:
        if self._matrix is None:
            data = self.model.train
            if data is None:
                raise RuntimeError("the projected curvature needs the training data: fit(train) first")
            total = None
            for x, y in data:
                f = self.model._raw_features(x, y).to(torch.float64)
                total = f.T @ f if total is None else total + f.T @ f
            assert total is not None
            self._matrix = total / count_rows(data)
        return self._matrix

    def block(self, sl: slice, name: str) -> "CovarianceBlock":
        return CovarianceBlock(self, sl, name)


class CovarianceBlock:
    """One block of the projected covariance, with the interface solvers use (dim, dense, matmat, gradient_batches)."""

    def __init__(self, covariance: FeatureCovariance, block: slice, name: str) -> None:
        self.covariance, self.block, self.name = covariance, block, name
        self.dim = block.stop - block.start

    def dense(self) -> torch.Tensor:
        return self.covariance.matrix()[self.block, self.block].to(self.dtype)

    def matmat(self, vectors: torch.Tensor) -> torch.Tensor:
        return vectors @ self.dense().to(vectors.dtype)

    def gradient_batches(self):  # type: ignore[no-untyped-def]
        assert self.covariance.model.train is not None
        for x, y in self.covariance.model.train:
            yield self.covariance.model._raw_features(x, y)[:, self.block]

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
