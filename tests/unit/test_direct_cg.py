"""DirectInfluence against the closed form, and CgInfluence against DirectInfluence, in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from influence_core import CgInfluence, DirectInfluence, NumericalError

torch.manual_seed(0)


def half_mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """½(wᵀx − y)², so the Hessian of the mean loss is exactly XᵀX/n."""
    return 0.5 * F.mse_loss(outputs.squeeze(-1), targets)


@pytest.fixture
def regression():
    n, d = 60, 5
    x = torch.randn(n, d, dtype=torch.float64)
    y = x @ torch.randn(d, dtype=torch.float64) + 0.3 * torch.randn(n, dtype=torch.float64)
    model = nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():  # the least-squares fit, so θ̂ is a minimiser as influence functions assume
        model.weight.copy_(torch.linalg.lstsq(x, y[:, None]).solution.T)
    x_test, y_test = torch.randn(7, d, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    return model, x, y, x_test, y_test


def closed_form(model, x, y, x_test, y_test, lam):
    w = model.weight.detach()[0]
    g_train = (x @ w - y)[:, None] * x
    g_test = (x_test @ w - y_test)[:, None] * x_test
    h = x.T @ x / len(x) + lam * torch.eye(x.shape[1], dtype=x.dtype)
    return g_test @ torch.linalg.solve(h, g_train.T)


@pytest.mark.parametrize("lam", [1e-3, 0.0])
def test_direct_equals_closed_form_linear_regression(regression, lam):
    model, x, y, x_test, y_test = regression
    scores = DirectInfluence(model, half_mse, lam, batch_size=7, second_order_mode="hessian").fit((x, y)).influences(x_test, y_test, x, y)
    expected = closed_form(model, x, y, x_test, y_test, lam)
    assert scores.dtype == torch.float64
    torch.testing.assert_close(scores, expected, rtol=1e-8, atol=0)


def test_named_mse_has_twice_the_curvature(regression):
    """With the plain mean squared error ℓ = (wᵀx − y)², gradients and Hessian both double: scores double."""
    model, x, y, x_test, y_test = regression
    lam = 1e-3
    scores = DirectInfluence(model, "mse", 2 * lam, second_order_mode="hessian").fit((x, y)).influences(x_test, y_test, x, y)
    torch.testing.assert_close(scores, 2 * closed_form(model, x, y, x_test, y_test, lam), rtol=1e-8, atol=0)


def test_self_influence_is_quadratic_form(regression):
    model, x, y, *_ = regression
    lam = 1e-2
    w = model.weight.detach()[0]
    g = (x @ w - y)[:, None] * x
    h = x.T @ x / len(x) + lam * torch.eye(x.shape[1], dtype=x.dtype)
    expected = (g * torch.linalg.solve(h, g.T).T).sum(1)
    got = DirectInfluence(model, half_mse, lam, second_order_mode="hessian").fit((x, y)).self_influences(x, y)
    torch.testing.assert_close(got, expected, rtol=1e-8, atol=0)


def test_cg_matches_direct_linear_regression(regression):
    model, x, y, x_test, y_test = regression
    direct = DirectInfluence(model, half_mse, 1e-3, second_order_mode="hessian").fit((x, y)).influences(x_test, y_test, x, y)
    cg = CgInfluence(model, half_mse, 1e-3, batch_size=11, rtol=1e-12, second_order_mode="hessian").fit((x, y)).influences(x_test, y_test, x, y)
    torch.testing.assert_close(cg, direct, rtol=1e-5, atol=0)


@pytest.fixture(scope="module")
def digits_mlp():
    """An MLP trained on digits to near convergence, in float64."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x[:400] / 16.0)
    y = torch.tensor(y[:400])
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 10)).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)
    for _ in range(300):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, x[:300], y[:300], x[300:330], y[300:330]


@pytest.mark.parametrize("mode", ["gauss_newton", "hessian"])
def test_direct_and_cg_agree_on_mlp(digits_mlp, mode):
    model, x, y, x_test, y_test = digits_mlp
    lam = 1e-2
    direct = DirectInfluence(model, "cross_entropy", lam, second_order_mode=mode).fit((x, y)).influences(x_test, y_test, x, y)
    cg = CgInfluence(model, "cross_entropy", lam, second_order_mode=mode, rtol=1e-8).fit((x, y)).influences(x_test, y_test, x, y)
    pearson = np.corrcoef(direct.ravel().numpy(), cg.ravel().numpy())[0, 1]
    assert pearson > 0.999


def test_results_follow_float32_parameters(digits_mlp):
    model, x, y, x_test, y_test = digits_mlp
    model32 = nn.Sequential(nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 10))
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    scores = DirectInfluence(model32, "cross_entropy", 1e-2, second_order_mode="gauss_newton").fit((x.float(), y)).influences(x_test.float(), y_test, x.float(), y)
    reference = DirectInfluence(model, "cross_entropy", 1e-2, second_order_mode="gauss_newton").fit((x, y)).influences(x_test, y_test, x, y)
    assert scores.dtype == torch.float32
    assert np.corrcoef(scores.ravel().numpy(), reference.ravel().numpy())[0, 1] > 0.9999


def test_scores_do_not_depend_on_batch_size(digits_mlp):
    model, x, y, x_test, y_test = digits_mlp
    runs = [DirectInfluence(model, "cross_entropy", 1e-2, batch_size=b, second_order_mode="hessian").fit((x, y)).influences(x_test, y_test, x, y) for b in (300, 64, 7)]
    for other in runs[1:]:
        torch.testing.assert_close(other, runs[0], rtol=1e-9, atol=1e-12)


def test_influences_from_factors_equals_influences(digits_mlp):
    model, x, y, x_test, y_test = digits_mlp
    im = DirectInfluence(model, "cross_entropy", 1e-2, second_order_mode="hessian").fit((x, y))
    factors = im.influence_factors(x_test, y_test)
    torch.testing.assert_close(im.influences_from_factors(factors, x, y), im.influences(x_test, y_test, x, y))
    torch.testing.assert_close(im.influences(x_test, y_test), im.influences(x_test, y_test, x, y))


def test_indefinite_hessian_is_a_clear_error(digits_mlp):
    model, x, y, *_ = digits_mlp
    fresh = nn.Sequential(nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 10)).double()  # untrained: saddle region
    with pytest.raises(NumericalError, match="regularization"):
        DirectInfluence(fresh, "cross_entropy", 0.0, second_order_mode="hessian").fit((x, y))
