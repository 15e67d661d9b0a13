"""Iterative solvers for (C + λI) X = B with many right-hand sides at once."""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import NumericalError

MatMat = Callable[[torch.Tensor], torch.Tensor]

log = logging.getLogger(__name__)
PROGRESS_SECONDS = float(os.environ.get("INFLUENCE_PROGRESS_SECONDS", 30))  # a running solve reports at least this often
CAP_PER_UNKNOWN = 10  # without method.maxiter, a solve stops after min(10·p, DEFAULT_MAXITER) iterations and fails
DEFAULT_MAXITER = 1000  # naming method.maxiter: CG needs about √κ·ln(2/rtol)/2 iterations, 1,000 covers κ ≈ 1e4 at rtol 1e-6; beyond, precondition


def default_cap(p: int) -> int:
    """The iterations a solve of p unknowns may take when method.maxiter is not set."""
    return min(CAP_PER_UNKNOWN * p, DEFAULT_MAXITER)


class NotConverged(NumericalError):
    """A solve that stopped short of its tolerance (at the default cap) or met non-positive curvature; carries what
    the method needs to suggest a λ: the largest curvature seen along the search directions."""

    def __init__(self, problem: str, largest_seen: float, at_cap: bool = False) -> None:
        self.problem, self.largest_seen, self.at_cap = problem, largest_seen, at_cap
        super().__init__(f"{problem}: raise method.regularization (largest curvature seen {largest_seen:.2e})")


def duration(seconds: float) -> str:
    """`seconds` as a person reads it: 42 s, 7 min, 3.5 h."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


class Progress:
    """Logs the iteration, the systems above tolerance, the worst relative residual and an estimate of what is left
    at least every PROGRESS_SECONDS, and tracks the largest Rayleigh quotient dᵀAd/dᵀd met (a lower bound of the
    largest eigenvalue), for the advice on failure."""

    def __init__(self, name: str, maxiter: int, rhs_norms: torch.Tensor, rtol: float) -> None:
        self.name, self.maxiter, self.norms, self.rtol = name, maxiter, rhs_norms.clamp_min(torch.finfo(rhs_norms.dtype).tiny), rtol
        self.start = self.last = time.monotonic()
        self.largest = 0.0

    def saw(self, directions: torch.Tensor, products: torch.Tensor) -> None:
        """`directions` and A·`directions`, one per row."""
        quotients = (directions * products).sum(1) / (directions * directions).sum(1).clamp_min(torch.finfo(directions.dtype).tiny)
        self.largest = max(self.largest, float(quotients.max()))

    def step(self, iteration: int, residual_norms: torch.Tensor, active: torch.Tensor) -> None:
        """Log a progress line when PROGRESS_SECONDS have passed since the last one."""
        now = time.monotonic()
        if now - self.last < PROGRESS_SECONDS:
            return
        self.last = now
        worst = float((residual_norms / self.norms).max())
        log.info(
            "%s: iteration %d of at most %d (method.maxiter), %d of %d systems above tolerance, worst relative residual %.2e (rtol %g), %s",
            self.name, iteration, self.maxiter, int(active.sum()), len(active), worst, self.rtol, self.estimate(iteration, worst, (now - self.start) / iteration),
        )

    def estimate(self, iteration: int, worst: float, per_iteration: float) -> str:
        """What is left, at the worst residual's mean rate of decrease so far (it starts at 1)."""
        pace = f"{per_iteration:.2g} s per iteration"
        rate = -math.log(max(worst, 1e-300)) / iteration  # decades fall geometrically in CG's steady phase
        if rate <= 0:
            return f"{pace}; no estimate yet (the residual has not fallen)"
        needed = max(0, math.ceil(math.log(worst / self.rtol) / rate))
        if iteration + needed > self.maxiter:
            return f"{pace}; at this rate the cap comes first (in {duration((self.maxiter - iteration) * per_iteration)}): set method.preconditioner: nystroem, or raise method.regularization"
        return f"{pace}; about {needed} more iterations ({duration(needed * per_iteration)}) at this rate"


class PassProgress:
    """Logs the training rows a pass over the data has done, its time so far and an estimate of what is left, at
    least every PROGRESS_SECONDS (forming an explicit curvature matrix, say): a line goes out once another step as
    long as the last would pass the cadence, so the gaps stay within it while the steps keep their pace."""

    def __init__(self, what: str, rows: int) -> None:
        self.what, self.rows = what, rows
        self.start = self.last = self.previous = time.monotonic()

    def step(self, done: float) -> None:
        """`done` rows of the pass are finished (a fraction of a batch's rows when its work is split further)."""
        now = time.monotonic()
        pace, self.previous = now - self.previous, now
        if now + pace - self.last < PROGRESS_SECONDS or done <= 0:
            return
        self.last = now
        elapsed = now - self.start
        log.info("%s: %.0f of %d training rows, %s so far, about %s left", self.what, done, self.rows, duration(elapsed), duration(elapsed * (self.rows - done) / done))


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
    capped, maxiter = maxiter is None, maxiter or default_cap(p)
    precond = preconditioner or (lambda r: r)
    progress = Progress("CG", maxiter, rhs.norm(dim=1), rtol)
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
        progress.saw(d[idx], ad)
        curvature = (d[idx] * ad).sum(1)
        if bool((curvature <= 0).any()):
            raise _not_positive_definite(progress)
        alpha = rz[idx] / curvature
        x[idx] += alpha[:, None] * d[idx]
        r[idx] -= alpha[:, None] * ad
        z_idx = precond(r[idx])
        rz_new = (r[idx] * z_idx).sum(1)
        d[idx] = z_idx + (rz_new / rz[idx])[:, None] * d[idx]
        rz[idx] = rz_new
        active[idx] = r[idx].norm(dim=1) > target[idx]
        progress.step(iterations, r.norm(dim=1), active)
    return x, _finish(rhs, r, active, rtol, maxiter, iterations, products, progress if capped else None)


def _not_positive_definite(progress: Progress) -> NotConverged:
    return NotConverged("CG met a direction of non-positive curvature: C + λI is not positive definite", progress.largest)


def _finish(rhs: torch.Tensor, residuals: torch.Tensor, active: torch.Tensor, rtol: float, maxiter: int, iterations: int, products: int, capped: Progress | None) -> SolveInfo:
    """The solve's summary. Systems short of the tolerance at the default cap (`capped`) fail; at a `maxiter` the
    caller chose, they only warn."""
    relative = (residuals.norm(dim=1) / rhs.norm(dim=1).clamp_min(torch.finfo(rhs.dtype).tiny)).max().item()
    info = SolveInfo(iterations, products, relative, int(active.sum()))
    if info.unconverged and capped is not None:
        raise NotConverged(f"CG did not converge in {maxiter} iterations (method.maxiter unset: min({CAP_PER_UNKNOWN}·p, {DEFAULT_MAXITER}); worst relative residual {relative:.1e}, rtol {rtol:g})", capped.largest, at_cap=True)
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
    capped, maxiter = maxiter is None, maxiter or default_cap(p)
    precond = preconditioner or (lambda r: r)
    progress = Progress("block CG", maxiter, rhs.norm(dim=1), rtol)
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
        progress.saw(d.T, ad.T)
        chol, failed = torch.linalg.cholesky_ex(0.5 * (d.T @ ad + ad.T @ d))
        if bool(failed):
            raise _not_positive_definite(progress)
        alpha = torch.cholesky_solve(d.T @ r, chol)
        x += d @ alpha
        r -= ad @ alpha
        active = r.norm(dim=0) > target
        progress.step(iterations, r.norm(dim=0), active)
    return x.T.contiguous(), _finish(rhs, r.T, active, rtol, maxiter, iterations, products, progress if capped else None)
