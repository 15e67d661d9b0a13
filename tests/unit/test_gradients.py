"""Per-sample gradients and curvature products against independent references: a backward loop, torch.func.hessian, an explicit Jacobian."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import hessian, jacrev

from influence_core import Objective
from influence_core.batches import TensorBatches
from influence_core.curvature import PRODUCT_ACTIVATION_BYTES, CurvatureOperator

torch.manual_seed(0)


def dense(objective: Objective, x: torch.Tensor, y: torch.Tensor, batch_size: int, mode: str, budget: int) -> torch.Tensor:
    """The operator's products with the identity (the curvature-vector products under test), symmetrised."""
    operator = CurvatureOperator(objective, TensorBatches(x, y, batch_size), mode, activation_budget=budget)
    matrix = operator.matmat(torch.eye(operator.dim, dtype=objective.space.dtype))
    return (matrix + matrix.T) / 2


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).double()


@pytest.mark.parametrize("make, shape", [(mlp, (5,)), (small_cnn, (1, 6, 6))])
def test_per_sample_gradients_match_backward_loop(make, shape):
    model = make()
    x, y = torch.randn(9, *shape, dtype=torch.float64), torch.randint(0, 3, (9,))
    grads = Objective(model, "cross_entropy").per_sample_grads(x, y)
    for i in range(len(x)):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(grads[i], expected, rtol=1e-12, atol=1e-12)


# One vector per product call, a few, and all of them in one call.
BUDGETS = [1, 3 * 1000, PRODUCT_ACTIVATION_BYTES]


def test_activation_bytes_counts_every_leaf_output():
    objective = Objective(mlp(), "cross_entropy")
    assert objective.activation_bytes(torch.randn(4, 5, dtype=torch.float64)) == (7 + 7 + 3) * 8  # Linear, Tanh, Linear
    operator = CurvatureOperator(objective, None, activation_budget=3 * 17 * 8 * 4)
    assert operator.vectors_per_call(torch.randn(4, 5)) == 3


@pytest.mark.parametrize("budget", BUDGETS)
def test_hessian_operator_matches_torch_func_hessian_with_unequal_batches(budget):
    model = mlp()
    x, y = torch.randn(23, 5, dtype=torch.float64), torch.randint(0, 3, (23,))
    objective = Objective(model, "cross_entropy")
    flat = objective.space.flatten(objective.params)
    expected = hessian(lambda p: objective.batch_loss(objective.space.unflatten(p), x, y))(flat)
    for batch_size in (23, 5, 1):  # one batch, unequal batches (5,5,5,5,3), single examples
        torch.testing.assert_close(dense(objective, x, y, batch_size, "hessian", budget), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("budget", BUDGETS)
def test_gauss_newton_operator_matches_explicit_jacobian(budget):
    model = mlp()
    x, y = torch.randn(17, 5, dtype=torch.float64), torch.randint(0, 3, (17,))
    objective = Objective(model, "cross_entropy")
    jac = objective.space.flatten(jacrev(lambda p: objective.outputs(p, x))(objective.params), batch_dims=2)  # (n, C, p)
    probs = torch.softmax(model(x), dim=-1).detach()
    out_hessian = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
    expected = torch.einsum("ncp,ncd,ndq->pq", jac, out_hessian, jac) / len(x)
    for batch_size in (17, 4):
        torch.testing.assert_close(dense(objective, x, y, batch_size, "gauss_newton", budget), expected, rtol=1e-10, atol=1e-12)


class AttentionClassifier(nn.Module):
    """Token embeddings, one `F.scaled_dot_product_attention` (the fused kernel on CPU in float32), a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.qkv, self.head = nn.Embedding(11, 8), nn.Linear(8, 24), nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.embed(ids)).unsqueeze(1).chunk(3, dim=-1)
        return self.head(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1).mean(1))


def test_gauss_newton_operator_runs_fused_attention_and_matches_explicit_jacobian():
    """The fused attention kernels have no forward-mode derivative (GPT-2 and BERT in transformers call them): the
    Gauss-Newton product still works, and equals Jᵀ ∇²ℓ J from reverse-mode Jacobians."""
    model = AttentionClassifier()
    x, y = torch.randint(0, 11, (9, 5)), torch.randint(0, 3, (9,))
    objective = Objective(model, "cross_entropy")
    jac = objective.space.flatten(jacrev(lambda p: objective.outputs(p, x))(objective.params), batch_dims=2)
    probs = torch.softmax(model(x), dim=-1).detach()
    out_hessian = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
    expected = torch.einsum("ncp,ncd,ndq->pq", jac, out_hessian, jac) / len(x)
    torch.testing.assert_close(dense(objective, x, y, 9, "gauss_newton", PRODUCT_ACTIVATION_BYTES), expected, rtol=1e-4, atol=1e-6)
