"""Self-influence as its own choice: each method's exact form against an explicit float64 reference
gᵢᵀ(C + λI)⁻¹gᵢ, the low-rank estimate against the exact values, `auto` choosing by cost, and the work counted."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import spearmanr

from influence_core import ArnoldiInfluence, CgInfluence, DataInfInfluence, DirectInfluence, EkfacInfluence, IdentityInfluence, NystroemSketchInfluence
from influence_core.self_influence import Diagonal, Sketch, Solve
from tests.problems import mlp

LAM = 1e-2


@pytest.fixture(scope="module")
def problem():
    pr = mlp(n_train=200, n_test=10, hidden=8)
    grads = DirectInfluence(pr.model, "cross_entropy", LAM, second_order_mode="hessian").objective.per_sample_grads(pr.x_train, pr.y_train)  # vmap reference
    direct = DirectInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton").fit(pr.train)
    matrix = direct.solvers["all"].factor @ direct.solvers["all"].factor.T  # C + λI, float64
    exact = (grads * torch.linalg.solve(matrix, grads.T).T).sum(1)
    return pr, grads, matrix, exact


def test_direct_and_cg_exact_equal_the_explicit_quadratic_form(problem):
    pr, _, _, exact = problem
    direct = DirectInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton").fit(pr.train)
    torch.testing.assert_close(direct.self_influences(*pr.train), exact, rtol=1e-8, atol=1e-10)
    cg = CgInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton", rtol=1e-10, batch_size=200).fit(pr.train)
    before = cg.work.copy()
    torch.testing.assert_close(cg.self_influences(*pr.train), exact, rtol=1e-6, atol=1e-8)
    done = cg.work - before
    assert done.solves == 200 and done.product_rows > 0  # one solve per example, and its curvature products, counted


def test_identity_is_the_squared_gradient_norm(problem):
    pr, grads, _, _ = problem
    im = IdentityInfluence(pr.model, "cross_entropy").fit(pr.train)
    torch.testing.assert_close(im.self_influences(*pr.train), (grads**2).sum(1), rtol=1e-10, atol=1e-12)


def test_arnoldi_at_full_rank_is_exact(problem):
    pr, grads, matrix, exact = problem
    p = grads.shape[1]
    im = ArnoldiInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton", rank=p, krylov_dim=p).fit(pr.train)
    assert isinstance(im.self_influence_plan("auto"), Diagonal)
    torch.testing.assert_close(im.self_influences(*pr.train), exact, rtol=1e-6, atol=1e-8)


def test_nystroem_self_influence_is_its_own_woodbury_inverse(problem):
    pr, grads, _, _ = problem
    im = NystroemSketchInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton", rank=20).fit(pr.train)
    solver = im.solvers["all"]
    u = solver.basis
    inverse = u @ torch.diag(1 / (solver.values + LAM)) @ u.T + (torch.eye(len(u), dtype=u.dtype) - u @ u.T) / LAM
    torch.testing.assert_close(im.self_influences(*pr.train), (grads * (grads @ inverse)).sum(1), rtol=1e-8, atol=1e-10)


def test_ekfac_self_influence_is_diagonal_in_its_eigenbasis(problem):
    pr, grads, _, _ = problem
    im = EkfacInfluence(pr.model, "cross_entropy", LAM, fisher="exact").fit(pr.train)
    assert isinstance(im.self_influence_plan("auto"), Diagonal)
    expected, start = torch.zeros(200, dtype=torch.float64), 0
    for layer in im.layers:  # explicit: rotate each formed gradient, divide by Λ + λ
        solver = im.solvers[layer.block]
        width = sum(p.numel() for p in layer.module.parameters())
        rotated = solver.q_s.T @ layer.to_matrix(grads[:, start : start + width]) @ solver.q_a
        expected += (rotated**2 / (solver.eigenvalues + LAM)).sum(dim=(1, 2))
        start += width
    torch.testing.assert_close(im.self_influences(*pr.train), expected, rtol=1e-10, atol=1e-12)


def test_datainf_exact_is_its_closed_form(problem):
    pr, grads, _, _ = problem
    im = DataInfInfluence(pr.model, "cross_entropy", LAM, block_structure="full").fit(pr.train)
    norms = (grads**2).sum(1)
    inner = grads @ grads.T
    expected = (norms - ((inner**2) / (LAM + norms)[None, :]).mean(1)) / LAM  # (gᵢᵀgᵢ − 1/n Σⱼ (gⱼᵀgᵢ)²/(λ+‖gⱼ‖²))/λ
    torch.testing.assert_close(im.self_influences(*pr.train), expected, rtol=1e-8, atol=1e-10)


def test_low_rank_estimate_is_exact_at_full_rank_and_ranks_well_below(problem):
    pr, grads, _, exact = problem
    p = grads.shape[1]
    direct = DirectInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton").fit(pr.train)
    torch.testing.assert_close(direct.self_influences(*pr.train, mode="lowrank", rank=p), exact, rtol=1e-8, atol=1e-10)
    cg = CgInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton", rtol=1e-7).fit(pr.train)
    for im in (direct, cg):
        estimate = im.self_influences(*pr.train, mode="lowrank", rank=32)
        rho = spearmanr(estimate.numpy(), exact.numpy()).statistic
        assert rho >= 0.9, f"{im.name}: Spearman {rho:.3f}"


def test_auto_picks_exact_where_cheap_and_the_sketch_elsewhere(problem):
    pr, _, _, _ = problem
    direct = DirectInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton").fit(pr.train)
    assert isinstance(direct.self_influence_plan("auto", n_queries=2), Solve)  # as cheap per example as forming C: exact
    cg = CgInfluence(pr.model, "cross_entropy", LAM, second_order_mode="gauss_newton", rtol=1e-7).fit(pr.train)
    small = cg.self_influence_plan("auto", n_queries=20)
    assert isinstance(small, Sketch) and len(small.rows) == 10  # half the queries
    before = cg.work.copy()
    plan = cg.self_influence_plan("auto", rank=32, n_queries=500)
    assert isinstance(plan, Sketch) and len(plan.rows) == 32
    assert (cg.work - before).product_rows == 32 * 200 and (cg.work - before).solves == 0  # one sketch pass, no solves
    assert cg.self_influence_plan("off") is None
