"""K-FAC / EK-FAC, gradient projections (random, LoGra, TRAK's projected solve) and per-module scores."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from influence_core import DirectInfluence, EkfacInfluence, IdentityInfluence, KfacInfluence, Projection
from influence_core.layers import capture, select_layers
from influence_core.objective import Objective
from influence_core.task import Classification
from tests.problems import ExplicitGaussNewton, Problem, digits, fit_classifier, mean_curvature, minimise, mlp


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(np.corrcoef(a.ravel().numpy(), b.ravel().numpy())[0, 1])


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def scores(im, pr: Problem) -> torch.Tensor:
    return im.fit(pr.train).influences(pr.x_test, pr.y_test, *pr.train)


@pytest.fixture(scope="module")
def regression_mlp() -> Problem:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(520, 8, generator=gen, dtype=torch.float64)
    y = torch.sin(x @ torch.randn(8, 3, generator=gen, dtype=torch.float64)).sum(1) + 0.1 * torch.randn(520, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(500):
        opt.zero_grad()
        F.mse_loss(model(x[:500]).squeeze(-1), y[:500]).backward()
        opt.step()
    minimise(model, "mse", x[:500], y[:500], 1e-3)
    return Problem("regression MLP", model, "mse", x[:500], y[:500], x[500:], y[500:], 1e-3)


@pytest.fixture(scope="module")
def small_cnn() -> Problem:
    x, y, xt, yt = digits(400, 20)
    x, xt = x.reshape(-1, 1, 8, 8), xt.reshape(-1, 1, 8, 8)
    torch.manual_seed(0)
    model = fit_classifier(nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(64, 10)).double(), x, y)
    return Problem("small CNN", model, "cross_entropy", x, y, xt, yt, 1e-2)


@pytest.mark.parametrize("cls", [KfacInfluence, EkfacInfluence])
def test_kfac_is_exact_for_one_linear_layer_with_squared_loss(cls):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(100, 5, generator=gen, dtype=torch.float64), torch.randn(100, 3, generator=gen, dtype=torch.float64)
    model = nn.Linear(5, 3).double()
    pr = Problem("linear", model, "mse", x, y, x[:9] + 0.5, y[:9], 0.0)
    expected = scores(DirectInfluence(model, "mse", 1e-3, second_order_mode="gauss_newton"), pr)
    assert relative_error(scores(cls(model, "mse", 1e-3, batch_size=13), pr), expected) < 1e-6


@pytest.fixture(scope="module")
def layer_wise_direct() -> dict[str, tuple[float, torch.Tensor]]:
    """Per problem, its λ and the exact layer-wise Gauss-Newton scores (Direct's, as test_methods checks), from one
    dense build for both, once for the module (the CNN's build: ~3 s)."""
    return {}


@pytest.mark.parametrize("problem, fisher, floor", [("regression_mlp", None, 0.95), ("small_cnn", "exact", 0.95), ("small_cnn", "sampled", 0.94)])
def test_ekfac_agrees_with_direct(problem, fisher, floor, request, layer_wise_direct):
    """λ = trace(C)/p, the curvature's mean eigenvalue (the gradient dot product reaches only 0.6-0.8 there);
    the reference is Direct on the layer-wise Gauss-Newton matrix that EK-FAC approximates. With sampled labels
    the CNN measured 0.947: sampling noise costs about 0.01."""
    pr = request.getfixturevalue(problem)
    if problem not in layer_wise_direct:
        exact = ExplicitGaussNewton.of(pr)
        layer_wise_direct[problem] = exact.mean_curvature, exact.influences(exact.mean_curvature)
    lam, expected = layer_wise_direct[problem]
    assert pearson(scores(EkfacInfluence(pr.model, pr.loss, lam, fisher=fisher), pr), expected) >= floor


def test_ekfac_on_a_digits_classifier_mlp():
    """Measured 0.94 on this classifier (its output layer is far from Kronecker-structured): documented, not 0.95."""
    x, y, xt, yt = digits(1000, 20)
    torch.manual_seed(0)
    model = fit_classifier(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).double(), x, y)
    pr = Problem("mlp", model, "cross_entropy", x, y, xt, yt, 1e-2)
    lam = mean_curvature(pr)
    expected = scores(DirectInfluence(model, pr.loss, lam, second_order_mode="gauss_newton", block_structure="layer_wise"), pr)
    assert pearson(scores(EkfacInfluence(model, pr.loss, lam), pr), expected) >= 0.93


def test_factors_and_scores_do_not_depend_on_batching():
    """Sampled-label Fisher draws are tied to example indices, so batch size changes nothing."""
    pr = mlp()
    runs = [EkfacInfluence(pr.model, pr.loss, 1e-2, batch_size=b).fit(pr.train) for b in (300, 7)]
    for name in runs[0].solvers:
        for key, value in runs[0].solvers[name].state_dict().items():
            torch.testing.assert_close(runs[1].solvers[name].state_dict()[key].abs(), value.abs(), rtol=1e-9, atol=1e-12)
    a = runs[0].influences(pr.x_test, pr.y_test, *pr.train)
    chunked = torch.cat([runs[1].influences(pr.x_test, pr.y_test, pr.x_train[i : i + 64], pr.y_train[i : i + 64]) for i in range(0, 300, 64)], dim=1)
    assert relative_error(chunked, a) < 1e-9


@pytest.mark.parametrize("make_model, shape", [(lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4)), (6,)), (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Flatten(), nn.Linear(3 * 5 * 5, 4)), (2, 5, 5))])
def test_logra_equals_explicit_projection_of_materialised_gradients(make_model, shape):
    torch.manual_seed(0)
    model = make_model().double()
    x, y = torch.randn(7, *shape, dtype=torch.float64), torch.randint(0, 4, (7,))
    layers = select_layers(model)
    projector = Projection("logra", dim=9, seed=3).build(layers)
    cap = capture(model, layers, Classification(), x, y)
    full = Objective(model, "cross_entropy").per_sample_grads(x, y)  # vmap, parameter order
    offset = 0
    for i, layer in enumerate(layers):
        size = sum(p.numel() for p in layer.module.parameters())
        matrices = layer.to_matrix(full[:, offset : offset + size])
        offset += size
        phi_out, phi_in = projector.factors(layer, i, matrices)
        explicit = matrices.reshape(7, -1) @ torch.kron(phi_out, phi_in).T
        torch.testing.assert_close(projector.project_capture(layer, i, cap), explicit, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
def test_random_projection_preserves_inner_products(kind):
    layer = select_layers(nn.Sequential(nn.Linear(400, 10, bias=False)))[0]
    gen = torch.Generator().manual_seed(0)
    vectors = torch.randn(40, 10, 400, generator=gen, dtype=torch.float64)
    projector = Projection(kind, dim=2048, seed=5, block_mb=0.5).build([layer])  # blocks of 64 columns, never the whole Φ
    assert projector.block_columns() < 400
    projected = projector.project_matrices(layer, 0, vectors)
    exact, approx = vectors.reshape(40, -1) @ vectors.reshape(40, -1).T, projected @ projected.T
    norms = exact.diagonal().sqrt()
    worst = ((approx - exact).abs() / torch.outer(norms, norms)).max()
    assert worst < 4 * (2 * np.log(40 * 40) / 2048) ** 0.5  # JL: ε ~ √(log(pairs)/k)
    again = Projection(kind, dim=2048, seed=5, block_mb=0.5).build([layer]).project_matrices(layer, 0, vectors)
    torch.testing.assert_close(again, projected, rtol=0, atol=0)
    other = Projection(kind, dim=2048, seed=6, block_mb=0.5).build([layer]).project_matrices(layer, 0, vectors)
    assert not torch.allclose(other, projected)


def test_trak_projected_direct_solve_matches_its_formula():
    """Direct with a projection solves (XᵀX/n + λI)⁻¹ in the projected space, X = projected training gradients."""
    pr = mlp()
    projection = Projection("gaussian", dim=32, seed=2)
    im = DirectInfluence(pr.model, pr.loss, 1e-3, projection=projection, second_order_mode="hessian").fit(pr.train)
    got = im.influences(pr.x_test, pr.y_test, *pr.train)
    layers = select_layers(pr.model)
    projector = projection.build(layers)
    full, offset, parts = Objective(pr.model, pr.loss).per_sample_grads(*pr.train), 0, []
    full_test, parts_test = Objective(pr.model, pr.loss).per_sample_grads(pr.x_test, pr.y_test), []
    for i, layer in enumerate(layers):
        size = sum(p.numel() for p in layer.module.parameters())
        parts.append(projector.project_matrices(layer, i, layer.to_matrix(full[:, offset : offset + size])))
        parts_test.append(projector.project_matrices(layer, i, layer.to_matrix(full_test[:, offset : offset + size])))
        offset += size
    x_train, x_test = torch.cat(parts, 1), torch.cat(parts_test, 1)
    curvature = x_train.T @ x_train / len(x_train) + 1e-3 * torch.eye(x_train.shape[1], dtype=torch.float64)
    assert relative_error(got, x_test @ torch.linalg.solve(curvature, x_train.T)) < 1e-8


@pytest.mark.parametrize("kind, floor", [("gaussian", 0.95), ("logra", 0.75)])
def test_ekfac_with_projection_tracks_unprojected_ekfac(kind, floor):
    """Full-space EK-FAC; both sides whitened in its eigenbasis, then projected. A Kronecker (LoGra) projection
    concentrates worse than a dense one at equal size: measured 0.78 at 1,024, 0.87 at 4,096, 0.92 at 16,384
    coordinates per layer, against 0.97 for Gaussian at 1,024."""
    pr = mlp()
    lam = mean_curvature(pr)
    reference = EkfacInfluence(pr.model, pr.loss, lam).fit(pr.train)
    projected = EkfacInfluence(pr.model, pr.loss, lam, projection=Projection(kind, dim=1024, seed=0)).fit(pr.train)
    assert pearson(projected.influences(pr.x_test, pr.y_test, *pr.train), reference.influences(pr.x_test, pr.y_test, *pr.train)) >= floor
    # self-influence is the exact full-space quadratic form, projection or not
    torch.testing.assert_close(projected.self_influences(*pr.train), reference.self_influences(*pr.train), rtol=1e-9, atol=1e-12)
    assert projected.gradient_features(pr.x_test, pr.y_test).shape == (20, 2 * 1024)


def test_identity_with_projection_approximates_gradient_dot_products():
    pr = mlp()
    exact = scores(IdentityInfluence(pr.model, pr.loss), pr)
    assert pearson(scores(IdentityInfluence(pr.model, pr.loss, projection=Projection("rademacher", dim=1024)), pr), exact) >= 0.97


@pytest.mark.parametrize(
    "make",
    [
        lambda pr: EkfacInfluence(pr.model, pr.loss, 1e-2),
        lambda pr: EkfacInfluence(pr.model, pr.loss, 1e-2, projection=Projection("logra", dim=64)),
        lambda pr: DirectInfluence(pr.model, pr.loss, 1e-2, second_order_mode="gauss_newton"),
        lambda pr: DirectInfluence(pr.model, pr.loss, 1e-2, projection=Projection("gaussian", dim=32), second_order_mode="hessian"),
    ],
    ids=["ekfac", "ekfac+logra", "direct", "trak"],
)
def test_per_module_scores_sum_to_total(make):
    pr = mlp()
    im = make(pr).fit(pr.train)
    parts = im.influences_by_module(pr.x_test, pr.y_test, *pr.train)
    assert set(parts) == {"0", "2"}
    total = im.influences(pr.x_test, pr.y_test, *pr.train)
    torch.testing.assert_close(sum(parts.values()), total, rtol=1e-9, atol=1e-12)


def test_scores_restricted_to_chosen_modules_and_untracked_parameters_listed():
    pr = mlp()
    model = nn.Sequential(nn.LayerNorm(64), *pr.model).double()  # a parameterised module K-FAC cannot track
    last = EkfacInfluence(model, pr.loss, 1e-2, modules=["3"]).fit(pr.train)
    assert last.excluded_parameters == ["0.weight", "0.bias", "1.weight", "1.bias"]
    with pytest.raises(Exception, match="not Linear or Conv2d"):
        EkfacInfluence(model, pr.loss, 1e-2, modules=["0"])
    everything = EkfacInfluence(model, pr.loss, 1e-2)
    assert everything.excluded_parameters == ["0.weight", "0.bias"]
    assert [layer.name for layer in EkfacInfluence(model, pr.loss, 1e-2, modules=["Linear"]).layers] == ["1", "3"]  # by type
    direct_last = DirectInfluence(model, pr.loss, 1e-2, second_order_mode="gauss_newton", modules=["3"]).fit(pr.train)
    by_module = DirectInfluence(model, pr.loss, 1e-2, second_order_mode="gauss_newton", block_structure="layer_wise").fit(pr.train)
    torch.testing.assert_close(
        direct_last.influences(pr.x_test, pr.y_test, *pr.train),
        by_module.influences_by_module(pr.x_test, pr.y_test, *pr.train)["3"],
        rtol=1e-8,
        atol=1e-12,
    )
    assert pearson(last.influences(pr.x_test, pr.y_test, *pr.train), direct_last.influences(pr.x_test, pr.y_test, *pr.train)) > 0.8
