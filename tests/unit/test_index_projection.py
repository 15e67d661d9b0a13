"""The compressed training index (LoGra per gradient matrix, influence_core.index_projection) against explicit
per-example gradients: its rows are Φ_out G_i Φ_inᵀ, and with sides that keep every matrix it gives the exact scores."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from influence_core import DirectInfluence, EkfacInfluence, IdentityInfluence, KfacInfluence
from influence_core.contraction import cut_gradients, gradient_batch
from influence_core.index_projection import FIRST_RANK, IndexProjection, break_even_rank, factored_is_cheaper, factored_projection, orthogonal_rows, whitening_factors


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


def _smooth_damped(out: int, inp: int, seed: int) -> torch.Tensor:
    """A positive D (out × in) of rank 3 (not 1) like a damped K-FAC/EK-FAC diagonal: a Kronecker product of decaying
    spectra, plus a second product with random inputs, plus λ."""
    gen = torch.Generator().manual_seed(seed)
    spectrum = lambda n: torch.logspace(0, -5, n, dtype=torch.float64)  # noqa: E731
    second = torch.outer(spectrum(out).flip(0), torch.rand(inp, generator=gen, dtype=torch.float64))
    return torch.outer(spectrum(out), spectrum(inp)) + 0.5 * second + 1e-3


def _explicit(a: torch.Tensor, g: torch.Tensor, w: torch.Tensor, phi_out: torch.Tensor, phi_in: torch.Tensor) -> torch.Tensor:
    """Φ_out (G ∘ W) Φ_inᵀ per example with G = Σ_t g_t a_tᵀ formed, flattened."""
    return (phi_out @ (torch.einsum("bto,bti->boi", g, a) * w) @ phi_in.T).reshape(len(a), -1)


def test_factored_whitening_is_the_explicit_projection():
    """On a damped cut (T = 3 positions, a random positive D, not rank 1): at full rank the factored projection equals
    Φ_out (G ∘ D^(-1/2)) Φ_inᵀ to 1e-10; at the rank `whitening_factors` picks for rtol 1e-3 (fewer), every entry of W
    is within 1e-3, so is every whitened gradient, and the projected rows within ‖Φ_out‖‖Φ_in‖·1e-3·‖G ∘ W‖."""
    gen = torch.Generator().manual_seed(1)
    out, inp, k, positions, n = 30, 20, 5, 3, 7
    a, g = torch.randn(n, positions, inp, generator=gen, dtype=torch.float64), torch.randn(n, positions, out, generator=gen, dtype=torch.float64)
    phi_out, phi_in = orthogonal_rows(k, out, [0, 0, 0]), orthogonal_rows(k, inp, [0, 0, 1])
    for damped in (0.1 + torch.rand(out, inp, generator=gen, dtype=torch.float64), _smooth_damped(out, inp, 2)):
        w = damped.rsqrt()
        expected = _explicit(a, g, w, phi_out, phi_in)
        full = whitening_factors(damped, 0.0)
        assert len(full[0]) == inp
        torch.testing.assert_close(factored_projection(a, g, (phi_out, phi_in), full), expected, rtol=1e-10, atol=1e-10)
    left, right = whitening_factors(damped, 1e-3)
    assert 1 < len(left) < inp
    w_r = left.T @ right
    assert ((w_r - w).abs() <= 1e-3 * w).all()
    whitened = torch.einsum("bto,bti->boi", g, a) * w
    assert ((torch.einsum("bto,bti->boi", g, a) * w_r - whitened).flatten(1).norm(dim=1) <= 1e-3 * whitened.flatten(1).norm(dim=1)).all()
    got = factored_projection(a, g, (phi_out, phi_in), (left, right))
    torch.testing.assert_close(got, _explicit(a, g, w_r, phi_out, phi_in), rtol=1e-10, atol=1e-10)
    bound = torch.linalg.matrix_norm(phi_out, 2) * torch.linalg.matrix_norm(phi_in, 2) * 1e-3 * whitened.flatten(1).norm(dim=1)
    assert ((got - expected).norm(dim=1) <= bound).all()


def test_factored_whitening_only_where_cheaper():
    """The cost rule: W3's 1024 × 1025 layer at side 64 and one position is cheaper factored at rank 39, not at full rank;
    its 1024 × 101 layer factored at full rank (its formed matrices' slower multiply-adds count FORMED_COST times)."""
    assert factored_is_cheaper(39, (1024, 1025), (64, 64), 1)
    assert factored_is_cheaper(101, (1024, 101), (64, 64), 1)
    assert not factored_is_cheaper(1024, (1024, 1025), (64, 64), 1)
    assert not factored_is_cheaper(20, (30, 20), (5, 5), 3)


class Positions(nn.Module):
    """A Linear over T = 3 positions (its captures (n, 3, in)), averaged, then a Linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(40, 50), nn.Linear(50, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)).mean(1))


def test_training_rows_of_a_damped_cut_factored_or_formed():
    """`training` on a damped cut (50 × 41, side 4, T = 3): with a smooth D its rank is small enough to factor, and the
    rows are Φ_out (G ∘ W) Φ_inᵀ within the 1e-3 bound; with a random D (full rank needed, no cheaper) they are the
    formed path's bit for bit; whitening_rtol 0 factors at full rank where that is cheaper, to 1e-10."""
    torch.manual_seed(0)
    model = Positions().double()
    x, y = torch.randn(16, 3, 40, dtype=torch.float64), torch.randint(0, 3, (16,))
    im = DirectInfluence(model, "cross_entropy", regularization=1e-2).fit((x, y))
    split = im.gradient_split(x, y)
    batch = gradient_batch(split, x, y, im.work)
    cut = split.cuts[0]
    grads = cut_gradients(batch, cut)
    phi_out, phi_in = orthogonal_rows(4, 50, [0, 0, 0]), orthogonal_rows(4, 41, [0, 0, 1])
    for damped, factored in ((_smooth_damped(50, 41, 3), True), (0.1 + torch.rand(50, 41, dtype=torch.float64), False)):
        projection = IndexProjection(split, im.row_order, side=4, seed=0, damped={cut.name: damped})
        rows = projection.training(batch)[:, :16]
        rank = len(projection.whitening(cut)[0])
        assert factored_is_cheaper(rank, cut.shape, (4, 4), 3) == factored, rank
        whitened = grads * damped.rsqrt()
        expected = (phi_out @ whitened @ phi_in.T).reshape(len(x), -1)
        if factored:
            bound = 50 / 4 * 1e-3 * whitened.flatten(1).norm(dim=1)  # ‖Φ_out‖₂‖Φ_in‖₂ = √(50/4)·√(41/4) < 50/4
            assert ((rows - expected).norm(dim=1) <= bound).all()
            assert not torch.allclose(rows, expected, rtol=1e-10, atol=0)  # truncated: not the explicit rows exactly
        else:
            assert torch.equal(rows, projection._project(0, cut, grads * damped.rsqrt()))


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_whitened_queries_from_their_captures_equal_the_projected_factors(kind):
    """`queries` on K-FAC/EK-FAC (every cut whitened) projects the queries' measurement captures, G_q D^(-1/2), where
    the solved factors F = G_q D⁻¹ project as F D^(1/2): the same rows (whitening_rtol 0: to 1e-10), on T = 3 positions
    and side 4; a method without whitening (Direct) has its factors solved, then projected."""
    torch.manual_seed(0)
    model = Positions().double()
    x, y = torch.randn(24, 3, 40, dtype=torch.float64), torch.randint(0, 3, (24,))
    make = EkfacInfluence if kind == "ekfac" else KfacInfluence
    im = make(model, "cross_entropy", 1e-2, fisher="exact", batch_size=8).fit((x, y))
    damped = {layer.name: im.solvers[layer.block].damped(torch.float64) for layer in im.layers}
    projection = IndexProjection(im.gradient_split(x, y), im.row_order, side=4, seed=0, damped=damped, whitening_rtol=0.0)
    xq, yq = x[:10] + 0.3, y[:10]
    solved = projection.factors(im.influence_factors(xq, yq))
    rows = projection.queries(im, xq, yq)
    assert rows.shape == (10, projection.dim)
    torch.testing.assert_close(rows, solved, rtol=1e-10, atol=1e-12)
    direct = DirectInfluence(model, "cross_entropy", regularization=1e-2).fit((x, y))
    plain = IndexProjection(direct.gradient_split(x, y), direct.row_order, side=4, seed=0)
    assert torch.equal(plain.queries(direct, xq, yq), plain.factors(direct.influence_factors(xq, yq)))


def test_identity_queries_from_their_captures_equal_the_projected_factors():
    """Gradient dot products (F = G_q): `queries` projects the queries' captures, embedding (token ids), Linear cuts
    and the LayerNorm rest alike, and gives the solved factors projected, to 1e-10 in float64."""
    model, _, split, x, y = _problem()
    im = IdentityInfluence(model, "cross_entropy").fit((x, y))
    projection = IndexProjection(im.gradient_split(x, y), im.row_order, side=4, seed=0)
    assert projection.from_captures(im) and split.rest_columns is not None
    xq, yq = x[:10], (y[:10] + 1) % 3
    torch.testing.assert_close(projection.queries(im, xq, yq), projection.factors(im.influence_factors(xq, yq)), rtol=1e-10, atol=1e-12)


def test_whitening_capped_at_the_break_even_rank():
    """A cap far below W's size takes the randomized top singular triples: on a smooth D (160 × 120) the rank it picks
    keeps every entry of W within 1e-3, as the full SVD's does, and the same call gives the same bits; a random D,
    which needs full rank, gets no factors under the cap (the formed path), nor does a cap of 0."""
    smooth, rough = _smooth_damped(160, 120, 4), 0.1 + torch.rand(160, 120, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    left, right = whitening_factors(smooth, 1e-3, max_rank=15)  # (15 + OVERSAMPLE) * 4 <= 120: randomized
    full_left, _ = whitening_factors(smooth, 1e-3)
    assert 1 < len(left) <= 15 and abs(len(left) - len(full_left)) <= 1
    assert ((left.T @ right - smooth.rsqrt()).abs() <= 1e-3 * smooth.rsqrt()).all()
    again = whitening_factors(smooth, 1e-3, max_rank=15)
    assert torch.equal(again[0], left) and torch.equal(again[1], right)
    for damped, cap in ((rough, 15), (rough, 100), (smooth, 0)):
        left, right = whitening_factors(damped, 1e-3, max_rank=cap)
        assert left.shape == (0, 160) and right.shape == (0, 120), cap


def _exact_smallest_rank(damped: torch.Tensor, rtol: float) -> int:
    """The smallest rank whose truncated full SVD of W = D^(-1/2) keeps every entry within rtol, scanned rank by rank."""
    w = damped.rsqrt()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    return next(r for r in range(1, len(s) + 1) if ((u[:, :r] * s[:r]) @ vh[:r] - w).abs().le(rtol * w).all())


def test_whitening_rank_search_on_randomized_triples_finds_the_full_svds_rank():
    """On D of 400 × 410 the rank search doubles from FIRST_RANK on the randomized top triples (far cheaper than the
    full SVD): on a smooth D at rtol 1e-5 (rank 23: past the first rank, so found after a doubling) it picks the full
    SVD's smallest rank (or one more), every entry within rtol; a random D, which needs full rank, gets full rank from
    the full SVD after the randomized ranks miss."""
    smooth = _smooth_damped(400, 410, 7)
    left, right = whitening_factors(smooth, 1e-5)
    exact = _exact_smallest_rank(smooth, 1e-5)
    assert FIRST_RANK < exact < 2 * FIRST_RANK and exact <= len(left) <= exact + 1
    assert ((left.T @ right - smooth.rsqrt()).abs() <= 1e-5 * smooth.rsqrt()).all()
    rough = 0.1 + torch.rand(400, 410, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    left, right = whitening_factors(rough, 1e-3)
    assert len(left) == _exact_smallest_rank(rough, 1e-3)
    assert ((left.T @ right - rough.rsqrt()).abs() <= 1e-3 * rough.rsqrt()).all()


class Convolution(nn.Module):
    """A Conv2d over 3 × 4 positions (its captures (n, 12, 4·3·3)) and a Linear classifier (one position)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.out = nn.Conv2d(4, 6, 3, padding=1), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.conv(x)).mean((2, 3)))


def test_for_model_records_positions_and_forms_past_the_break_even_rank():
    """`for_model` records each cut's capture positions (12 for the Conv2d, 1 for the Linear) from a probe that does
    not count as work. Under them, a D that needs full rank (6) past the convolution's break-even rank at side 2 (4)
    gets no whitening factors, and its rows are the formed path's bit for bit."""
    torch.manual_seed(0)
    model = Convolution().double()
    x, y = torch.randn(24, 4, 3, 4, dtype=torch.float64), torch.randint(0, 3, (24,))
    im = EkfacInfluence(model, "cross_entropy", regularization=1e-3).fit((x, y))
    rows_before = im.work.gradient_rows
    projection = IndexProjection.for_model(im, x[:8], y[:8], side=2)
    conv, out = projection.split.cuts
    assert projection.positions == {conv.name: 12, out.name: 1} and im.work.gradient_rows == rows_before
    assert break_even_rank(conv.shape, projection.sides(conv), 12) == 4 and conv.shape == (6, 37)
    rough = 0.1 + torch.rand(conv.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    capped = IndexProjection(projection.split, im.row_order, 2, seed=0, damped={conv.name: rough}, positions=projection.positions)
    assert len(capped.whitening(conv)[0]) == 0 and len(whitening_factors(rough, 1e-3)[0]) == 6
    batch = im.gradient_batch(x, y, in_basis=False)
    formed = capped._project(0, conv, cut_gradients(batch, conv) * rough.rsqrt())
    assert torch.equal(capped.training(batch)[:, : formed.shape[1]], formed)
