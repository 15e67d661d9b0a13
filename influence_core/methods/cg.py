"""Influence by conjugate gradients on matrix-free curvature products, optionally preconditioned."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks import BlockCurvature
from ..errors import RegularizationError
from ..solvers import DEFAULT_MAXITER, NotConverged, SolveInfo, block_conjugate_gradient, conjugate_gradient
from .influence_model import BlockSolver, InfluenceFunctionModel
from .options import CurvatureOptions, ProjectedOptions, option
from .preconditioners import PRECONDITIONERS, PreconditionerName


@dataclass(frozen=True, kw_only=True)
class CgOptions(CurvatureOptions, ProjectedOptions):
    rtol: float = option(1e-6, "Relative tolerance", "Stop each system when its residual falls below rtol·|b|.", gt=0, lt=1)
    maxiter: int | None = option(None, "Max iterations", f"Iteration cap per solve; reached, it only warns (empty: min(10·p, {DEFAULT_MAXITER}), and reaching it fails the run).", ge=1)
    preconditioner: PreconditionerName = option("none", "Preconditioner", "jacobi: Hutchinson estimate of the diagonal; nystroem: low-rank Nyström sketch.")
    preconditioner_rank: int = option(20, "Preconditioner rank", "Rank of the Nyström preconditioner.", ge=1)
    hutchinson_probes: int = option(32, "Hutchinson probes", "Random probes for the Jacobi diagonal estimate.", ge=1)
    seed: int = option(0, "Seed", "Seed of the preconditioner's random sketch or probes.")
    block: bool = option(True, "Block CG", "Solve a chunk's queries together in one shared Krylov space (far fewer iterations); off: one independent CG per query.")


class CgSolver(BlockSolver):
    """CG on (C + λI) X = G: block CG over all rows at once (default) or one independent, vectorised run per row,
    with the preconditioner the options name (`preconditioners`), fitted once per block."""

    def __init__(self, curvature: BlockCurvature, lam: float, options: CgOptions) -> None:
        super().__init__(curvature, lam)
        self.options = options
        kind = PRECONDITIONERS.get(options.preconditioner)
        self.preconditioner = None if kind is None else kind(lam, options.preconditioner_rank, options.hutchinson_probes, options.seed)
        self.last_solve: SolveInfo | None = None

    def fit(self) -> None:
        if self.preconditioner is not None:
            self.preconditioner.fit(self.curvature)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self.preconditioner is None else self.preconditioner.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.preconditioner is not None:
            self.preconditioner.load_state_dict(state)

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        o = self.options
        solve = block_conjugate_gradient if o.block else conjugate_gradient
        try:
            solution, self.last_solve = solve(
                lambda v: self.curvature.matmat(v) + self.lam * v,
                features,
                rtol=o.rtol,
                maxiter=o.maxiter,
                preconditioner=None if self.preconditioner is None else self.preconditioner.apply,
            )
        except NotConverged as exc:  # λ too small for this curvature: say which λ would do, for the mode in force
            unaided = exc.at_cap and self.preconditioner is None  # slow, not indefinite: a preconditioner speeds it up
            also = ", or set method.preconditioner: nystroem (a low-rank sketch that cuts the iterations)" if unaided else ""
            raise RegularizationError(exc.problem, self.lam, max(10 * self.lam, 1e-3 * exc.largest_seen), self.second_order_mode, also) from None
        self.curvature.work.solves += len(features)
        self.curvature.work.solver_iterations += self.last_solve.iterations
        return solution


class CgInfluence(InfluenceFunctionModel):
    """Never forms C: memory O(k·p) for k right-hand sides, each iteration one pass of curvature products over the
    training data, so the data must be at hand at solve time (kept from `fit`, or given to `load_state_dict`)."""

    name = "cg"
    title = "Conjugate gradients"
    summary = "Conjugate gradients on matrix-free curvature products."
    Options = CgOptions
    options: CgOptions
    needs_positive_regularization = True  # the curvature of a network is singular: λ = 0 leaves CG nothing to converge to
    solve_block_bytes = 2 * 2**30  # block CG: more rows per block, fewer passes over the data in all
    solves_on_data = True

    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        return CgSolver(curvature, lam, self.options)
