"""Every curvature method against DirectInfluence (exact up to round-off), in float64, with λ ≤ 1e-2·trace(C)/p."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from influence_core import (
    ArnoldiInfluence,
    CgInfluence,
    ConfigError,
    DataInfInfluence,
    DirectInfluence,
    IdentityInfluence,
    LissaInfluence,
    NumericalError,
    NystroemSketchInfluence,
)
from tests.problems import ExplicitGaussNewton, Problem, linear_regression, logistic_regression, mean_curvature, mlp

N_QUERIES = 5  # iterative solves cost grows with the number of right-hand sides


@pytest.fixture(scope="module", params=["linear", "logistic", "mlp"])
def problem(request) -> tuple[Problem, float]:
    make = {"linear": linear_regression, "logistic": logistic_regression, "mlp": mlp}[request.param]
    pr = make()
    return pr, 1e-2 * mean_curvature(pr)


def scores(im, pr: Problem, queries: int = N_QUERIES) -> torch.Tensor:
    return im.fit(pr.train).influences(pr.x_test[:queries], pr.y_test[:queries], *pr.train)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(np.corrcoef(a.ravel().numpy(), b.ravel().numpy())[0, 1])


def dim(pr: Problem) -> int:
    return sum(p.numel() for p in pr.model.parameters())


EXACT = {
    "arnoldi full rank": lambda pr, lam: ArnoldiInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton", rank=dim(pr), krylov_dim=dim(pr)),
    "nystroem full rank": lambda pr, lam: NystroemSketchInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton", rank=dim(pr)),
    "cg": lambda pr, lam: CgInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton", rtol=1e-12),
    "cg jacobi": lambda pr, lam: CgInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton", rtol=1e-12, preconditioner="jacobi"),
    "cg nystroem": lambda pr, lam: CgInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton", rtol=1e-12, preconditioner="nystroem", preconditioner_rank=min(50, dim(pr))),
}


@pytest.mark.parametrize("method", list(EXACT))
def test_exact_methods_match_direct(problem, method):
    pr, lam = problem
    expected = scores(DirectInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton"), pr)
    assert relative_error(scores(EXACT[method](pr, lam), pr), expected) < 1e-6


@pytest.mark.parametrize("method", ["cg", "arnoldi"])
def test_hessian_mode_matches_direct_on_mlp(method):
    """The exact Hessian at a strict minimum of the L2-penalised objective: λ = weight decay makes it that objective's."""
    pr = mlp()
    lam = pr.weight_decay
    expected = scores(DirectInfluence(pr.model, pr.loss, lam, second_order_mode="hessian"), pr)
    im = CgInfluence(pr.model, pr.loss, lam, rtol=1e-12, second_order_mode="hessian") if method == "cg" else ArnoldiInfluence(pr.model, pr.loss, lam, rank=dim(pr), krylov_dim=dim(pr), second_order_mode="hessian")
    assert relative_error(scores(im, pr), expected) < 1e-6


def test_lissa_converges_to_direct():
    """Deterministic (full-batch) LiSSA with scale just above the largest eigenvalue, at enough depth (λ a tenth of
    the mean curvature: depth 1,200 measured Pearson 0.9987 and relative error 0.048 here; at a hundredth, 5,000
    steps were needed for 0.99)."""
    pr = logistic_regression()
    lam = 1e-1 * mean_curvature(pr)
    expected = scores(DirectInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton"), pr, 3)
    top = ArnoldiInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton", rank=1, krylov_dim=30).fit(pr.train)
    scale = 1.05 * (float(top.solvers["all"].values[0]) + lam)
    im = LissaInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton", depth=1500, lissa_batch_size=len(pr.y_train), scale=scale, rtol=1e-10)
    got = scores(im, pr, 3)
    assert pearson(got, expected) >= 0.999 and relative_error(got, expected) < 0.05


def test_stochastic_lissa_with_repeats_on_linear_regression():
    pr = linear_regression()
    lam = 1e-2 * mean_curvature(pr)
    expected = scores(DirectInfluence(pr.model, pr.loss, lam, second_order_mode="hessian"), pr)
    im = LissaInfluence(pr.model, pr.loss, lam, depth=400, repeats=4, lissa_batch_size=16, scale=20.0, second_order_mode="hessian")
    assert pearson(scores(im, pr), expected) >= 0.99


def test_lissa_divergence_says_to_raise_scale():
    pr = linear_regression()
    with pytest.raises(NumericalError, match=r"raise method.scale \(now 0.1\)"):
        scores(LissaInfluence(pr.model, pr.loss, 1e-3, scale=0.1, depth=500, second_order_mode="hessian"), pr)


@pytest.mark.parametrize(
    "make, factor, floor",
    [
        # Documented correlations with Direct (Gauss-Newton), measured on these problems (see the method docstrings)
        (lambda pr, lam: DataInfInfluence(pr.model, pr.loss, lam, block_structure="layer_wise"), 10.0, 0.88),
        (lambda pr, lam: IdentityInfluence(pr.model, pr.loss), 10.0, 0.88),
        (lambda pr, lam: DataInfInfluence(pr.model, pr.loss, lam, block_structure="layer_wise"), 1e-2, 0.18),
    ],
    ids=["datainf large λ", "identity large λ", "datainf small λ"],
)
def test_approximations_reach_their_documented_correlation(problem, make, factor, floor):
    pr, lam = problem
    lam = lam / 1e-2 * factor
    expected = scores(DirectInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton", block_structure="layer_wise"), pr, 20)
    assert pearson(scores(make(pr, lam), pr, 20), expected) >= floor


# -- the three cases pyDVL 0.10 gets wrong ----------------------------------------------------------------
@pytest.mark.parametrize("block", [True, False], ids=["block CG", "independent CG"])
@pytest.mark.parametrize("preconditioner", ["none", "jacobi", "nystroem"])
def test_cg_with_more_right_hand_sides_than_parameters(preconditioner, block):
    """n_test = 40 > p = 7: block CG (the default) deflates the dependent search directions and still converges, as
    does one independent run per right-hand side; both match Direct, with and without a preconditioner."""
    pr = linear_regression()  # p = 7
    lam = 1e-2 * mean_curvature(pr)
    many = torch.randn(40, pr.x_train.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    targets = torch.randn(40, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    expected = DirectInfluence(pr.model, pr.loss, lam, second_order_mode="hessian").fit(pr.train).influences(many, targets, *pr.train)
    cg = CgInfluence(pr.model, pr.loss, lam, rtol=1e-12, preconditioner=preconditioner, preconditioner_rank=3, block=block, second_order_mode="hessian")
    got = cg.fit(pr.train).influences(many, targets, *pr.train)
    assert relative_error(got, expected) < 1e-6
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda pr, lam: DirectInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton"),
        lambda pr, lam: CgInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton", rtol=1e-12),
        lambda pr, lam: NystroemSketchInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton", rank=dim(pr)),
    ],
    ids=["direct", "cg", "nystroem"],
)
def test_gauss_newton_is_averaged_by_examples_not_batches(make):
    """One batch, batches of unequal size (64, ..., 44), and a DataLoader of them: the same curvature."""
    pr = mlp()
    lam = 1e-2 * mean_curvature(pr)
    x_t, y_t = pr.x_test[:N_QUERIES], pr.y_test[:N_QUERIES]
    single = make(pr, lam).fit(pr.train).influences(x_t, y_t, *pr.train)
    loader = DataLoader(TensorDataset(*pr.train), batch_size=64)
    unequal = make(pr, lam).fit(loader).influences(x_t, y_t, *pr.train)
    assert relative_error(unequal, single) < 1e-9


@pytest.mark.parametrize(
    "make",
    [
        lambda pr, lams: DirectInfluence(pr.model, pr.loss, lams, second_order_mode="gauss_newton", block_structure="layer_wise"),
        lambda pr, lams: CgInfluence(pr.model, pr.loss, lams, second_order_mode="gauss_newton", block_structure="layer_wise", rtol=1e-12),
        lambda pr, lams: ArnoldiInfluence(pr.model, pr.loss, lams, second_order_mode="gauss_newton", block_structure="layer_wise", rank=dim(pr), krylov_dim=dim(pr)),
        lambda pr, lams: NystroemSketchInfluence(pr.model, pr.loss, lams, second_order_mode="gauss_newton", block_structure="layer_wise", rank=dim(pr)),
        lambda pr, lams: LissaInfluence(pr.model, pr.loss, lams, second_order_mode="gauss_newton", block_structure="layer_wise", depth=2000, lissa_batch_size=1000, scale=1.5, rtol=1e-11),
    ],
    ids=["direct", "cg", "arnoldi", "nystroem", "lissa"],
)
def test_regularization_per_block(make):
    pr = mlp(n_train=100, hidden=4)  # p = 310: full-rank Arnoldi and LiSSA's steps stay cheap
    explicit = ExplicitGaussNewton.of(pr, N_QUERIES)
    lams = {"0": 2.0 * explicit.mean_curvature, "2": 20.0 * explicit.mean_curvature}  # the two Linear layers
    got = make(pr, lams).fit(pr.train).influences(pr.x_test[:N_QUERIES], pr.y_test[:N_QUERIES], *pr.train)
    assert relative_error(got, explicit.influences(lams)) < 1e-6


def test_scores_do_not_depend_on_batch_size_or_chunking():
    """Batches of 300 against batches that do not divide the 300 rows (Arnoldi's 37: 9 batches per product, where
    7's 43 took 6 s), and scores computed in chunks of 50 training rows; any λ (a tenth of the mean curvature: CG in
    fewer steps)."""
    pr = mlp()
    lam = 1e-1 * mean_curvature(pr)
    x_t, y_t = pr.x_test[:N_QUERIES], pr.y_test[:N_QUERIES]
    for make, small in (
        (lambda b: ArnoldiInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton", rank=30, krylov_dim=80, batch_size=b), 37),
        (lambda b: CgInfluence(pr.model, pr.loss, lam, second_order_mode="gauss_newton", rtol=1e-12, batch_size=b), 64),
        (lambda b: DataInfInfluence(pr.model, pr.loss, lam, batch_size=b, block_structure="full"), 7),
    ):
        reference = make(300).fit(pr.train).influences(x_t, y_t, *pr.train)
        im = make(small).fit(pr.train)
        factors = im.influence_factors(x_t, y_t)
        chunked = torch.cat([im.influences_from_factors(factors, pr.x_train[i : i + 50], pr.y_train[i : i + 50]) for i in range(0, 300, 50)], dim=1)
        assert relative_error(chunked, reference) < 1e-9


# -- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [NystroemSketchInfluence, DataInfInfluence])
def test_methods_needing_positive_regularization_refuse_zero(cls):
    pr = linear_regression()
    with pytest.raises(ConfigError, match=r"method.regularization: .* got λ=0.0.*> 0"):
        cls(pr.model, pr.loss, 0.0)


@pytest.mark.parametrize("cls", [ArnoldiInfluence, NystroemSketchInfluence])
def test_rank_above_p_is_refused(cls):
    pr = linear_regression()
    with pytest.raises(ConfigError, match=r"method.rank: rank=8 but the model has p=7 parameters"):
        cls(pr.model, pr.loss, 1e-3, rank=8)


def test_unknown_option_is_refused():
    pr = linear_regression()
    with pytest.raises(TypeError, match="depth"):
        CgInfluence(pr.model, pr.loss, 1e-3, depth=10)


def test_regularization_dict_needs_layer_wise_and_every_block():
    pr = mlp()
    with pytest.raises(ConfigError, match="layer_wise"):
        DirectInfluence(pr.model, pr.loss, {"0": 1.0, "2": 1.0}, second_order_mode="hessian")
    with pytest.raises(ConfigError, match=r"missing \['2'\]"):
        DirectInfluence(pr.model, pr.loss, {"0": 1.0}, block_structure="layer_wise", second_order_mode="hessian")
