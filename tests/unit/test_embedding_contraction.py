"""An `nn.Embedding` is contracted from its captured ids and output gradients, without per-example gradients: scores,
query factors, squared norms (self-influence, sketches) and the work counted equal an independent reference, each
example's gradient by its own `torch.autograd.grad` call in float64 (rtol 1e-10). Cases: tokens repeated within an
example, a `padding_idx`, an embedding followed by a Linear, a language model with a position embedding (which stays
on vmap: arange(T) has no batch dimension), and tied input/output embeddings, contracted as the sum of the
embedding's and the output Linear's shares: on that language model, and on a causal one without position embedding
(V 17, d 8, a padding id with its labels ignored), with and without an output bias."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from influence_core import CgInfluence, DirectInfluence, IdentityInfluence
from influence_core.blocks import layer_blocks
from influence_core.contraction import GradientSplit, LayerRows, contract_layer, dense_rows, factor_rows, gradient_batch, materialise
from influence_core.objective import Objective
from influence_core.task import LanguageModelling, resolve_task
from influence_core.task.builtin import IGNORE_INDEX
from influence_core.work import Work

VOCAB, WIDTH, POSITIONS, PAD = 7, 5, 9, 0  # 9 positions over 7 ids: every example repeats a token


class EmbedLinear(nn.Module):
    """Embedding (with a padding id) → tanh → per-token Linear → mean over tokens → class logits."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH, padding_idx=PAD)
        self.mix = nn.Linear(WIDTH, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mix(torch.tanh(self.tokens(ids))).mean(1)


class TinyLM(nn.Module):
    """Token embedding + position embedding → tanh → Linear head over the vocabulary, optionally tied (GPT-2's
    lm_head.weight is wte.weight)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(POSITIONS, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        if tied:
            self.head.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))))


TIED_VOCAB, TIED_WIDTH = 17, 8


class TiedCausalLM(nn.Module):
    """Token embedding (with a padding id) → a residual Linear over each prefix's mean (causal) → output Linear whose
    weight is the embedding's, with or without a bias of its own; with the bias, the head is registered first, so the
    shared weight is named head.weight."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        if bias:
            self.head = nn.Linear(TIED_WIDTH, TIED_VOCAB)
        self.tokens = nn.Embedding(TIED_VOCAB, TIED_WIDTH, padding_idx=PAD)
        self.mix = nn.Linear(TIED_WIDTH, TIED_WIDTH)
        if not bias:
            self.head = nn.Linear(TIED_WIDTH, TIED_VOCAB, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.tokens(ids))
        prefix = h.cumsum(1) / torch.arange(1, ids.shape[1] + 1, dtype=h.dtype)[:, None]
        return self.head(h + torch.tanh(self.mix(prefix)))


def case(name: str) -> tuple[nn.Module, str, torch.Tensor, torch.Tensor]:
    """A float64 model, its task, and 24 examples of token ids (a padding id in the last two positions of some)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name in TIED:  # repeated tokens (positions 1 and 3) and padding, its labels ignored as an attention mask does
        x = torch.randint(1, TIED_VOCAB, (24, POSITIONS), generator=gen)
        x[:, 3], x[::3, -2:] = x[:, 1], PAD
        return TiedCausalLM(bias=name == "tied_causal_bias").double(), "language_modelling", x, x.masked_fill(x == PAD, IGNORE_INDEX)
    x = torch.randint(0, VOCAB, (24, POSITIONS), generator=gen)
    if name == "embed_linear":
        x[::3, -2:] = PAD
        return EmbedLinear().double(), "cross_entropy", x, torch.randint(0, 3, (24,), generator=gen)
    return TinyLM(tied=name == "tied_lm").double(), "language_modelling", x, x.clone()


def naive_gradients(model: nn.Module, task: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each example's loss gradient by its own autograd.grad call, flattened in `named_parameters` order."""
    loss, params = resolve_task(task).loss, [p for _, p in model.named_parameters()]
    return torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss(model(x[i : i + 1]), y[i : i + 1]).sum(), params)]) for i in range(len(x))])


TIED = ["tied_causal", "tied_causal_bias"]
CASES = ["embed_linear", "lm", "tied_lm", *TIED]
# tied: the cut "tokens" is the shared weight, "head" the head's bias (a cut of its own)
CONTRACTED = {"embed_linear": {"tokens", "mix"}, "lm": {"tokens", "head"}, "tied_lm": {"tokens", "head"}, "tied_causal": {"tokens", "mix"}, "tied_causal_bias": {"tokens", "mix", "head"}}


@pytest.mark.parametrize("name", CASES)
def test_dispatch_puts_the_embedding_on_the_contracted_path(name):
    """The token embedding is captured (not vmapped), tied or not: a tied weight is one cut with the embedding's and
    the head's shares, and no column of it is vmapped; the position embedding of arange(T) is vmapped."""
    model, task, x, y = case(name)
    im = IdentityInfluence(model, task, batch_size=10).fit((x, y))
    split = im.gradient_split(x, y)
    assert {cut.name for cut in split.cuts} == CONTRACTED[name]
    listed = im.attributed_parameters()
    assert ("head.weight" if name == "tied_causal_bias" else "tokens.weight") in listed["captured"]["names"]
    assert listed["vmapped"]["names"] == (["positions.weight"] if name in ("lm", "tied_lm") else [])
    tokens = next(cut for cut in split.cuts if cut.name == "tokens")
    assert [share.layer.name for share in tokens.shares] == (["tokens", "head"] if "tied" in name else ["tokens"])
    assert split.rest_columns is None or not ((split.rest_columns >= tokens.cols.start) & (split.rest_columns < tokens.cols.stop)).any()


@pytest.mark.parametrize(("name", "module", "listed_as"), [("tied_causal", "head", "tokens.weight"), ("tied_causal_bias", "tokens", "head.weight")])
def test_a_tied_weight_can_be_chosen_by_either_module(name, module, listed_as):
    """`modules` naming the module that does not own the shared weight's name attributes that one tensor, as
    `named_parameters` lists it; scores equal a naive loop over its gradient alone."""
    model, task, x, y = case(name)
    im = IdentityInfluence(model, task, batch_size=10, modules=[module]).fit((x, y))
    names = im.attributed_parameters()["included"]["names"]
    assert names == [listed_as]
    loss, tensors = resolve_task(task).loss, [dict(model.named_parameters())[n] for n in names]
    grads = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss(model(x[i : i + 1]), y[i : i + 1]).sum(), tensors)]) for i in range(len(x))])
    torch.testing.assert_close(im.influences(x[:5], y[:5], x, y), grads[:5] @ grads.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_scores_and_query_factors_equal_a_naive_loop(name):
    """Identity: the factors are the queries' gradients and the scores their products with the training gradients;
    random factor rows (nonzero on the padding row too) score as rows @ gradients."""
    model, task, x, y = case(name)
    im = IdentityInfluence(model, task, batch_size=10).fit((x, y))
    grads = naive_gradients(model, task, x, y)
    if name == "embed_linear":
        assert grads[:, :WIDTH].abs().max() == 0  # torch gives the padding row no gradient; the captures mask it
    factors = im.influence_factors(x[:5], y[:5])
    torch.testing.assert_close(factors, grads[:5], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(im.influences_from_factors(factors, x, y), grads[:5] @ grads.T, rtol=1e-10, atol=1e-12)
    rows = torch.randn(4, grads.shape[1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close(im.influences_from_factors(rows, x, y), rows @ grads.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", TIED)
def test_rank_r_factors_of_a_tied_weight_score_as_their_dense_product(name):
    """query_rank 2: the tied weight's rows L R (V × 2, 2 × d) are gathered at the tokens (L[v] R) for the embedding's
    share and multiplied out for the head's; the scores are the dense rows L R against the naive gradients."""
    model, task, x, y = case(name)
    im = IdentityInfluence(model, task, batch_size=10, query_rank=2).fit((x, y))
    compressed = im.influence_factors(x[:4], y[:4])
    split = im.gradient_split(x, y)
    rows = factor_rows(compressed, split, im.row_order, im.query_rank)
    assert rows.layers["tokens"].rank == 2 and split.rest is None
    dense = torch.cat([cut.to_flat(dense_rows(rows.layers[cut.name]), im.row_order) for cut in split.cuts], dim=1)
    order = torch.cat([torch.arange(cut.cols.start, cut.cols.stop) for cut in split.cuts]).argsort()
    expected = dense[:, order] @ naive_gradients(model, task, x, y).T
    torch.testing.assert_close(im.influences_from_factors(compressed, x, y), expected, rtol=1e-10, atol=1e-12)


def test_direct_influence_through_the_embedding_equals_the_explicit_solve():
    model, task, x, y = case("embed_linear")
    im = DirectInfluence(model, task, 1e-2, second_order_mode="gauss_newton", batch_size=10).fit((x, y))
    factors = im.influence_factors(x[:4], y[:4])
    torch.testing.assert_close(im.influences(x[:4], y[:4], x, y), factors @ naive_gradients(model, task, x, y).T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_self_influence_and_block_norms_equal_a_naive_loop(name):
    """‖g_i‖² (identity's exact self-influence), each layer's squared norms from the captures (repeated tokens add
    before squaring), and a low-rank sketch's self-influence evaluated on the naive gradients."""
    model, task, x, y = case(name)
    grads = naive_gradients(model, task, x, y)
    identity = IdentityInfluence(model, task, batch_size=10).fit((x, y))
    torch.testing.assert_close(identity.self_influences(x, y), (grads**2).sum(1), rtol=1e-10, atol=1e-12)
    blocks = list(layer_blocks(identity.objective.space).values())
    split = identity.gradient_split(x, y)
    got = split.block_norms(identity.gradient_batch(x, y), blocks, Work())
    torch.testing.assert_close(got, torch.stack([(grads[:, b] ** 2).sum(1) for b in blocks]), rtol=1e-10, atol=1e-12)
    cg = CgInfluence(model, task, 1e-2, block_structure="layer_wise", batch_size=10).fit((x, y))
    plan = cg.self_influence_plan("lowrank", rank=3)
    norms = torch.stack([(grads[:, b] ** 2).sum(1) for b in cg._feature_slices()])
    torch.testing.assert_close(cg.self_influences(x, y, "lowrank", 3), plan.evaluate(plan.rows @ grads.T, norms), rtol=1e-10, atol=1e-12)


def test_contraction_counts_its_work_per_distinct_token():
    """Σ_t F[id_t]·g_t against a loop over positions, and 2·rows·(distinct (example, id) pairs)·width flops."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (6, POSITIONS), generator=gen)
    g = torch.randn(6, POSITIONS, WIDTH, generator=gen, dtype=torch.float64)
    rows = torch.randn(4, VOCAB, WIDTH, generator=gen, dtype=torch.float64)
    expected = torch.tensor([[sum(float(rows[j, ids[i, t]] @ g[i, t]) for t in range(POSITIONS)) for i in range(6)] for j in range(4)], dtype=torch.float64)
    work = Work()
    torch.testing.assert_close(contract_layer(LayerRows(dense=rows), ids, g, work), expected, rtol=1e-10, atol=1e-12)
    distinct = sum(len(set(row.tolist())) for row in ids)
    assert distinct < 6 * POSITIONS and work.score_flops == 2.0 * 4 * distinct * WIDTH


class FunctionalTie(nn.Module):
    """An output layer written as F.linear(h, emb.weight): the tie is tensor code, no second module holds the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid = nn.Embedding(11, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(torch.tanh(self.mid(self.emb(x))), self.emb.weight)


def test_a_weight_tied_by_tensor_code_keeps_vmap_and_exact_gradients():
    """The embedding's capture misses the output's share of its weight: the probe against autograd finds it, the
    weight keeps vmap, and the per-example gradients equal a backward loop (without the probe they do not)."""
    torch.manual_seed(0)
    model = FunctionalTie().double()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 11, (6, 5), generator=g), torch.randint(0, 11, (6, 5), generator=g)
    objective = Objective(model, LanguageModelling())
    split = GradientSplit(objective, (x, y))
    assert [cut.name for cut in split.cuts] == ["mid"] and split.rest is not None and split.rest.space.names == ["emb.weight"]
    grads = materialise(gradient_batch(split, x, y, Work()), split, "parameters", objective.space.dim)
    task, params = LanguageModelling(), [model.emb.weight, model.mid.weight, model.mid.bias]
    loop = torch.stack([torch.cat([t.reshape(-1) for t in torch.autograd.grad(task.mean_loss(task.output(model(x[i : i + 1])), y[i : i + 1]), params)]) for i in range(len(x))])
    torch.testing.assert_close(grads, loop, rtol=1e-10, atol=1e-12)
