"""FastIF's candidate prefilter in the library: features of the right module, true nearest neighbours, valid and
distinct candidates from every index kind, their scores equal to the full scores, and bad settings refused early."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch import nn

from flows.parameters import RunParameters
from influence_core import ConfigError, DirectInfluence
from influence_core.pipeline.score.knn_prefilter import build_index, candidate_influences, knn_candidates, module_features, nearest
from influence_core.pipeline.score.candidate_scoring import check_knn_k
from influence_core.pipeline.specs import CandidatesSpec


@pytest.fixture(scope="module")
def problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).double()
    x, xt = torch.randn(300, 6, dtype=torch.float64), torch.randn(9, 6, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (300,)), xt, torch.randint(0, 3, (9,))


def test_default_features_are_the_penultimate_activations(problem):
    model, x, *_ = problem
    with torch.no_grad():
        hidden = torch.tanh(model[0](x)).float().numpy()
        first = model[0](x).float().numpy()
    np.testing.assert_allclose(module_features(model, x, batch_size=64), hidden, rtol=1e-6)
    np.testing.assert_allclose(module_features(model, x, "0"), first, rtol=1e-6)


def test_flat_index_finds_the_true_nearest_neighbours(problem):
    model, x, _, xt, _ = problem
    train, test = module_features(model, x), module_features(model, xt)
    distances = ((test[:, None, :].astype(np.float64) - train[None, :, :]) ** 2).sum(-1)
    found = knn_candidates(model, x, xt, 15)
    expected = np.sort(distances, axis=1)[:, :15]
    np.testing.assert_allclose(np.take_along_axis(distances, found, 1), expected, rtol=1e-4)  # ties may swap indices, never distances


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
@pytest.mark.parametrize("k", [1, 40, 300])
def test_candidates_are_valid_distinct_and_scored_like_the_full_scores(problem, kind, k):
    model, x, y, xt, yt = problem
    im = DirectInfluence(model, "cross_entropy", 1e-2, second_order_mode="gauss_newton").fit((x, y))
    indices, scores = candidate_influences(im, xt, yt, x, y, k, index=kind)
    assert indices.shape == scores.shape == (len(xt), k) and indices.dtype == np.int64
    assert ((indices >= 0) & (indices < len(x))).all()
    assert all(len(set(row)) == k for row in indices.tolist())
    full = im.influences(xt, yt, x, y)
    torch.testing.assert_close(scores, torch.gather(full, 1, torch.from_numpy(indices)), rtol=1e-10, atol=1e-12)
    if k == len(x):  # every example is a candidate: the full top-5 exactly
        helpful = np.take_along_axis(indices, np.argsort(-scores.numpy(), axis=1)[:, :5], 1)
        np.testing.assert_array_equal(helpful, torch.topk(full, 5, dim=1).indices.numpy())


def test_approximate_index_returning_too_few_falls_back_to_exact():
    """An IVF search probing one list of 5 points cannot return 20; the exact fallback gives the 20 nearest."""
    rng = np.random.default_rng(0)
    features = np.concatenate([rng.normal(0, 1, (400, 4)), rng.normal(50, 0.01, (5, 4))]).astype(np.float32)
    index = build_index(features, "ivf")
    query = np.full((1, 4), 50.0, np.float32)
    _, probed = index.search(query, 20)
    assert (probed < 0).sum() > 0  # the approximate search alone comes back short
    found = nearest(index, query, 20, nprobe=1)
    expected = np.argsort(((features - query) ** 2).sum(1), kind="stable")[:20]
    assert set(found[0].tolist()) == set(expected.tolist())


@pytest.mark.parametrize(
    ("config", "field", "words"),
    [
        ({"candidates": {"knn_k": 0}}, "candidates.knn_k", "1 or more"),
        ({"candidates": {"knn_k": 10, "module": "9"}}, "candidates.module", "'1'"),
        ({"candidates": {"knn_k": 3}, "aggregate": {"top_k": 5}}, "candidates.knn_k", "at least 5"),
        ({"candidates": {"knn_k": 10, "index": "lsh"}}, "candidates.index", "flat"),
        ({"candidates": {"knn_k": 10}, "aggregate": {"self_influence": "exact"}}, "aggregate.self_influence", "auto or off"),
    ],
)
def test_bad_candidate_settings_name_the_field_and_the_fix(config, field, words):
    with pytest.raises(ValidationError) as info:
        RunParameters.model_validate(config)
    message = str(info.value)
    assert field in message and words in message


def test_knn_k_above_the_training_set_is_refused():
    check_knn_k(CandidatesSpec(knn_k=100), 100)
    check_knn_k(CandidatesSpec(), 5)
    with pytest.raises(ConfigError, match=r"candidates.knn_k: knn_k=101 exceeds the 100 training examples.*Fix: set candidates.knn_k to at most 100"):
        check_knn_k(CandidatesSpec(knn_k=101), 100)
