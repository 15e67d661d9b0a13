"""K-FAC/EK-FAC scores alone rotate the query rows back to the captures' basis once (⟨F, Q_Sᵀ G Q_A⟩ =
⟨Q_S F Q_Aᵀ, G⟩) instead of rotating every training example's positions. Checked in float64 against the scores
of formed per-example features in the eigenbasis (`gradient_features`, the path that rotates), for a Linear layer
over positions, a Conv2d, and rank-r query rows; with more query rows than training positions, rotating the
examples is cheaper and is kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from influence_core import EkfacInfluence, KfacInfluence
from influence_core.methods.scorer import Scorer
from influence_core.task import LanguageModelling


def conv_problem() -> tuple[nn.Module, str, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 5 * 5, 4)).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 1, 5, 5, generator=g, dtype=torch.float64), torch.randint(0, 4, (30,), generator=g)
    return model, "cross_entropy", (x[:24], y[:24]), (x[24:], y[24:])


def sequence_problem() -> tuple[nn.Module, LanguageModelling, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5)).double()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(26, 4, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (26, 4), generator=g)
    return model, LanguageModelling(), (x[:20], y[:20]), (x[20:], y[20:])


@pytest.mark.parametrize("method", [KfacInfluence, EkfacInfluence])
@pytest.mark.parametrize("problem", [conv_problem, sequence_problem])
@pytest.mark.parametrize("query_rank", [None, 2])
def test_scores_from_rows_rotated_back_equal_the_eigenbasis_features(method, problem, query_rank):
    model, loss, train, test = problem()
    im = method(model, loss, 1e-2, query_rank=query_rank).fit(train)
    factors = im.influence_factors(*test)
    scorer = Scorer(im, factors, None)
    scores, _ = scorer(*train)
    assert scorer.as_captured
    assert scores is not None
    dense = im.precondition(im.gradient_features(*test, measure=True))
    if query_rank is None:
        reference = dense @ im.gradient_features(*train).T
    else:  # rank-r rows score as the rank-r rows of the rotating path
        rotating = Scorer(im, factors, None)
        rotating.as_captured = False
        reference = rotating(*train)[0]
        assert reference is not None
        assert not torch.allclose(reference, dense @ im.gradient_features(*train).T)  # the rank is a real cut
    torch.testing.assert_close(scores, reference, rtol=1e-10, atol=1e-12)


def test_few_training_examples_keep_the_eigenbasis():
    """Two training examples against six dense query rows: rotating the examples costs less, so the scorer keeps
    the eigenbasis, with the same scores."""
    model, loss, train, test = conv_problem()
    im = EkfacInfluence(model, loss, 1e-2).fit(train)
    factors = im.influence_factors(*test)
    scorer = Scorer(im, factors, None)
    scores, _ = scorer(train[0][:2], train[1][:2])
    assert scorer.as_captured is False
    reference = im.precondition(im.gradient_features(*test, measure=True)) @ im.gradient_features(train[0][:2], train[1][:2]).T
    torch.testing.assert_close(scores, reference, rtol=1e-10, atol=1e-12)
