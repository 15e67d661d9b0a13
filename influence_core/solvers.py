"""Iterative solvers for (C + λI) X = B with many right-hand sides at once."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import NumericalError

MatMat = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SolveInfo:
    iterations: int
    max_relative_residual: float
    unconverged: int


def conjugate_gradient(
    matmat: MatMat,
    rhs: torch.Tensor,
    *,
    rtol: float = 1e-7,
    atol: float = 0.0,
    maxiter: int | None = None,
    preconditioner: MatMat | None = None,
) -> tuple[torch.Tensor, SolveInfo]:
    """Solve `A x_i = b_i` for every row b_i of `rhs` (k, p) by independent, vectorised (P)CG runs.

    Each right-hand side keeps its own step sizes, so any number of rows works, also more rows than
    unknowns (a block-Krylov method would break down there). Converged rows drop out of later products.
    """
    k, p = rhs.shape
    maxiter = maxiter or 10 * p
    precond = preconditioner or (lambda r: r)
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    z = precond(r)
    d = z.clone()
    rz = (r * z).sum(1)
    target = torch.clamp(rtol * rhs.norm(dim=1), min=atol)
    active = r.norm(dim=1) > target
    iterations = 0
    while bool(active.any()) and iterations < maxiter:
        iterations += 1
        idx = active.nonzero().squeeze(1)
        ad = matmat(d[idx])
        curvature = (d[idx] * ad).sum(1)
        if bool((curvature <= 0).any()):
            raise NumericalError(
                "CG met a direction of non-positive curvature: C + λI is not positive definite. "
                "Raise method.regularization or use second_order_mode='gauss_newton'"
            )
        alpha = rz[idx] / curvature
        x[idx] += alpha[:, None] * d[idx]
        r[idx] -= alpha[:, None] * ad
        z_idx = precond(r[idx])
        rz_new = (r[idx] * z_idx).sum(1)
        d[idx] = z_idx + (rz_new / rz[idx])[:, None] * d[idx]
        rz[idx] = rz_new
        active[idx] = r[idx].norm(dim=1) > target[idx]
    relative = (r.norm(dim=1) / rhs.norm(dim=1).clamp_min(torch.finfo(rhs.dtype).tiny)).max().item()
    info = SolveInfo(iterations, relative, int(active.sum()))
    if info.unconverged:
        warnings.warn(
            f"CG: {info.unconverged} of {k} systems did not reach rtol={rtol} in {maxiter} iterations "
            f"(worst relative residual {relative:.2e}); raise method.maxiter or method.regularization, or add a preconditioner",
            RuntimeWarning,
            stacklevel=2,
        )
    return x, info
