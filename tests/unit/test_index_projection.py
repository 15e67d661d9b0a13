"""The compressed training index (LoGra per gradient matrix, influence_core.index_projection) against explicit
per-example gradients: its rows are Φ_out G_i Φ_inᵀ, and with sides that keep every matrix it gives the exact scores."""

from __future__ import annotations

import torch
from torch import nn

from influence_core import DirectInfluence
from influence_core.contraction import gradient_batch
from influence_core.index_projection import IndexProjection, orthogonal_rows


class TokensThenMlp(nn.Module):
    """An embedding (a cut whose captures are token ids), a LayerNorm (vmapped: the rest) and two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm = nn.Embedding(11, 6), nn.LayerNorm(6)
        self.hidden, self.out = nn.Linear(6, 9), nn.Linear(9, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.norm(self.emb(ids)).mean(1))))


def _problem():
    torch.manual_seed(0)
    model = TokensThenMlp().double()
    x, y = torch.randint(0, 11, (40, 5)), torch.randint(0, 3, (40,))
    im = DirectInfluence(model, "cross_entropy", regularization=1e-2).fit((x, y))
    split = im.gradient_split(x, y)
    return model, im, split, x, y


def per_example_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """∇ℓ(z_i) by a backward pass per example, by parameter name."""
    rows = []
    for i in range(len(y)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        rows.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
    return rows


def test_rows_are_the_projected_per_example_gradient_matrices():
    """Each Linear's k×k block is Φ_out [W-grad | b-grad] Φ_inᵀ with Φ the documented seeded orthonormal rows (side 4
    < the matrices' sizes where they exceed it, identity where not); the rest (LayerNorm) columns are its gradient as is."""
    model, im, split, x, y = _problem()
    projection = IndexProjection(split, im.row_order, side=4, seed=0)
    rows = projection.training(gradient_batch(split, x, y, im.work))
    grads = per_example_gradients(model, x, y)
    names = [cut.name for cut in split.cuts]
    assert names == ["emb", "hidden", "out"] and split.rest_columns is not None and len(split.rest_columns) == 12
    offset = 0
    for index, cut in enumerate(split.cuts):
        k_out, k_in = projection.sides(cut)
        out, inp = cut.shape
        phi_out = torch.eye(out, dtype=torch.float64) if k_out == out else orthogonal_rows(k_out, out, [0, index, 0])
        phi_in = torch.eye(inp, dtype=torch.float64) if k_in == inp else orthogonal_rows(k_in, inp, [0, index, 1])
        if k_in < inp:  # the documented Φ: orthonormal rows scaled by √(n/k)
            torch.testing.assert_close(phi_in @ phi_in.T, torch.eye(k_in, dtype=torch.float64) * inp / k_in)
        for i, g in enumerate(grads):
            matrix = g[f"{cut.name}.weight"] if cut.name == "emb" else torch.cat([g[f"{cut.name}.weight"], g[f"{cut.name}.bias"][:, None]], 1)
            expected = (phi_out @ matrix @ phi_in.T).ravel()
            torch.testing.assert_close(rows[i, offset : offset + k_out * k_in], expected, rtol=1e-10, atol=1e-12)
        offset += k_out * k_in
    for i, g in enumerate(grads):
        torch.testing.assert_close(rows[i, offset:], torch.cat([g["norm.weight"], g["norm.bias"]]), rtol=1e-10, atol=1e-12)
    assert rows.shape[1] == projection.dim == offset + 12


def test_sides_that_keep_every_matrix_give_the_exact_scores():
    """Φ = I when the side is at least every matrix's size: factors(F) · training(G) is the exact score F·G."""
    model, im, split, x, y = _problem()
    projection = IndexProjection(split, im.row_order, side=64, seed=0)
    factors = im.influence_factors(x[:7], y[:7])
    got = projection.factors(factors) @ projection.training(gradient_batch(split, x, y, im.work)).T
    torch.testing.assert_close(got, im.influences_from_factors(factors, x, y), rtol=1e-10, atol=1e-12)


def test_projected_scores_are_unbiased_over_seeds():
    """E over seeds of the projected score is the exact score: the squared error of the mean of 200 seeds (side 3) is
    under 1/20 of one seed's (1/200 expected of an unbiased estimator, measured 1/77; a bias would not shrink with
    more seeds)."""
    model, im, split, x, y = _problem()
    factors = im.influence_factors(x[:5], y[:5])
    exact = im.influences_from_factors(factors, x, y)
    batch = gradient_batch(split, x, y, im.work)
    draws = torch.stack([(p := IndexProjection(split, im.row_order, side=3, seed=s)).factors(factors) @ p.training(batch).T for s in range(200)])
    one = ((draws - exact) ** 2).sum(dim=(1, 2)).mean()
    mean = ((draws.mean(0) - exact) ** 2).sum()
    assert mean < one / 20, (float(mean), float(one))
    assert one > 1e-2 * (exact**2).sum()  # the projection does compress: one seed is not exact
