"""Low-rank curvature: Arnoldi (Lanczos) eigenbases and Nyström sketches."""

from __future__ import annotations

import torch

from ..blocks import BlockCurvature
from ..errors import ConfigError
from ..lowrank import lanczos, nystroem
from ..self_influence import Diagonal, SelfInfluencePlan, Sketch, eigen_sketch
from .base import BlockSolver, InfluenceFunctionModel


def check_rank(rank: int, dim: int) -> int:
    """Refuse a rank above the number of parameters p; a rank of p is exact."""
    if rank < 1 or rank > dim:
        raise ConfigError("method.rank", f"rank={rank} but the model has p={dim} parameters", f"use 1 <= rank <= {dim}")
    return rank


class ArnoldiSolver(BlockSolver):
    """Top-r eigenpairs (μ, V) of C; scores are taken in the r-dimensional eigenbasis: gᵀV diag(1/(μ+λ)) Vᵀg."""

    def __init__(self, curvature: BlockCurvature, lam: float, rank: int, krylov_dim: int | None, seed: int) -> None:
        super().__init__(curvature, lam)
        self.rank = min(rank, curvature.dim)  # layer_wise: a small layer is kept whole
        self.krylov_dim = max(krylov_dim or 2 * rank, self.rank)
        self.seed = seed

    @property
    def feature_dim(self) -> int:
        return self.rank

    def fit(self) -> None:
        c = self.curvature
        self.values, self.vectors = lanczos(c.matmat, c.dim, self.rank, self.krylov_dim, self.seed, c.dtype, c.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"eigenvalues": self.values, "eigenvectors": self.vectors}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.values, self.vectors = state["eigenvalues"], state["eigenvectors"]

    def feature_rows(self) -> torch.Tensor:
        return self.vectors.T

    def inverse_eigenvalues(self) -> torch.Tensor:
        return 1.0 / (self.values + self.lam)

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        return features * self.inverse_eigenvalues().to(features.dtype)


class NystroemSolver(BlockSolver):
    """C ≈ U diag(Λ) Uᵀ from a one-pass randomised sketch; (C + λI)⁻¹ by Woodbury, complement included:
    U diag(1/(Λ+λ)) Uᵀ + (I − UUᵀ)/λ."""

    def __init__(self, curvature: BlockCurvature, lam: float, rank: int, seed: int) -> None:
        super().__init__(curvature, lam)
        self.rank = min(rank, curvature.dim)
        self.seed = seed

    def fit(self) -> None:
        c = self.curvature
        self.values, self.basis, _ = nystroem(c.matmat, c.dim, self.rank, self.seed, c.dtype, c.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"eigenvalues": self.values, "basis": self.basis}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.values, self.basis = state["eigenvalues"], state["basis"]

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        u = self.basis.to(features.dtype)
        coords = features @ u
        inside = coords / (self.values.to(features.dtype) + self.lam)
        return inside @ u.T + (features - coords @ u.T) / self.lam


class ArnoldiInfluence(InfluenceFunctionModel):
    """Low-rank influence in the top eigenbasis of C (Schioppa et al., 2022); `krylov_dim` ≥ rank sets accuracy.

    Full rank with full Krylov dimension is exact. Query factors and training features live in the rank-r space,
    so scoring costs r per pair instead of p.
    """

    name = "arnoldi"

    def __init__(self, *args, rank: int = 10, krylov_dim: int | None = None, seed: int = 0, **kwargs) -> None:
        if kwargs.get("query_rank") is not None:
            raise ConfigError("method.query_rank", "Arnoldi's query factors already live in its rank-r eigenbasis", "leave query_rank empty with arnoldi")
        super().__init__(*args, **kwargs)
        self.rank, self.krylov_dim, self.seed = check_rank(rank, self.feature_dim), krylov_dim, seed
        if krylov_dim is not None and krylov_dim < rank:
            raise ConfigError("method.krylov_dim", f"krylov_dim={krylov_dim} is below rank={rank}", "use krylov_dim >= rank (about 2·rank is usual)")

    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        return ArnoldiSolver(curvature, lam, self.rank, self.krylov_dim, self.seed)

    def _exact_self_plan(self) -> SelfInfluencePlan:
        """Diagonal in the eigenbasis: Σ_k (v_kᵀ g)² / (μ_k + λ), exact for the rank-r model."""
        return Diagonal({"features": torch.cat([s.inverse_eigenvalues() for s in self.solvers.values()])})  # type: ignore[attr-defined]


class NystroemSketchInfluence(InfluenceFunctionModel):
    """Randomised Nyström low-rank curvature plus λ on the complement; exact at full rank. Needs λ > 0."""

    name = "nystroem"
    needs_positive_regularization = True

    def __init__(self, *args, rank: int = 10, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rank, self.seed = check_rank(rank, self.feature_dim), seed

    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        return NystroemSolver(curvature, lam, self.rank, self.seed)

    def _exact_self_plan(self) -> SelfInfluencePlan:
        """The method's own inverse is a sketch: its eigenpairs, and 1/λ on the complement."""
        parts = [eigen_sketch(s.values, s.basis, s.lam, len(s.values), None) for s in self.solvers.values()]  # type: ignore[attr-defined]
        return Sketch.from_blocks(parts, self._feature_slices(), self.feature_dim)
