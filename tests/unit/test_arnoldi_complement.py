"""Arnoldi with the complement (issue 23): the top-r eigenbasis plus the rest of the space at 1/(μ̄ + λ), against an
explicit float64 reference built from torch.linalg.eigh of the explicit Gauss-Newton matrix (not from Lanczos)."""

from __future__ import annotations

import pytest
import torch

from influence_core import ArnoldiInfluence, DirectInfluence
from influence_core.spectral import hutchinson_trace
from influence_core.self_influence import Sketch
from tests.problems import mlp

LAM, RANK = 1e-3, 20


@pytest.fixture(scope="module")
def problem():
    pr = mlp(n_train=200, n_test=10, hidden=8)
    grads = DirectInfluence(pr.model, "cross_entropy", LAM, second_order_mode="hessian").objective.per_sample_grads(pr.x_train, pr.y_train)
    query = DirectInfluence(pr.model, "cross_entropy", LAM, second_order_mode="hessian").objective.per_sample_grads(pr.x_test, pr.y_test)
    direct = DirectInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton").fit(pr.train)
    curvature = direct.solvers["all"].factor @ direct.solvers["all"].factor.T - LAM * torch.eye(grads.shape[1], dtype=torch.float64)
    values, vectors = torch.linalg.eigh(curvature)
    return pr, grads, query, curvature, values.flip(0), vectors.flip(1)


def reference_inverse(values: torch.Tensor, vectors: torch.Tensor, complement: float) -> torch.Tensor:
    """V diag(1/(μ+λ)) Vᵀ + c (I − VVᵀ) for the top-RANK eigenpairs."""
    v = vectors[:, :RANK]
    return v @ torch.diag(1 / (values[:RANK] + LAM)) @ v.T + complement * (torch.eye(len(v), dtype=v.dtype) - v @ v.T)


def test_complement_weight_is_one_over_the_mean_remaining_eigenvalue(problem):
    pr, _, _, curvature, values, _ = problem
    im = ArnoldiInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton", rank=RANK, krylov_dim=4 * RANK, complement=True).fit(pr.train)
    mean_rest = float(values[RANK:].mean())
    assert im.solvers["all"].complement_weight == pytest.approx(1 / (mean_rest + LAM), rel=0.1)  # Hutchinson, 80 probes


def test_scores_and_self_influence_equal_the_explicit_low_rank_inverse(problem):
    pr, grads, query, _, values, vectors = problem
    im = ArnoldiInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton", rank=RANK, krylov_dim=200, complement=True).fit(pr.train)
    inverse = reference_inverse(values, vectors, im.solvers["all"].complement_weight)
    torch.testing.assert_close(im.influences(pr.x_test, pr.y_test, *pr.train), query @ inverse @ grads.T, rtol=1e-6, atol=1e-8)
    assert isinstance(im.self_influence_plan("auto"), Sketch)
    torch.testing.assert_close(im.self_influences(*pr.train), (grads * (grads @ inverse)).sum(1), rtol=1e-6, atol=1e-8)


def test_complement_is_closer_to_exact_than_the_top_eigenbasis_alone(problem):
    """At r ≪ p the plain eigenbasis drops the small-curvature directions that dominate (C + λI)⁻¹: its scores
    correlate less with the exact ones (Pearson over all pairs; LDS, like it, ignores the scale)."""
    pr, grads, query, curvature, _, _ = problem
    exact = query @ torch.linalg.solve(curvature + LAM * torch.eye(len(curvature), dtype=torch.float64), grads.T)
    corr = {}
    for complement in (False, True):
        im = ArnoldiInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton", rank=RANK, krylov_dim=4 * RANK, complement=complement).fit(pr.train)
        scores = im.influences(pr.x_test, pr.y_test, *pr.train)
        corr[complement] = float(torch.corrcoef(torch.stack([scores.ravel(), exact.ravel()]))[0, 1])
    assert corr[True] > corr[False] + 0.1, corr


def test_deflated_hutchinson_estimates_the_trace_outside_the_basis(problem):
    _, _, _, curvature, values, vectors = problem
    rest = hutchinson_trace(lambda z: z @ curvature, len(curvature), 2000, 0, torch.float64, torch.device("cpu"), deflate=vectors[:, :RANK])
    assert rest == pytest.approx(float(values[RANK:].sum()), rel=0.05)


def test_full_rank_with_complement_is_exact(problem):
    pr, grads, query, curvature, _, _ = problem
    p = grads.shape[1]
    im = ArnoldiInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton", rank=p, krylov_dim=p, complement=True).fit(pr.train)
    exact = query @ torch.linalg.solve(curvature + LAM * torch.eye(p, dtype=torch.float64), grads.T)
    torch.testing.assert_close(im.influences(pr.x_test, pr.y_test, *pr.train), exact, rtol=1e-6, atol=1e-8)


def test_the_pipeline_parameter_reaches_the_library(problem):
    """method.complement builds the library's ArnoldiInfluence with the complement kept (and off by default)."""
    from influence_core.pipeline.specs import ArnoldiMethod

    pr = problem[0]
    on = ArnoldiMethod(regularization=LAM, rank=RANK, complement=True).build(pr.model, "cross_entropy")
    off = ArnoldiMethod(regularization=LAM, rank=RANK).build(pr.model, "cross_entropy")
    assert (on.options.complement, off.options.complement) == (True, False)
