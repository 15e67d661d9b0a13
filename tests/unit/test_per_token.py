"""Per-token scores (n_test, n_train, T): each training position's share of a score, the contraction before its sum
over positions. In float64, on a position-wise language model (token t's next-token loss depends on position t
alone), they equal explicit per-token gradients ∂ℓ_{i,t}/∂θ (one autograd call per token) against the query
factors, for every method that contracts or materialises gradients (CG and LiSSA contract their factors as Direct
does), each through its own path (embedding, tied
weight, rank-r rows, a basis's rows, K-FAC's rotation); padded positions (attention_mask 0, labels ignored) score
exactly 0. On a causal transformer (attention mixes positions) they still sum to the sequence scores."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from influence_core import ArnoldiInfluence, DataInfInfluence, DirectInfluence, EkfacInfluence, IdentityInfluence, KfacInfluence, NystroemSketchInfluence
from influence_core.errors import ConfigError
from influence_core.pipeline.model.transformer import TokenTransformer
from influence_core.projection import Projection
from influence_core.task import LanguageModelling
from influence_core.task.builtin import IGNORE_INDEX

VOCAB, WIDTH, POSITIONS, PAD = 11, 6, 7, 0


class TokenMLP(nn.Module):
    """Embedding → Linear → tanh → Linear head at every position, no mixing across positions; the head's weight
    optionally tied to the embedding (GPT-2's lm_head.weight is wte.weight). Takes Hugging Face style fields."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        if tied:
            self.head.weight = self.tokens.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.tokens(input_ids))))


def tokens(n: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """n right-padded sequences (every third one padded on its last 3 positions, its labels there ignored)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, POSITIONS), generator=gen)
    mask = torch.ones_like(ids)
    mask[::3, -3:] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, IGNORE_INDEX)


def token_gradients(model: nn.Module, x: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """∂ℓ_{i,t}/∂θ (n, T, p) by one autograd call per token, ℓ_{i,t} the loss of position t's prediction of token
    t+1 (0 where that label is ignored, and at the last position), flattened in `named_parameters` order."""
    params = [p for _, p in model.named_parameters()]
    out = torch.zeros(len(y), POSITIONS, sum(p.numel() for p in params), dtype=torch.float64)
    for i in range(len(y)):
        logits = model(x["input_ids"][i : i + 1])[0]
        for t in range(POSITIONS - 1):
            if y[i, t + 1] != IGNORE_INDEX:
                loss = nn.functional.cross_entropy(logits[t], y[i, t + 1])
                out[i, t] = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])
    return out


def setup(tied: bool) -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = TokenMLP(tied).double()
    return model, *tokens(9, 1), *tokens(2, 2)


def test_direct_per_token_scores_equal_explicit_token_gradients():
    """Direct's factors are in parameter order: per-token scores are factors @ ∂ℓ_{i,t}/∂θ; padding is exactly 0."""
    model, x, y, xq, yq = setup(tied=True)
    im = DirectInfluence(model, LanguageModelling(), regularization=1e-2, batch_size=4).fit((x, y))
    factors = im.influence_factors(xq, yq)
    per_token = im.influences_from_factors(factors, x, y, per_token=True)
    expected = torch.einsum("qp,ntp->qnt", factors, token_gradients(model, x, y))
    torch.testing.assert_close(per_token, expected, rtol=1e-10, atol=1e-12)
    assert (per_token[:, x["attention_mask"] == 0] == 0).all()
    torch.testing.assert_close(per_token.sum(-1), im.influences(xq, yq, x, y), rtol=1e-6, atol=0)


def only_token(y: torch.Tensor, t: int) -> torch.Tensor:
    """Labels that score position t's prediction alone (the label of token t+1)."""
    kept = torch.full_like(y, IGNORE_INDEX)
    kept[:, t + 1] = y[:, t + 1]
    return kept


DAMPED = {"regularization": 1e-2}
METHODS = {
    "direct_rank1": (DirectInfluence, {**DAMPED, "query_rank": 1}),
    "kfac": (KfacInfluence, {**DAMPED, "fisher": "exact"}),
    "ekfac": (EkfacInfluence, {**DAMPED, "fisher": "exact"}),
    "arnoldi": (ArnoldiInfluence, {**DAMPED, "rank": 12}),
    "nystroem": (NystroemSketchInfluence, {**DAMPED, "rank": 12}),
    "datainf": (DataInfInfluence, DAMPED),
    "identity": (IdentityInfluence, {}),
    "direct_gaussian": (DirectInfluence, {**DAMPED, "projection": Projection(kind="gaussian", dim=6, block_mb=1e-4)}),  # several column blocks
    "ekfac_logra": (EkfacInfluence, {**DAMPED, "fisher": "exact", "projection": Projection(kind="logra", dim=4)}),
}


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_method_splits_its_scores_by_token(name, tied):
    """Token t's score equals the sequence score of the same example with only token t's loss kept (on this
    position-wise model its gradient is ∂ℓ_{i,t}/∂θ), computed on the sequence path; padding scores exactly 0 and
    the tokens sum to the sequence scores (rtol 1e-6)."""
    model, x, y, xq, yq = setup(tied)
    method, options = METHODS[name]
    im = method(model, LanguageModelling(), batch_size=4, **options).fit((x, y))
    factors = im.influence_factors(xq, yq)
    per_token = im.influences_from_factors(factors, x, y, per_token=True)
    expected = torch.stack([im.influences_from_factors(factors, x, only_token(y, t)) for t in range(POSITIONS - 1)], dim=-1)
    torch.testing.assert_close(per_token[..., :-1], expected, rtol=1e-8, atol=1e-10)
    assert (per_token[..., -1] == 0).all() and (per_token[:, x["attention_mask"] == 0] == 0).all()
    torch.testing.assert_close(per_token.sum(-1), im.influences_from_factors(factors, x, y), rtol=1e-6, atol=0)


def test_a_causal_transformer_sums_its_tokens_to_the_sequence_score():
    """Attention mixes positions, so a token's share is the gradient through position t (not ∂ℓ_{i,t}/∂θ); the
    shares still sum to the score, padding after the last scored token is exactly 0 (causal: nothing reads it)."""
    torch.manual_seed(0)
    model = TokenTransformer(VOCAB, POSITIONS, 8, 2, 1, VOCAB, causal=True).double()
    x, y = tokens(9, 1)
    xq, yq = tokens(2, 2)
    ids, queries = x["input_ids"], xq["input_ids"]
    im = EkfacInfluence(model, LanguageModelling(), regularization=1e-2, batch_size=4).fit((ids, y))
    per_token = im.influences(queries, yq, ids, y, per_token=True)
    torch.testing.assert_close(per_token.sum(-1), im.influences(queries, yq, ids, y), rtol=1e-6, atol=0)
    assert (per_token[:, x["attention_mask"] == 0] == 0).all()


def test_vmapped_parameters_are_refused():
    """A position embedding (vmap per-sample gradients) has no per-position split: a one-line error naming the fix."""
    torch.manual_seed(0)
    model = TokenTransformer(VOCAB, POSITIONS, 8, 2, 1, VOCAB, causal=True).double()
    x, y = tokens(6, 1)
    direct = DirectInfluence(model, LanguageModelling(), regularization=1e-2).fit((x["input_ids"], y))
    with pytest.raises(ConfigError, match=r"^per_token: parameters positions.weight.*Fix: attribute only"):
        direct.influences(x["input_ids"][:2], y[:2], x["input_ids"], y, per_token=True)
