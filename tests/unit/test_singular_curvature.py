"""Singular or indefinite curvature never runs silently: λ = 0 is refused at construction where the method needs
λ > 0; an iterative solve reports its iteration, residual and an estimate while it runs, and stops at its cap
(min(10·p, 1000)) with one line naming method.maxiter, method.regularization and a λ that works; the advice fits the second-order mode in force."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from influence_core import CgInfluence, ConfigError, DirectInfluence, EkfacInfluence, LissaInfluence, NumericalError
from influence_core import solvers
from influence_core.solvers import CAP_PER_UNKNOWN, block_conjugate_gradient, conjugate_gradient


def problem(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A small untrained MLP in float64: its Gauss-Newton matrix is singular (the softmax's constant direction), its
    Hessian indefinite."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(24, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (24,), generator=gen)
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).double(), x, y


@pytest.mark.parametrize("method", [CgInfluence, LissaInfluence, EkfacInfluence])
def test_zero_regularization_is_refused_at_construction(method):
    model, *_ = problem()
    with pytest.raises(ConfigError) as refused:
        method(model, "cross_entropy", 0.0)
    assert refused.value.field == "method.regularization" and "> 0" in refused.value.fix


def test_progress_is_logged_with_iteration_and_residual(monkeypatch, caplog):
    monkeypatch.setattr(solvers, "PROGRESS_SECONDS", 0.0)  # every iteration, instead of every 30 s
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(30, 30, generator=gen, dtype=torch.float64))
    a = (q * torch.logspace(0, 3, 30, dtype=torch.float64)) @ q.T
    b = torch.randn(2, 30, generator=gen, dtype=torch.float64)
    for solve in (block_conjugate_gradient, conjugate_gradient):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="influence_core.solvers"):
            x, info = solve(lambda v: v @ a, b, rtol=1e-10)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == info.iterations and info.unconverged == 0
        assert lines[0].split(":")[1].strip().startswith(f"iteration 1 of at most {CAP_PER_UNKNOWN * 30}")
        last = float(lines[-1].split("worst relative residual ")[1].split(" ")[0])  # at the last iteration, as the solve reports it
        assert "s per iteration; about 0 more iterations" in lines[-1]
        assert last == pytest.approx(info.max_relative_residual, rel=1e-2)
        torch.testing.assert_close(x, torch.linalg.solve(a, b.T).T, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("mode", ["gauss_newton", "hessian"])
@pytest.mark.parametrize("block", [True, False])
def test_a_solve_that_cannot_converge_stops_at_its_cap_naming_a_lambda_that_works(mode, block, monkeypatch):
    monkeypatch.setattr(solvers, "CAP_PER_UNKNOWN", 2)  # 2·p iterations instead of 10·p: the same stop, sooner
    model, x, y = problem()
    p = sum(t.numel() for t in model.parameters())
    lam = 1e-12
    im = CgInfluence(model, "cross_entropy", lam, second_order_mode=mode, rtol=1e-30, block=block).fit((x, y))  # a tolerance no float64 solve reaches
    with pytest.raises(ConfigError) as failed:
        im.influence_factors(x[:4], y[:4])
    error = failed.value
    assert isinstance(error, NumericalError) and error.field == "method.regularization"
    assert ("non-positive curvature" in error.problem) or (f"in {2 * p} iterations (method.maxiter unset: min(2·p, 1000)" in error.problem)
    assert ("gauss_newton" in error.fix) == (mode == "hessian")  # never advise the mode already in force
    suggested = float(error.fix.split("to ")[1].split(" ")[0])
    assert suggested > lam
    if mode == "gauss_newton":  # the suggested λ works: the same solve converges with it
        fixed = CgInfluence(model, "cross_entropy", suggested, second_order_mode=mode, rtol=1e-8, block=block).fit((x, y))
        direct = DirectInfluence(model, "cross_entropy", suggested, second_order_mode=mode).fit((x, y))
        torch.testing.assert_close(fixed.influence_factors(x[:4], y[:4]), direct.influence_factors(x[:4], y[:4]), rtol=1e-5, atol=1e-8)


def test_direct_on_an_indefinite_hessian_names_a_lambda_that_works():
    model, x, y = problem()
    with pytest.raises(ConfigError) as failed:
        DirectInfluence(model, "cross_entropy", 0.0, second_order_mode="hessian").fit((x, y))
    error = failed.value
    assert error.field == "method.regularization" and "smallest eigenvalue of C is -" in error.problem
    assert "gauss_newton" in error.fix and "\n" not in str(error)
    suggested = float(error.fix.split("to ")[1].split(" ")[0])
    DirectInfluence(model, "cross_entropy", suggested, second_order_mode="hessian").fit((x, y))  # now positive definite


@pytest.mark.parametrize("seed", range(5))
def test_a_float32_nystroem_sketch_of_a_singular_psd_operator_is_exact_at_full_rank(seed):
    """A rank-6 PSD operator on p = 30 in float32 (a network's Gauss-Newton in miniature): its sketch's core looks
    indefinite at float32's rounding, so the stabilising shift must be float32's, not float64's (which refused every
    such sketch, and with it CG's `auto` self-influence in index_training); at rank p it reproduces the operator."""
    from influence_core.spectral import nystroem

    b = torch.randn(30, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    a = (b @ b.T).float()
    values, vectors, trace = nystroem(lambda v: v @ a, 30, 30, seed, torch.float32, torch.device("cpu"))
    rebuilt = (vectors.double() * values.double()) @ vectors.double().T
    assert float((rebuilt - a.double()).abs().max()) <= 1e-5 * float(a.abs().max())
    assert trace == pytest.approx(float(torch.trace(a.double())), rel=1e-5)
