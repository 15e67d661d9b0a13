"""`Scorer.entries`: the scores of chosen (query, example) entries only, each example captured once and each query
met by its own examples (re-ranking, FastIF's candidates, per-token top-k). In float64 they equal the full score
matrix at those entries for every kind of method (contracted in a basis, formed features, a projection, vmap rest
columns), on both of its paths (a batch's queries scored at once when its entries are dense; one query at a time
when sparse), with repeated entries, and per token they sum to the scores."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from influence_core import ArnoldiInfluence, DirectInfluence, EkfacInfluence, IdentityInfluence, KfacInfluence
from influence_core.methods import scorer
from influence_core.methods.scorer import Scorer
from influence_core.projection import Projection
from influence_core.task import LanguageModelling

METHODS = {
    "ekfac": lambda m: EkfacInfluence(m, "cross_entropy", 1e-2, batch_size=7),
    "kfac": lambda m: KfacInfluence(m, "cross_entropy", 1e-2, batch_size=7),
    "direct": lambda m: DirectInfluence(m, "cross_entropy", 1e-2, batch_size=7),
    "identity": lambda m: IdentityInfluence(m, "cross_entropy", batch_size=7),
    "trak": lambda m: DirectInfluence(m, "cross_entropy", 1e-2, batch_size=7, projection=Projection("gaussian", 16, 0)),
    "arnoldi": lambda m: ArnoldiInfluence(m, "cross_entropy", 1e-2, rank=5, batch_size=7),
}


class Scaled(nn.Module):
    """A parameter outside any Linear (its gradient comes from vmap, the split's rest columns)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def problem() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3), Scaled()).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (30,), generator=g)
    return model, (x[:24], y[:24]), (x[24:], y[24:])


@pytest.mark.parametrize("dense_share", [0, 10**6], ids=["one query at a time", "all queries at once"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_entries_equal_the_full_scores_there(method, dense_share, monkeypatch):
    monkeypatch.setattr(scorer, "DENSE_SHARE", dense_share)
    model, train, test = problem()
    im = METHODS[method](model).fit(train)
    factors = im.influence_factors(*test)
    full = im.influences_from_factors(factors, *train)
    g = torch.Generator().manual_seed(2)
    queries = torch.randint(0, len(test[1]), (40,), generator=g)
    rows = torch.randint(0, len(train[1]), (40,), generator=g)
    queries[-1], rows[-1] = queries[0], rows[0]  # an entry asked twice
    got = Scorer(im, factors, None).entries(*train, queries, rows)
    torch.testing.assert_close(got, full[queries, rows], rtol=1e-10, atol=1e-12)


def test_per_token_entries_sum_to_the_scores():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).double()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(20, 3, 4, generator=g, dtype=torch.float64), torch.randint(0, 5, (20, 3), generator=g)
    im = EkfacInfluence(model, LanguageModelling(), 1e-2, batch_size=6).fit((x[:16], y[:16]))
    factors = im.influence_factors(x[16:], y[16:])
    full = im.influences_from_factors(factors, x[:16], y[:16])
    queries, rows = torch.tensor([0, 0, 3, 1, 2, 3]), torch.tensor([5, 11, 0, 15, 5, 7])
    tokens = Scorer(im, factors, None, per_token=True).entries(x[:16], y[:16], queries, rows)
    assert tokens.shape == (6, 3)
    torch.testing.assert_close(tokens.sum(1), full[queries, rows], rtol=1e-10, atol=1e-12)
