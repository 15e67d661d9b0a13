"""CG preconditioners: objects fitted on a block's curvature that apply P⁻¹ ≈ (C + λI)⁻¹ to CG's residuals.

- `jacobi`: 1/(diag(C) + λ), the diagonal estimated by Hutchinson's method with Rademacher probes;
- `nystroem`: from a rank-r Nyström sketch, P⁻¹ = (Λ_r + λ) U (Λ + λI)⁻¹ Uᵀ + (I − UUᵀ) (Frangella et al., 2023).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch

from ..blocks import BlockCurvature
from ..spectral import nystroem

PreconditionerName = Literal["none", "jacobi", "nystroem"]


class Preconditioner(ABC):
    """P⁻¹ for one block at damping λ: `fit` computes its state (or `load_state_dict` restores it), `apply` uses it."""

    def __init__(self, lam: float, rank: int, probes: int, seed: int) -> None:
        self.lam, self.rank, self.probes, self.seed = lam, rank, probes, seed
        self.state: dict[str, torch.Tensor] = {}

    @abstractmethod
    def fit(self, curvature: BlockCurvature) -> None:
        """Compute the state from the block's curvature products."""

    @abstractmethod
    def apply(self, residuals: torch.Tensor) -> torch.Tensor:
        """P⁻¹ applied to each row of `residuals`."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.state = dict(state)


class Jacobi(Preconditioner):
    """The inverse of the damped diagonal, the diagonal estimated from `probes` Rademacher probes."""

    def fit(self, curvature: BlockCurvature) -> None:
        c = curvature
        gen = torch.Generator().manual_seed(self.seed)
        probes = (torch.randint(0, 2, (self.probes, c.dim), generator=gen) * 2 - 1).to(dtype=c.dtype, device=c.device)
        self.state = {"diagonal": (probes * c.matmat(probes)).mean(0)}

    def apply(self, residuals: torch.Tensor) -> torch.Tensor:
        return residuals / (self.state["diagonal"].clamp_min(0) + self.lam)


class NystroemPreconditioner(Preconditioner):
    """The damped inverse in a rank-`rank` Nyström eigenbasis, scaled to the smallest kept eigenvalue outside it."""

    def fit(self, curvature: BlockCurvature) -> None:
        c = curvature
        values, basis, _ = nystroem(c.matmat, c.dim, min(self.rank, c.dim), self.seed, c.dtype, c.device)
        self.state = {"eigenvalues": values, "basis": basis}

    def apply(self, residuals: torch.Tensor) -> torch.Tensor:
        u, values = self.state["basis"], self.state["eigenvalues"]
        coords = residuals @ u
        smallest = values[-1] + self.lam
        return smallest * (coords / (values + self.lam)) @ u.T + residuals - coords @ u.T


PRECONDITIONERS: dict[str, type[Preconditioner]] = {"jacobi": Jacobi, "nystroem": NystroemPreconditioner}
