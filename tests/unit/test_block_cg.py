"""Block CG (the default solver of CgInfluence) against a dense solve, and against independent CG on a real model."""

from __future__ import annotations

import pytest
import torch

from influence_core import CgInfluence, DirectInfluence, NumericalError
from influence_core.solvers import block_conjugate_gradient, conjugate_gradient


def spd(p: int, condition: float, seed: int = 0) -> torch.Tensor:
    """A random symmetric positive definite matrix whose eigenvalues spread log-evenly over `condition`."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=gen, dtype=torch.float64))
    values = torch.logspace(0, float(torch.log10(torch.tensor(condition))), p, dtype=torch.float64)
    return (q * values) @ q.T


class Counted:
    """A matrix-product operator that counts the vectors it was applied to."""

    def __init__(self, a: torch.Tensor) -> None:
        self.a, self.vectors = a, 0

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        self.vectors += len(v)
        return v @ self.a


@pytest.mark.parametrize("k", [1, 40])
def test_block_cg_solves_like_a_dense_solve_in_fewer_products(k):
    a = spd(200, 1e4)
    b = torch.randn(k, 200, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    exact = torch.linalg.solve(a, b.T).T
    block, independent = Counted(a), Counted(a)
    x, info = block_conjugate_gradient(block, b, rtol=1e-10)
    x_ind, _ = conjugate_gradient(independent, b, rtol=1e-10)
    assert info.unconverged == 0 and info.max_relative_residual <= 1e-10
    torch.testing.assert_close(x, exact, rtol=1e-6, atol=1e-9 * float(exact.abs().max()))
    torch.testing.assert_close(x_ind, exact, rtol=1e-6, atol=1e-9 * float(exact.abs().max()))
    if k > 1:  # a shared Krylov space: measured 280 products against 27,527 for independent runs
        assert block.vectors < independent.vectors / 10


def test_dependent_and_surplus_right_hand_sides_are_deflated():
    """Repeated rows, linear combinations and more rows than unknowns: the directions are deflated, not broken down."""
    a = spd(30, 100.0)
    base = torch.randn(8, 30, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    b = torch.cat([base, 2 * base, base[:3] - base[3:6], torch.randn(60, 30, dtype=torch.float64)])
    op = Counted(a)
    x, info = block_conjugate_gradient(op, b, rtol=1e-12)
    assert info.unconverged == 0
    torch.testing.assert_close(x, torch.linalg.solve(a, b.T).T, rtol=1e-8, atol=1e-10)
    assert op.vectors <= 30 * info.iterations  # never more directions than unknowns per iteration


def test_preconditioned_block_cg_matches_and_zero_rows_stay_zero():
    a = spd(120, 1e3) + torch.diag(torch.linspace(1, 1e3, 120, dtype=torch.float64))
    b = torch.randn(10, 120, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    b[4] = 0
    jacobi = torch.diagonal(a)
    x, info = block_conjugate_gradient(Counted(a), b, rtol=1e-11, preconditioner=lambda r: r / jacobi)
    assert info.unconverged == 0
    torch.testing.assert_close(x, torch.linalg.solve(a, b.T).T, rtol=1e-7, atol=1e-12)
    assert bool((x[4] == 0).all())


def test_indefinite_matrix_is_a_clear_error():
    a = spd(20, 10.0) - 5.0 * torch.eye(20, dtype=torch.float64)
    with pytest.raises(NumericalError, match="regularization"):
        block_conjugate_gradient(Counted(a), torch.randn(5, 20, dtype=torch.float64))


def test_unconverged_solve_warns_with_the_fix():
    with pytest.warns(RuntimeWarning, match="method.maxiter"):
        _, info = block_conjugate_gradient(Counted(spd(50, 1e6)), torch.randn(3, 50, dtype=torch.float64), rtol=1e-14, maxiter=2)
    assert info.unconverged == 3 and info.iterations == 2


def test_block_and_independent_cg_give_direct_scores_on_an_mlp():
    """On a trained MLP (float64, Hessian and Gauss-Newton), both solvers reproduce DirectInfluence's scores."""
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(200, 10, generator=gen, dtype=torch.float64), torch.randint(0, 3, (200,), generator=gen)
    model = torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    x_test, y_test = x[:25] + 0.1, y[:25]
    for mode in ("gauss_newton", "hessian"):
        direct = DirectInfluence(model, "cross_entropy", 1e-2, second_order_mode=mode).fit((x, y)).influences(x_test, y_test, x, y)
        for block in (True, False):
            cg = CgInfluence(model, "cross_entropy", 1e-2, second_order_mode=mode, rtol=1e-10, block=block).fit((x, y))
            torch.testing.assert_close(cg.influences(x_test, y_test, x, y), direct, rtol=1e-6, atol=1e-8 * float(direct.abs().max()))
