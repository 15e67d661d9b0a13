"""Low-rank eigendecompositions of a symmetric operator from products alone: Lanczos and the Nyström sketch."""

from __future__ import annotations

from typing import Callable

import torch

from .errors import NumericalError

MatMat = Callable[[torch.Tensor], torch.Tensor]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def lanczos(matmat: MatMat, dim: int, rank: int, krylov_dim: int, seed: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`rank` eigenpairs (largest magnitude) from a Krylov space of `krylov_dim` with full reorthogonalisation.

    On breakdown (an invariant subspace was found) the iteration restarts from a fresh random direction
    orthogonal to the basis, so `krylov_dim = dim` recovers the whole spectrum exactly, repeated eigenvalues
    included. Returns eigenvalues (rank,) and orthonormal eigenvectors as columns (dim, rank).
    """
    m = min(krylov_dim, dim)
    gen = _generator(seed)
    basis = torch.zeros(m, dim, dtype=torch.float64, device=device)
    alpha = torch.zeros(m, dtype=torch.float64)
    beta = torch.zeros(m, dtype=torch.float64)

    def fresh(count: int) -> torch.Tensor:
        q = torch.randn(dim, generator=gen, dtype=torch.float64).to(device)
        for _ in range(2):
            q -= basis[:count].T @ (basis[:count] @ q)
        return q / q.norm()

    q = fresh(0)
    scale = 0.0
    for j in range(m):
        basis[j] = q
        w = matmat(q.to(dtype)[None])[0].to(torch.float64)
        alpha[j] = q @ w
        for _ in range(2):  # full reorthogonalisation, twice is enough
            w -= basis[: j + 1].T @ (basis[: j + 1] @ w)
        norm = w.norm()
        scale = max(scale, abs(alpha[j].item()), norm.item())
        if j + 1 == m:
            break
        if norm <= 1e-10 * max(scale, 1e-300):
            beta[j] = 0.0
            q = fresh(j + 1)
        else:
            beta[j] = norm
            q = w / norm
    tridiagonal = torch.diag(alpha) + torch.diag(beta[: m - 1], 1) + torch.diag(beta[: m - 1], -1)
    values, vectors = torch.linalg.eigh(tridiagonal.to(device))
    keep = torch.argsort(values.abs(), descending=True)[:rank]
    return values[keep].to(dtype), (basis.T @ vectors[:, keep]).to(dtype)


def nystroem(matmat: MatMat, dim: int, rank: int, seed: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Randomised Nyström approximation C ≈ U diag(Λ) Uᵀ of a positive semi-definite operator (Tropp et al., 2017).

    One pass of `rank` products; stabilised by a tiny shift. At `rank = dim` it is exact. Returns Λ (rank,),
    U (dim, rank), and the trace estimate (dim/rank)·tr(ΩᵀCΩ) from the same products (unbiased: Ω has Haar-random
    orthonormal columns).
    """
    gen = _generator(seed)
    omega, _ = torch.linalg.qr(torch.randn(dim, rank, generator=gen, dtype=torch.float64))
    omega = omega.to(device)
    sketch = matmat(omega.T.to(dtype)).T.to(torch.float64)  # (dim, rank) = C Ω
    # the products' own rounding (float32's, when the operator works in it) sets how indefinite C Ω may look
    shift = torch.finfo(dtype).eps * dim**0.5 * torch.linalg.matrix_norm(sketch, ord=2)
    shifted = sketch + shift * omega
    core = omega.T @ shifted
    factor, info = torch.linalg.cholesky_ex((core + core.T) / 2)
    if int(info) != 0:
        raise NumericalError("the Nyström sketch needs positive semi-definite curvature: use second_order_mode='gauss_newton'")
    b = torch.linalg.solve_triangular(factor, shifted.T, upper=False).T  # shifted @ factor⁻ᵀ
    u, sigma, _ = torch.linalg.svd(b, full_matrices=False)
    values = torch.clamp(sigma**2 - shift, min=0.0)
    trace = float(torch.trace(omega.T @ sketch)) * dim / rank
    return values.to(dtype), u.to(dtype), trace


def hutchinson_trace(matmat: MatMat, dim: int, probes: int, seed: int, dtype: torch.dtype, device: torch.device, deflate: torch.Tensor | None = None) -> float:
    """Hutchinson's estimate of trace(C) from `probes` Rademacher vectors, in one batch of products. With `deflate`
    (orthonormal columns V), the trace of C on the complement of V, (I − VVᵀ)C(I − VVᵀ), whose estimate has far less
    variance when V holds C's top eigenvectors (as in Hutch++)."""
    z = (torch.randint(0, 2, (probes, dim), generator=_generator(seed)) * 2 - 1).to(dtype=dtype, device=device)
    if deflate is not None:
        z = z - (z @ deflate) @ deflate.T
    return float((z * matmat(z)).sum()) / probes


def frobenius_estimate(matmat: MatMat, dim: int, probes: int, seed: int, dtype: torch.dtype, device: torch.device) -> float:
    """Hutchinson's estimate of ‖C‖_F, from `probes` Rademacher vectors z in one batch of products: E‖Cz‖² = ‖C‖_F²,
    which bounds C's largest eigenvalue in magnitude from above, for a symmetric C of any sign."""
    z = (torch.randint(0, 2, (probes, dim), generator=_generator(seed)) * 2 - 1).to(dtype=dtype, device=device)
    return float((matmat(z).to(torch.float64) ** 2).sum() / probes) ** 0.5
