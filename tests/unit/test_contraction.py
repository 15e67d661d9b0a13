"""Scores without per-sample gradients equal scores from explicit per-sample gradients (float64, rtol 1e-10), on an
MLP, a CNN and a token-sequence model (an embedding, Linear layers applied to every token, a pooled head); with
full and rank-r query factors; in parameter space and in the K-FAC eigenbasis."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from influence_core import DirectInfluence, EkfacInfluence, IdentityInfluence
from influence_core.contraction import SMALL_LAYER_BYTES, GradientSplit, LayerRows, contract_layer, factor_rows, low_rank_rows, stream_rows
from influence_core.methods.scorer import Scorer
from influence_core.work import Work

torch.manual_seed(0)


class Tokens(nn.Module):
    """Embedding → per-token Linear/tanh twice → mean over tokens → Linear head: 6 tokens per example."""

    def __init__(self, vocab: int = 20, width: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.mix2 = nn.Linear(width, width, bias=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.embed(tokens)))
        return self.head(torch.tanh(self.mix2(h)).mean(1))


def problems() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    mlp = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    cnn = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 2, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, 3)).double()
    return {
        "mlp": (mlp, torch.randn(40, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (40,), generator=gen)),
        "cnn": (cnn, torch.randn(40, 2, 6, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (40,), generator=gen)),
        "tokens": (Tokens().double(), torch.randint(0, 20, (40, 6), generator=gen), torch.randint(0, 3, (40,), generator=gen)),
    }


def explicit_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-example gradients by vmap over torch.func.grad of each example's own loss, flattened in parameter order:
    the reference, independent of the captures."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([grads[n].reshape(len(x), -1) for n in params], dim=1)


@pytest.mark.parametrize("name", ["mlp", "cnn", "tokens"])
def test_contracted_scores_equal_explicit_gradients(name):
    model, x, y = problems()[name]
    im = DirectInfluence(model, "cross_entropy", 1e-2, second_order_mode="gauss_newton", batch_size=16).fit((x[:30], y[:30]))
    factors = im.influence_factors(x[30:], y[30:])
    work_before = im.work.copy()
    got = im.influences_from_factors(factors, x[:30], y[:30])
    expected = factors @ explicit_gradients(model, x[:30], y[:30]).T
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    counted = im.work - work_before
    assert counted.gradient_rows == 30 and counted.score_flops > 0
    split = im.gradient_split(x, y)
    assert {c.layer.name for c in split.cuts} == {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding))}
    assert split.rest is None  # the embedding is contracted too (tests/unit/test_embedding_contraction.py)


@pytest.mark.parametrize("name", ["mlp", "cnn", "tokens"])
def test_ekfac_scores_in_the_eigenbasis_equal_explicit_rotation(name):
    model, x, y = problems()[name]
    im = EkfacInfluence(model, "cross_entropy", 1e-2, fisher="exact", batch_size=16).fit((x[:30], y[:30]))
    got = im.influences(x[30:], y[30:], x[:30], y[:30])
    grads = explicit_gradients(model, x, y)
    columns, start = {}, 0
    for n, p in model.named_parameters():
        columns[n] = slice(start, start + p.numel())
        start += p.numel()
    expected = torch.zeros(10, 30, dtype=torch.float64)
    for layer in im.layers:  # explicit: rotate formed gradients, divide by Λ + λ, take inner products
        solver = im.solvers[layer.block]
        cols = [columns[p] for p in layer.param_names]
        flat = torch.cat([grads[:, c] for c in cols], dim=1)
        rotated = solver.q_s.T @ layer.to_matrix(flat) @ solver.q_a
        query, train = rotated[30:] / (solver.eigenvalues + solver.lam), rotated[:30]
        expected += query.reshape(10, -1) @ train.reshape(30, -1).T
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["mlp", "cnn", "tokens"])
def test_rank_r_query_factors_contract_like_their_dense_product(name):
    model, x, y = problems()[name]
    im = IdentityInfluence(model, "cross_entropy", batch_size=16, query_rank=2).fit((x[:30], y[:30]))
    compressed = im.influence_factors(x[30:], y[30:])
    full = IdentityInfluence(model, "cross_entropy", batch_size=16).fit((x[:30], y[:30]))
    dense = full.influence_factors(x[30:], y[30:])
    assert compressed.shape[1] < dense.shape[1]
    got = im.influences_from_factors(compressed, x[:30], y[:30])
    # reference: rebuild each layer's rank-2 matrix, put it back in parameter order, multiply explicit gradients
    split = im.gradient_split(x, y)
    rebuilt, col = dense.clone(), 0
    for cut in split.cuts:
        h, w = cut.layer.out_dim, cut.layer.in_dim
        if 2 < min(h, w):
            left = compressed[:, col : col + h * 2].reshape(10, h, 2)
            right = compressed[:, col + h * 2 : col + h * 2 + 2 * w].reshape(10, 2, w)
            rebuilt[:, cut.cols] = cut.layer.to_flat(left @ right)
            col += 2 * (h + w)
        else:
            col += h * w
    expected = rebuilt @ explicit_gradients(model, x[:30], y[:30]).T
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_low_rank_rows_are_near_the_best_rank_r_approximation():
    gen = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(5, 40, 40, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(5, 30, 30, generator=gen, dtype=torch.float64))
    spectrum = 0.7 ** torch.arange(30, dtype=torch.float64)
    dense = u[:, :, :30] * spectrum @ v.transpose(1, 2)
    left, right = low_rank_rows(dense, 4)
    error = torch.linalg.matrix_norm(dense - left @ right)
    best = torch.linalg.matrix_norm(dense - u[:, :, :4] * spectrum[:4] @ v[:, :, :4].transpose(1, 2))
    assert bool((error <= best * (1 + 1e-8)).all())


def test_low_rank_path_is_chosen_when_cheaper_and_agrees():
    """Rank 3 on a 64 × 65 layer with 2 positions: r·T·(out+in) = 774 < out·in = 4160, so the rank-r contraction
    runs, and it equals the dense contraction of the product L R."""
    gen = torch.Generator().manual_seed(4)
    left, right = torch.randn(6, 64, 3, generator=gen, dtype=torch.float64), torch.randn(6, 3, 65, generator=gen, dtype=torch.float64)
    a, g = torch.randn(9, 2, 65, generator=gen, dtype=torch.float64), torch.randn(9, 2, 64, generator=gen, dtype=torch.float64)
    work_low, work_dense = Work(), Work()
    low = contract_layer(LayerRows(left=left, right=right), a, g, work_low)
    dense = contract_layer(LayerRows(dense=left @ right), a, g, work_dense)
    torch.testing.assert_close(low, dense, rtol=1e-10, atol=1e-12)
    assert work_low.score_flops < work_dense.score_flops


@pytest.mark.parametrize("height, width", [(5, 4), (300, 200)], ids=["small layer: formed gradients", "large layer: input first"])
def test_one_position_paths_equal_a_naive_loop(height, width):
    """Both one-position paths, chosen by the batch's gradient size against SMALL_LAYER_BYTES (small: G formed and
    met by one GEMM; large: X = F a reduced with g), equal Σ_{o,i} F[o, i] g[o] a[i] summed example by example."""
    gen = torch.Generator().manual_seed(5)
    n = 40
    rows = torch.randn(3, height, width, generator=gen, dtype=torch.float64)
    a, g = torch.randn(n, 1, width, generator=gen, dtype=torch.float64), torch.randn(n, 1, height, generator=gen, dtype=torch.float64)
    assert (n * height * width * 8 > SMALL_LAYER_BYTES) == (height == 300)  # each case takes the path it is named for
    expected = torch.tensor([[float(torch.outer(g[i, 0], a[i, 0]).mul(rows[j]).sum()) for i in range(n)] for j in range(3)], dtype=torch.float64)
    torch.testing.assert_close(contract_layer(LayerRows(dense=rows), a, g, Work()), expected, rtol=1e-10, atol=1e-12)


def test_shared_layer_keeps_vmap_gradients():
    """A Linear called twice per forward pass cannot be captured once; it stays on the vmap path, still exact."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))

    model = Twice().double()
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(20, 4, generator=gen, dtype=torch.float64), torch.randint(0, 2, (20,), generator=gen)
    im = DirectInfluence(model, "cross_entropy", 1e-2, second_order_mode="gauss_newton").fit((x, y))
    split = GradientSplit(im.objective, (x, y))
    assert [c.layer.name for c in split.cuts] == ["head"] and split.rest is not None
    factors = im.influence_factors(x[:5], y[:5])
    torch.testing.assert_close(im.influences_from_factors(factors, x, y), factors @ explicit_gradients(model, x, y).T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["mlp", "cnn", "tokens"])
@pytest.mark.parametrize("kind", ["identity", "rank2", "ekfac"])
def test_rows_streamed_block_by_block_equal_rows_of_the_whole_matrix(name, kind):
    """Workers fill per-layer rows from stored chunks of query factors; uneven blocks (4, 4, 2 rows) give exactly
    the rows built from the whole flat matrix, dense or rank-r, in parameter or eigenbasis order, with the rest."""
    model, x, y = problems()[name]
    im = (EkfacInfluence(model, "cross_entropy", 1e-2, fisher="exact", batch_size=16) if kind == "ekfac"
          else IdentityInfluence(model, "cross_entropy", batch_size=16, query_rank=2 if kind == "rank2" else None)).fit((x[:30], y[:30]))
    flat = im.influence_factors(x[30:], y[30:])
    split = im.gradient_split(x, y)
    whole = factor_rows(flat, split, im.row_order, im.query_rank)
    streamed = stream_rows(((lo, flat[lo : lo + 4]) for lo in range(0, 10, 4)), 10, split, im.row_order, im.query_rank)
    assert whole.layers.keys() == streamed.layers.keys() and streamed.count == 10
    for layer, rows in whole.layers.items():
        for part in ("dense", "left", "right"):
            expected, got = getattr(rows, part), getattr(streamed.layers[layer], part)
            assert (expected is None and got is None) or (torch.equal(expected, got) and got.is_contiguous())
    assert (whole.rest is None and streamed.rest is None) or torch.equal(whole.rest, streamed.rest)
    assert streamed.rest is None  # every layer is captured: the embedding too (EK-FAC leaves it out instead)
    assert kind != "rank2" or any(rows.rank == 2 for rows in streamed.layers.values())
    torch.testing.assert_close(im.influences_from_factors(flat, x[:30], y[:30]), Scorer(im, streamed, None)(x[:30], y[:30])[0], rtol=0, atol=0)
