"""Low-rank curvature: Arnoldi (Lanczos) eigenbases and Nyström sketches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..blocks import BlockCurvature
from ..errors import ConfigError
from ..spectral import hutchinson_trace, lanczos, nystroem
from ..self_influence import Diagonal, SelfInfluencePlan, Sketch, eigen_sketch
from .influence_model import BlockSolver, InfluenceFunctionModel
from .options import CurvatureOptions, ProjectedOptions, option


@dataclass(frozen=True, kw_only=True)
class ArnoldiOptions(CurvatureOptions, ProjectedOptions):
    rank: int = option(10, "Rank", "Eigenpairs kept (at most p).", ge=1)
    krylov_dim: int | None = option(None, "Krylov dimension", "Size of the Krylov space (≥ rank; empty: 2·rank).", ge=1)
    seed: int = option(0, "Seed", "Seed of the starting vector.")
    complement: bool = option(
        False, "Keep the complement",
        "Also keep the space outside the top eigenbasis, weighted 1/(mean remaining eigenvalue + λ), as Nyström does; off: that space is dropped (scores in rank-r space).",
    )


@dataclass(frozen=True, kw_only=True)
class NystroemOptions(CurvatureOptions, ProjectedOptions):
    rank: int = option(10, "Rank", "Sketch size (at most p).", ge=1)
    seed: int = option(0, "Seed", "Seed of the sketch.")


def check_rank(rank: int, dim: int) -> int:
    """Refuse a rank above the number of parameters p; a rank of p is exact."""
    if rank < 1 or rank > dim:
        raise ConfigError("method.rank", f"rank={rank} but the model has p={dim} parameters", f"use 1 <= rank <= {dim}")
    return rank


def woodbury(features: torch.Tensor, basis: torch.Tensor, inverse_values: torch.Tensor, complement: float) -> torch.Tensor:
    """Rows f ↦ U diag(w) Uᵀ f + c (I − UUᵀ) f: the inverse in an orthonormal eigenbasis U, the complement weighted c."""
    u = basis.to(features.dtype)
    coords = features @ u
    return (coords * inverse_values.to(features.dtype)) @ u.T + complement * (features - coords @ u.T)


class ArnoldiSolver(BlockSolver):
    """Top-r eigenpairs (μ, V) of C; scores are taken in the r-dimensional eigenbasis: gᵀV diag(1/(μ+λ)) Vᵀg.

    With `complement`, the rest of the space is kept too, weighted 1/(μ̄ + λ) with μ̄ the mean eigenvalue outside
    V (its trace by Hutchinson on the deflated operator, `krylov_dim` probes): without it, the directions that
    dominate (C + λI)⁻¹, those of small curvature, are dropped altogether."""

    def __init__(self, curvature: BlockCurvature, lam: float, options: ArnoldiOptions) -> None:
        super().__init__(curvature, lam)
        self.rank = min(options.rank, curvature.dim)  # layer_wise: a small layer is kept whole
        self.krylov_dim = max(options.krylov_dim or 2 * options.rank, self.rank)
        self.seed, self.complement = options.seed, options.complement
        self.complement_weight = 0.0

    @property
    def feature_dim(self) -> int:
        return self.curvature.dim if self.complement else self.rank

    def fit(self) -> None:
        c = self.curvature
        self.values, self.vectors = lanczos(c.matmat, c.dim, self.rank, self.krylov_dim, self.seed, c.dtype, c.device)
        if self.complement and self.rank < c.dim:
            rest = hutchinson_trace(c.matmat, c.dim, self.krylov_dim, self.seed, c.dtype, c.device, deflate=self.vectors)
            self.complement_weight = 1.0 / (max(rest / (c.dim - self.rank), 0.0) + self.lam)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"eigenvalues": self.values, "eigenvectors": self.vectors, "complement_weight": torch.tensor(self.complement_weight)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.values, self.vectors = state["eigenvalues"], state["eigenvectors"]
        self.complement_weight = float(state.get("complement_weight", 0.0))

    def curvature_scale(self) -> float:
        return float(self.values.abs().max())

    def feature_rows(self) -> torch.Tensor | None:
        return None if self.complement else self.vectors.T

    def inverse_eigenvalues(self) -> torch.Tensor:
        return 1.0 / (self.values + self.lam)

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        if self.complement:
            return woodbury(features, self.vectors, self.inverse_eigenvalues(), self.complement_weight)
        return features * self.inverse_eigenvalues().to(features.dtype)


class NystroemSolver(BlockSolver):
    """C ≈ U diag(Λ) Uᵀ from a one-pass randomised sketch; (C + λI)⁻¹ by Woodbury, complement included:
    U diag(1/(Λ+λ)) Uᵀ + (I − UUᵀ)/λ."""

    def __init__(self, curvature: BlockCurvature, lam: float, options: NystroemOptions) -> None:
        super().__init__(curvature, lam)
        self.rank = min(options.rank, curvature.dim)
        self.seed = options.seed

    def fit(self) -> None:
        c = self.curvature
        self.values, self.basis, _ = nystroem(c.matmat, c.dim, self.rank, self.seed, c.dtype, c.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"eigenvalues": self.values, "basis": self.basis}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.values, self.basis = state["eigenvalues"], state["basis"]

    def curvature_scale(self) -> float:
        return float(self.values.max())

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        return woodbury(features, self.basis, 1.0 / (self.values + self.lam), 1.0 / self.lam)


class ArnoldiInfluence(InfluenceFunctionModel):
    """Low-rank influence in the top eigenbasis of C (Schioppa et al., 2022); `krylov_dim` ≥ rank sets accuracy.

    Full rank with full Krylov dimension is exact. Query factors and training features live in the rank-r space,
    so scoring costs r per pair instead of p. `complement=True` keeps the rest of the space at 1/(mean remaining
    eigenvalue + λ) (scores then cost p per pair): far better counterfactual quality at r ≪ p (docs/methods.md).
    """

    name = "arnoldi"
    title = "Arnoldi"
    summary = "Top eigenbasis of the curvature by Arnoldi/Lanczos; scores in rank-r space."
    Options = ArnoldiOptions
    options: ArnoldiOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("query_rank") is not None:
            raise ConfigError("method.query_rank", "Arnoldi's query factors already live in its rank-r eigenbasis", "leave query_rank empty with arnoldi")
        super().__init__(*args, **kwargs)
        rank, krylov_dim = check_rank(self.options.rank, self.feature_dim), self.options.krylov_dim
        if krylov_dim is not None and krylov_dim < rank:
            raise ConfigError("method.krylov_dim", f"krylov_dim={krylov_dim} is below rank={rank}", "use krylov_dim >= rank (about 2·rank is usual)")

    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        return ArnoldiSolver(curvature, lam, self.options)

    def _exact_self_plan(self) -> SelfInfluencePlan:
        """Diagonal in the eigenbasis: Σ_k (v_kᵀ g)² / (μ_k + λ), exact for the rank-r model; with the complement,
        the sketch form: that plus c (‖g‖² − Σ_k (v_kᵀ g)²)."""
        if self.options.complement:
            parts = [(s.vectors.T, s.inverse_eigenvalues(), s.complement_weight) for s in self.solvers.values()]  # type: ignore[attr-defined]
            return Sketch.from_blocks(parts, self._feature_slices(), self.feature_dim)
        return Diagonal({"features": torch.cat([s.inverse_eigenvalues() for s in self.solvers.values()])})  # type: ignore[attr-defined]


class NystroemSketchInfluence(InfluenceFunctionModel):
    """Randomised Nyström low-rank curvature plus λ on the complement; exact at full rank. Needs λ > 0."""

    name = "nystroem"
    title = "Nyström sketch"
    summary = "Randomised Nyström sketch of the curvature, λ on the complement."
    Options = NystroemOptions
    options: NystroemOptions
    needs_positive_regularization = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_rank(self.options.rank, self.feature_dim)

    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        return NystroemSolver(curvature, lam, self.options)

    def _exact_self_plan(self) -> SelfInfluencePlan:
        """The method's own inverse is a sketch: its eigenpairs, and 1/λ on the complement."""
        parts = [eigen_sketch(s.values, s.basis, s.lam, len(s.values), None) for s in self.solvers.values()]  # type: ignore[attr-defined]
        return Sketch.from_blocks(parts, self._feature_slices(), self.feature_dim)
