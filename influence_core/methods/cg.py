"""Influence by conjugate gradients on matrix-free curvature products, optionally preconditioned."""

from __future__ import annotations

from typing import Literal

import torch

from ..blocks import BlockCurvature
from ..spectral import nystroem
from ..errors import RegularizationError
from ..solvers import NotConverged, SolveInfo, block_conjugate_gradient, conjugate_gradient
from .influence_model import BlockSolver, InfluenceFunctionModel

CgPreconditioner = Literal["none", "jacobi", "nystroem"]


class CgSolver(BlockSolver):
    """CG on (C + λI) X = G: block CG over all rows at once (default) or one independent, vectorised run per row,
    with an optional preconditioner:

    - `jacobi`: 1/(diag(C) + λ), the diagonal estimated by Hutchinson's method with Rademacher probes;
    - `nystroem`: from a rank-r Nyström sketch, P⁻¹ = (Λ_r + λ) U (Λ + λI)⁻¹ Uᵀ + (I − UUᵀ) (Frangella et al., 2023).
    """

    def __init__(self, curvature: BlockCurvature, lam: float, rtol: float, atol: float, maxiter: int | None, preconditioner: CgPreconditioner, rank: int, probes: int, seed: int, block: bool) -> None:
        super().__init__(curvature, lam)
        self.rtol, self.atol, self.maxiter, self.block = rtol, atol, maxiter, block
        self.kind, self.rank, self.probes, self.seed = preconditioner, min(rank, curvature.dim), probes, seed
        self.state: dict[str, torch.Tensor] = {}
        self.last_solve: SolveInfo | None = None

    def fit(self) -> None:
        c = self.curvature
        if self.kind == "jacobi":
            gen = torch.Generator().manual_seed(self.seed)
            probes = (torch.randint(0, 2, (self.probes, c.dim), generator=gen) * 2 - 1).to(dtype=c.dtype, device=c.device)
            self.state = {"diagonal": (probes * c.matmat(probes)).mean(0)}
        elif self.kind == "nystroem":
            values, basis, _ = nystroem(c.matmat, c.dim, self.rank, self.seed, c.dtype, c.device)
            self.state = {"eigenvalues": values, "basis": basis}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.state = dict(state)

    def _inverse_preconditioner(self, residuals: torch.Tensor) -> torch.Tensor:
        if self.kind == "jacobi":
            return residuals / (self.state["diagonal"].clamp_min(0) + self.lam)
        u, values = self.state["basis"], self.state["eigenvalues"]
        coords = residuals @ u
        smallest = values[-1] + self.lam
        return smallest * (coords / (values + self.lam)) @ u.T + residuals - coords @ u.T

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        solve = block_conjugate_gradient if self.block else conjugate_gradient
        try:
            solution, self.last_solve = solve(
                lambda v: self.curvature.matmat(v) + self.lam * v,
                features,
                rtol=self.rtol,
                atol=self.atol,
                maxiter=self.maxiter,
                preconditioner=None if self.kind == "none" else self._inverse_preconditioner,
            )
        except NotConverged as exc:  # λ too small for this curvature: say which λ would do, for the mode in force
            raise RegularizationError(exc.problem, self.lam, max(10 * self.lam, 1e-3 * exc.largest_seen), self.second_order_mode) from None
        self.curvature.work.solves += len(features)
        self.curvature.work.solver_iterations += self.last_solve.iterations
        return solution


class CgInfluence(InfluenceFunctionModel):
    """Never forms C: memory O(k·p) for k right-hand sides, each iteration one pass of curvature products over the
    training data, so the data must be at hand at solve time (kept from `fit`, or given to `load_state_dict`)."""

    name = "cg"
    needs_positive_regularization = True  # the curvature of a network is singular: λ = 0 leaves CG nothing to converge to
    solve_block_bytes = 2 * 2**30  # block CG: more rows per block, fewer passes over the data in all

    def __init__(
        self,
        *args,
        rtol: float = 1e-7,
        atol: float = 0.0,
        maxiter: int | None = None,
        preconditioner: CgPreconditioner = "none",
        preconditioner_rank: int = 20,
        hutchinson_probes: int = 32,
        seed: int = 0,
        block: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.options = (rtol, atol, maxiter, preconditioner, preconditioner_rank, hutchinson_probes, seed, block)

    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        return CgSolver(curvature, lam, *self.options)
