"""Direct's explicit curvature blocks (`CurvatureOperator.dense_blocks`) against independent references: Jᵀ ∇²ℓ J
from torch.func.jacrev and each example's output Hessian from torch.func.hessian (Gauss-Newton), torch.func.hessian
of the mean loss (Hessian); the Gram route's work and progress lines; Direct's scores on a CNN with layer blocks."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.func import hessian, jacrev, vmap

from influence_core import DirectInfluence, solvers
from influence_core.batches import TensorBatches
from influence_core.blocks import layer_blocks, make_blocks
from influence_core.curvature import CurvatureOperator
from influence_core.objective import Objective

N = 23


def mlp(outputs: int) -> nn.Module:
    """12-24-outputs: 562 parameters with 10 outputs, so the whole block spans three Gram panels of 256 rows."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, outputs)).double()


def cnn(outputs: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, outputs)
    ).double()


def case(name: str) -> tuple[Objective, torch.Tensor, torch.Tensor]:
    """`architecture-loss`: an MLP or a CNN with Conv2d layers, under cross-entropy (integer labels) or MSE."""
    architecture, loss = name.split("-")
    gen = torch.Generator().manual_seed(1)
    outputs = 10 if architecture == "mlp" else 3
    x = torch.randn(N, 12, generator=gen, dtype=torch.float64) if architecture == "mlp" else torch.randn(N, 1, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, outputs, (N,), generator=gen) if loss == "cross_entropy" else torch.randn(N, outputs, generator=gen, dtype=torch.float64)
    return Objective((mlp if architecture == "mlp" else cnn)(outputs), loss), x, y


def reference(objective: Objective, x: torch.Tensor, y: torch.Tensor, mode: str) -> torch.Tensor:
    """The mean loss's Hessian by torch.func.hessian, or (1/n) Σ J_iᵀ ∇²ℓ_i J_i from jacrev and per-example hessians."""
    space = objective.space
    if mode == "hessian":
        return hessian(lambda flat: objective.batch_loss(space.unflatten(flat), x, y))(space.flatten(objective.params))
    jac = space.flatten(jacrev(lambda p: objective.outputs(p, x))(objective.params), batch_dims=2)  # (n, outputs, p)
    out = objective.outputs(objective.params, x).detach()
    out_hessian = vmap(hessian(lambda o, t: objective.task.loss(o[None], t[None])[0]))(out, y)  # (n, outputs, outputs)
    return torch.einsum("ncp,ncd,ndq->pq", jac, out_hessian, jac) / len(x)


CASES = ["mlp-cross_entropy", "mlp-mse", "cnn-cross_entropy", "cnn-mse"]


@pytest.mark.parametrize("mode", ["gauss_newton", "hessian"])
@pytest.mark.parametrize("name", CASES)
def test_dense_blocks_equal_the_reference(name, mode):
    """Every block, whole or one per layer, at float64 round-off, in one batch and in unequal batches (5, 5, 5, 5,
    3); Gauss-Newton by the Gram route (gradient rows, no curvature products), the Hessian by products with the
    identity."""
    objective, x, y = case(name)
    expected = reference(objective, x, y, mode)
    outputs = objective.outputs(objective.params, x[:1]).shape[-1]
    for structure, batch_size in (("full", N), ("full", 5), ("layer_wise", N), ("layer_wise", 5)):
        blocks = list(make_blocks(objective.space, structure).values())
        before = objective.work.copy()
        matrices = CurvatureOperator(objective, TensorBatches(x, y, batch_size), mode).dense_blocks(blocks)
        done = objective.work - before
        for block, got in zip(blocks, matrices):
            assert got.dtype == torch.float64
            torch.testing.assert_close(got, expected[block, block], rtol=1e-10, atol=1e-13)
        if mode == "gauss_newton":
            assert (done.gradient_rows, done.product_rows) == (N * outputs, 0) and done.curvature_flops > 0
        else:
            assert (done.product_rows, done.curvature_flops) == (objective.space.dim * N, 0)


def test_gram_flops_count_the_panels_on_and_above_the_diagonal():
    """p = 562 in panels of 256 rows: 256·562 + 256·306 + 50·50 entries, each a dot product of N·10 rows."""
    objective, x, y = case("mlp-cross_entropy")
    CurvatureOperator(objective, TensorBatches(x, y, 7), "gauss_newton").dense_blocks([slice(0, objective.space.dim)])
    assert objective.work.curvature_flops == 2.0 * N * 10 * (256 * 562 + 256 * 306 + 50 * 50)


class Checked(nn.Module):
    """A Linear behind a check of the batch's values, as Hugging Face's SDPA attention checks its mask: per-example
    vmap refuses the branch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(x).all()):
            raise ValueError("inputs must be finite")
        return self.linear(torch.tanh(x))


def test_gauss_newton_of_a_model_vmap_cannot_trace_comes_from_products():
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(N, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (N,), generator=gen)
    objective = Objective(Checked(), "cross_entropy")
    (got,) = CurvatureOperator(objective, TensorBatches(x, y, 5), "gauss_newton").dense_blocks([slice(0, objective.space.dim)])
    torch.testing.assert_close(got, reference(objective, x, y, "gauss_newton"), rtol=1e-10, atol=1e-13)
    assert objective.work.gradient_rows == 0 and objective.work.product_rows == objective.space.dim * N


def test_gauss_newton_with_more_outputs_than_exact_fisher_columns_comes_from_products():
    """65 regression outputs: 65 Fisher columns per example exceed EXACT_FISHER_MAX_PASSES (64)."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, 3, generator=gen, dtype=torch.float64), torch.randn(N, 65, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    objective = Objective(nn.Linear(3, 65).double(), "mse")
    (got,) = CurvatureOperator(objective, TensorBatches(x, y, 5), "gauss_newton").dense_blocks([slice(0, objective.space.dim)])
    torch.testing.assert_close(got, reference(objective, x, y, "gauss_newton"), rtol=1e-10, atol=1e-13)
    assert objective.work.gradient_rows == 0 and objective.work.product_rows == objective.space.dim * N


@pytest.mark.parametrize("mode", ["gauss_newton", "hessian"])
def test_forming_the_matrix_logs_its_progress(mode, monkeypatch, caplog):
    """With the cadence at 0 s, a line after every batch (and, for products, every call within one): the rows done of
    23, rising to all of them."""
    monkeypatch.setattr(solvers, "PROGRESS_SECONDS", 0.0)
    caplog.set_level(logging.INFO, logger="influence_core")
    objective, x, y = case("mlp-cross_entropy")
    CurvatureOperator(objective, TensorBatches(x, y, 5), mode).dense_blocks(list(layer_blocks(objective.space).values()))
    lines = [r.getMessage() for r in caplog.records if "matrix of 562 parameters (2 block(s))" in r.getMessage()]
    done = [float(line.split(": ")[1].split(" of ")[0]) for line in lines]
    assert len(lines) >= 5 and done == sorted(done) and done[-1] == N
    assert all(f" of {N} training rows" in line and " so far, about " in line for line in lines)


def test_direct_scores_on_a_cnn_with_layer_blocks_equal_the_explicit_solve():
    """DirectInfluence (Gram route, one pass for the three blocks) against Σ_b g_t,bᵀ (C_bb + λI)⁻¹ g_i,b with C
    from jacrev."""
    objective, x, y = case("cnn-cross_entropy")
    lam = 1e-3
    got = DirectInfluence(objective.model, "cross_entropy", lam, block_structure="layer_wise", batch_size=7).fit((x, y)).influences(x[:5], y[:5], x, y)
    matrix, grads = reference(objective, x, y, "gauss_newton"), objective.per_sample_grads(x, y)
    expected = torch.zeros(5, N, dtype=torch.float64)
    for block in layer_blocks(objective.space).values():
        damped = matrix[block, block] + lam * torch.eye(block.stop - block.start, dtype=torch.float64)
        expected += grads[:5, block] @ torch.linalg.solve(damped, grads[:, block].T)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
