"""FastIF's fast s_test: LiSSA with single-example batches (B = 1), averaged over T independently seeded repeats,
converges to the exact query factors (CG, itself checked against the closed form) as T grows."""

from __future__ import annotations

import torch
from torch import nn

from influence_core import CgInfluence, LissaInfluence

LAM = 0.1
TOLERANCE = 0.1  # relative error of the factors at T = 64, B = 1, J = 30 (measured: 0.078 at T = 50, 0.043 at T = 200)


def unit_sphere_regression(n: int = 40, n_test: int = 5) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Least squares on inputs of norm 1, so every single-example curvature 2·[x 1][x 1]ᵀ has eigenvalue 4 and a
    scale of 4 + λ keeps every step of a B = 1 recursion contracting. Returns the closed-form factors too."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n + n_test, 2, generator=gen, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    y = x @ torch.tensor([1.0, -2.0], dtype=torch.float64) + 0.3 + 0.1 * torch.randn(n + n_test, generator=gen, dtype=torch.float64)
    design = torch.cat([x, torch.ones(n + n_test, 1, dtype=torch.float64)], 1)  # parameters in order: weight, bias
    theta = torch.linalg.lstsq(design[:n], y[:n, None]).solution[:, 0]
    model = nn.Linear(2, 1).double()
    with torch.no_grad():
        model.weight.copy_(theta[:2][None]), model.bias.copy_(theta[2:])
    hessian = 2 * design[:n].T @ design[:n] / n  # of the mean squared error
    gradients = 2 * (design[n:] @ theta - y[n:])[:, None] * design[n:]
    closed = torch.linalg.solve(hessian + LAM * torch.eye(3, dtype=torch.float64), gradients.T).T
    return model, x[:n], y[:n], x[n:], y[n:], closed


def test_single_example_lissa_averaged_over_repeats_converges_to_cg():
    model, x, y, x_test, y_test, closed = unit_sphere_regression()
    cg = CgInfluence(model, "mse", LAM, rtol=1e-12, second_order_mode="hessian").fit((x, y)).influence_factors(x_test, y_test)
    torch.testing.assert_close(cg, closed, rtol=1e-10, atol=1e-12)

    def error(repeats: int) -> float:
        im = LissaInfluence(model, "mse", LAM, depth=30, repeats=repeats, lissa_batch_size=1, scale=4.0 + LAM, rtol=1e-14, second_order_mode="hessian").fit((x, y))
        return float((im.influence_factors(x_test, y_test) - cg).norm() / cg.norm())

    few, many = error(4), error(64)
    assert many < TOLERANCE
    assert many < 0.5 * few  # the noise of single-example batches averages out, about as 1/√T


def test_repeats_are_independent_terms_of_the_average():
    """The factors are the in-order sum of the repeats' terms, each reproducible on its own (as a Dask task is)."""
    model, x, y, x_test, y_test, _ = unit_sphere_regression()
    im = LissaInfluence(model, "mse", LAM, depth=30, repeats=3, lissa_batch_size=1, scale=4.0 + LAM, second_order_mode="hessian").fit((x, y))
    terms = [im.repeat_factors(x_test, y_test, r) for r in (2, 0, 1)]  # any order, any process
    assert not torch.equal(terms[0], terms[1])  # own seeds: distinct batches
    assert torch.equal(im.influence_factors(x_test, y_test), terms[1] + terms[2] + terms[0])
