"""Reference problems shared by tests and benchmarks: linear regression, L2 logistic regression on digits, a
small MLP on digits, each trained to a tight optimum in float64 so influence functions' assumptions hold."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Callable, ParamSpec

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn


@dataclass
class Problem:
    name: str
    model: nn.Module
    loss: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    weight_decay: float

    @property
    def train(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x_train, self.y_train


P = ParamSpec("P")


def fitted_once(make: Callable[P, Problem]) -> Callable[P, Problem]:
    """Fit a problem once per process and arguments: each call gets its own copy, and torch's global generator is
    left as the fit left it, so a test sees exactly what a fresh fit would give it."""

    @functools.cache
    def fitted(*args: P.args, **kwargs: P.kwargs) -> tuple[Problem, torch.Tensor]:
        return make(*args, **kwargs), torch.get_rng_state()

    @functools.wraps(make)
    def fresh(*args: P.args, **kwargs: P.kwargs) -> Problem:
        problem, rng = fitted(*args, **kwargs)
        torch.set_rng_state(rng)
        return copy.deepcopy(problem)

    return fresh


def objective(model: nn.Module, loss: str, x: torch.Tensor, y: torch.Tensor, weight_decay: float) -> torch.Tensor:
    """Mean training loss plus (wd/2)‖θ‖²: its Hessian is H + wd·I, so λ = wd makes influence exact for it."""
    out = model(x)
    data = F.cross_entropy(out, y) if loss == "cross_entropy" else F.mse_loss(out.squeeze(-1), y)
    return data + 0.5 * weight_decay * sum((p * p).sum() for p in model.parameters())


def minimise(model: nn.Module, loss: str, x: torch.Tensor, y: torch.Tensor, weight_decay: float, steps: int = 500) -> float:
    """L-BFGS with strong Wolfe line search to gradient norm ~1e-10 (from the model's current weights)."""
    opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=steps, tolerance_grad=1e-11, tolerance_change=1e-14, history_size=50, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        value = objective(model, loss, x, y, weight_decay)
        value.backward()
        return value

    opt.step(closure)
    return float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm())


def fit_classifier(model: nn.Module, x: torch.Tensor, y: torch.Tensor, weight_decay: float = 1e-2, adam_steps: int = 300) -> nn.Module:
    """Adam from the initialisation into a good basin, then L-BFGS to a tight optimum of the penalised objective."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(adam_steps):
        opt.zero_grad()
        objective(model, "cross_entropy", x, y, weight_decay).backward()
        opt.step()
    minimise(model, "cross_entropy", x, y, weight_decay)
    return model


def digits(n_train: int, n_test: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = torch.tensor(x[order] / 16.0), torch.tensor(y[order])
    return x[:n_train], y[:n_train], x[n_train : n_train + n_test], y[n_train : n_train + n_test]


def linear_regression(n: int = 80, d: int = 6, n_test: int = 10) -> Problem:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n + n_test, d, generator=gen, dtype=torch.float64)
    y = x @ torch.randn(d, generator=gen, dtype=torch.float64) + 0.5 * torch.randn(n + n_test, generator=gen, dtype=torch.float64)
    model = nn.Linear(d, 1).double()
    minimise(model, "mse", x[:n], y[:n], 0.0)
    return Problem("linear regression", model, "mse", x[:n], y[:n], x[n:], y[n:], 0.0)


@fitted_once
def logistic_regression(n_train: int = 300, n_test: int = 20, weight_decay: float = 1e-2) -> Problem:
    x, y, xt, yt = digits(n_train, n_test)
    torch.manual_seed(0)
    model = nn.Linear(64, 10).double()
    minimise(model, "cross_entropy", x, y, weight_decay)
    return Problem("L2 logistic regression (digits)", model, "cross_entropy", x, y, xt, yt, weight_decay)


@fitted_once
def mlp(n_train: int = 300, n_test: int = 20, hidden: int = 8, weight_decay: float = 1e-2) -> Problem:
    x, y, xt, yt = digits(n_train, n_test)
    torch.manual_seed(0)
    model = fit_classifier(nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10)).double(), x, y, weight_decay)
    return Problem("MLP (digits)", model, "cross_entropy", x, y, xt, yt, weight_decay)


def adam_digits(name: str, model: nn.Module, image: bool, steps: int = 500) -> Problem:
    """Issue 12's held-out check: digits 600/40, Adam (lr 1e-2, full batch) without weight decay, float64; not at an
    optimum, as users' models are, so small damping matters."""
    x, y, xt, yt = digits(600, 40)
    if image:
        x, xt = x.reshape(-1, 1, 8, 8), xt.reshape(-1, 1, 8, 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return Problem(name, model, "cross_entropy", x, y, xt, yt, 0.0)


# Initialised in float32, then cast: the same model whatever torch's default dtype (the benchmarks set float64).
@fitted_once
def adam_mlp() -> Problem:
    torch.manual_seed(0)
    f32 = {"dtype": torch.float32}
    return adam_digits("MLP 64-32-10 (tanh, Adam)", nn.Sequential(nn.Linear(64, 32, **f32), nn.Tanh(), nn.Linear(32, 10, **f32)).double(), image=False)


@fitted_once
def adam_cnn() -> Problem:
    torch.manual_seed(0)
    f32 = {"dtype": torch.float32}
    model = nn.Sequential(nn.Conv2d(1, 4, 3, **f32), nn.Tanh(), nn.Conv2d(4, 4, 3, **f32), nn.Tanh(), nn.Flatten(), nn.Linear(64, 10, **f32)).double()
    return adam_digits("CNN 2×conv4 + linear (tanh, Adam)", model, image=True)


def dense_curvature(problem: Problem, mode: str = "gauss_newton") -> torch.Tensor:
    """The training set's curvature matrix C (p × p, dense), from its products with the identity: a construction
    independent of Direct's (a Gram matrix of gradient rows under Gauss-Newton)."""
    from influence_core.batches import TensorBatches
    from influence_core.curvature import CurvatureOperator
    from influence_core.objective import Objective

    objective = Objective(problem.model, problem.loss)
    op = CurvatureOperator(objective, TensorBatches(problem.x_train, problem.y_train, 1024), mode)
    matrix = op.matmat(torch.eye(op.dim, dtype=objective.space.dtype))
    return (matrix + matrix.T) / 2


def mean_curvature(problem: Problem, mode: str = "gauss_newton") -> float:
    """trace(C)/p, to choose λ relative to the curvature's scale."""
    matrix = dense_curvature(problem, mode)
    return float(matrix.trace()) / len(matrix)


@dataclass(frozen=True)
class ExplicitGaussNewton:
    """A problem's dense Gauss-Newton matrix and the per-example gradients of its queries and training rows, built
    once: exact Gauss-Newton influence, block by block or whole, at any λ (a CNN's dense build takes seconds)."""

    matrix: torch.Tensor
    g_test: torch.Tensor
    g_train: torch.Tensor
    blocks: dict[str, slice]

    @classmethod
    def of(cls, problem: Problem, n_queries: int | None = None) -> "ExplicitGaussNewton":
        from influence_core.blocks import layer_blocks
        from influence_core.objective import Objective

        obj = Objective(problem.model, problem.loss)
        queries = slice(0, n_queries)
        g_test = obj.per_sample_grads(problem.x_test[queries], problem.y_test[queries])
        return cls(dense_curvature(problem), g_test, obj.per_sample_grads(*problem.train), layer_blocks(obj.space))

    @property
    def mean_curvature(self) -> float:
        """trace(C)/p, as `mean_curvature(problem)`, from the matrix already built."""
        return float(self.matrix.trace()) / len(self.matrix)

    def influences(self, lams: dict[str, float] | float, layer_wise: bool = True) -> torch.Tensor:
        """Σ_b g_t,bᵀ (C_bb + λ_b I)⁻¹ g_i,b over the layer blocks (λ per block or one), or over one block of all."""
        blocks = self.blocks if layer_wise else {"all": slice(0, len(self.matrix))}
        total = torch.zeros(len(self.g_test), len(self.g_train), dtype=self.matrix.dtype)
        for name, sl in blocks.items():
            lam = lams[name] if isinstance(lams, dict) else lams
            block = self.matrix[sl, sl] + lam * torch.eye(sl.stop - sl.start, dtype=self.matrix.dtype)
            total += self.g_test[:, sl] @ torch.linalg.solve(block, self.g_train[:, sl].T)
        return total
