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
    products: int  # vectors multiplied by A, summed over iterations
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
    iterations = products = 0
    while bool(active.any()) and iterations < maxiter:
        iterations += 1
        idx = active.nonzero().squeeze(1)
        products += len(idx)
        ad = matmat(d[idx])
        curvature = (d[idx] * ad).sum(1)
        if bool((curvature <= 0).any()):
            raise _not_positive_definite()
        alpha = rz[idx] / curvature
        x[idx] += alpha[:, None] * d[idx]
        r[idx] -= alpha[:, None] * ad
        z_idx = precond(r[idx])
        rz_new = (r[idx] * z_idx).sum(1)
        d[idx] = z_idx + (rz_new / rz[idx])[:, None] * d[idx]
        rz[idx] = rz_new
        active[idx] = r[idx].norm(dim=1) > target[idx]
    return x, _finish(rhs, r, active, rtol, maxiter, iterations, products)


def _not_positive_definite() -> NumericalError:
    return NumericalError(
        "CG met a direction of non-positive curvature: C + λI is not positive definite. "
        "Raise method.regularization or use second_order_mode='gauss_newton'"
    )


def _finish(rhs: torch.Tensor, residuals: torch.Tensor, active: torch.Tensor, rtol: float, maxiter: int, iterations: int, products: int) -> SolveInfo:
    """The solve's summary; warns when some systems stopped at `maxiter` short of the tolerance."""
    relative = (residuals.norm(dim=1) / rhs.norm(dim=1).clamp_min(torch.finfo(rhs.dtype).tiny)).max().item()
    info = SolveInfo(iterations, products, relative, int(active.sum()))
    if info.unconverged:
        warnings.warn(
            f"CG: {info.unconverged} of {len(rhs)} systems did not reach rtol={rtol} in {maxiter} iterations "
            f"(worst relative residual {relative:.2e}); raise method.maxiter or method.regularization, or add a preconditioner",
            RuntimeWarning,
            stacklevel=3,
        )
    return info


def _orthonormal_directions(w: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis (columns) of span(w)'s numerically independent part: the columns are scaled to unit
    norm, then directions whose singular value falls below √(m)·eps of the largest are dropped (deflation), so a
    block of nearly dependent residuals, or more right-hand sides than unknowns, never breaks the iteration."""
    w = w / w.norm(dim=0).clamp_min(torch.finfo(w.dtype).tiny)
    q, r = torch.linalg.qr(w)
    u, s, _ = torch.linalg.svd(r)
    keep = s > s[0] * w.shape[1] ** 0.5 * torch.finfo(w.dtype).eps * 10
    return q @ u[:, keep]


def block_conjugate_gradient(
    matmat: MatMat,
    rhs: torch.Tensor,
    *,
    rtol: float = 1e-7,
    atol: float = 0.0,
    maxiter: int | None = None,
    preconditioner: MatMat | None = None,
) -> tuple[torch.Tensor, SolveInfo]:
    """Solve `A x_i = b_i` for every row b_i of `rhs` (k, p) by block (P)CG: all rows share one growing Krylov space,
    so each row's error is minimised over a space at least as large as its own CG's, in far fewer iterations when
    k is large. Search directions are orthonormalised and deflated each step (breakdown-free block CG, Ji & Li 2017);
    the products per iteration are one per independent direction, never more than min(k, p)."""
    k, p = rhs.shape
    maxiter = maxiter or 10 * p
    precond = preconditioner or (lambda r: r)
    b = rhs.T  # (p, k): columns are systems
    x = torch.zeros_like(b)
    r = b.clone()
    target = torch.clamp(rtol * b.norm(dim=0), min=atol)
    active = r.norm(dim=0) > target
    d = ad = None
    iterations = products = 0
    while bool(active.any()) and iterations < maxiter:
        iterations += 1
        z = precond(r[:, active].T).T
        if d is not None:  # A-orthogonal to the previous block: z − D (DᵀAD)⁻¹ (AD)ᵀ z
            z = z - d @ torch.cholesky_solve(ad.T @ z, chol)
        d = _orthonormal_directions(z)
        if d.shape[1] == 0:
            break
        ad = matmat(d.T.contiguous()).T
        products += d.shape[1]
        chol, failed = torch.linalg.cholesky_ex(0.5 * (d.T @ ad + ad.T @ d))
        if bool(failed):
            raise _not_positive_definite()
        alpha = torch.cholesky_solve(d.T @ r, chol)
        x += d @ alpha
        r -= ad @ alpha
        active = r.norm(dim=0) > target
    return x.T.contiguous(), _finish(rhs, r.T, active, rtol, maxiter, iterations, products)
