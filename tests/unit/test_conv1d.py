"""transformers' Conv1D (GPT-2's projections: weight (in, out), y = x W + b) is a linear layer everywhere nn.Linear
is: captured, contracted, K-FAC/EK-FAC factored. Checked against an explicit backward loop in float64, against the
same model built from nn.Linear, and against Direct's exact Gauss-Newton block on a small GPT-2."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from influence_core import ConfigError, DirectInfluence, EkfacInfluence, KfacInfluence
from influence_core.contraction import GradientSplit, gradient_batch, materialise
from influence_core.layers import layer_type, select_layers
from influence_core.objective import Objective
from influence_core.task import LanguageModelling
from influence_core.work import Work
from tests.ekfac_checks import assert_ekfac_eigenvalues_are_exact

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402


def stack(linear: bool) -> nn.Module:
    """(B, T, 4) → (B, T, 3) through two projections, Conv1D or their nn.Linear twins with the same weights."""
    torch.manual_seed(0)
    first, second = Conv1D(6, 4), Conv1D(3, 6)
    if linear:
        twins = []
        for conv in (first, second):
            twin = nn.Linear(conv.nx, conv.nf)
            twin.weight.data, twin.bias.data = conv.weight.data.T.clone(), conv.bias.data.clone()
            twins.append(twin)
        first, second = twins
    return nn.Sequential(first, nn.Tanh(), second).double()


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n, 5), generator=g)


def loop_gradients(model: nn.Module, task: LanguageModelling | str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    objective = Objective(model, task)
    rows = []
    for i in range(len(x)):
        value = objective.task.mean_loss(objective.task.output(model(x[i : i + 1])), y[i : i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, [p for p in model.parameters() if p.requires_grad])]))
    return torch.stack(rows)


def contracted_gradients(model: nn.Module, task: LanguageModelling | str, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    objective = Objective(model, task)
    split = GradientSplit(objective, (x, y))
    grads = materialise(gradient_batch(split, x, y, Work()), split, "parameters", objective.space.dim)
    return grads, [cut.name for cut in split.cuts]


def test_conv1d_gradients_are_captured_and_match_a_backward_loop():
    """Both Conv1D layers are contracted from captures over 5 positions; their per-example gradients, in the
    parameters' own (in, out) layout, equal an explicit backward loop (rtol 1e-10)."""
    model = stack(linear=False)
    x, y = data(6, 1)
    grads, cut = contracted_gradients(model, "classification", x, y)
    assert cut == ["0", "2"] and [layer_type(m) for m in model] == ["Conv1D", None, "Conv1D"]
    torch.testing.assert_close(grads, loop_gradients(model, "classification", x, y), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("method, options", [(KfacInfluence, {"fisher": "exact"}), (EkfacInfluence, {"fisher": "exact"}), (EkfacInfluence, {"fisher": "sampled"}), (DirectInfluence, {"second_order_mode": "gauss_newton"})])
def test_conv1d_scores_equal_the_linear_twin(method, options):
    """K-FAC, EK-FAC (exact and sampled Fisher) and Direct give the same scores and self-influences on the Conv1D
    model as on the same model built from nn.Linear (rtol 1e-10)."""
    train, queries = data(12, 2), data(3, 3)
    got, expected = (method(stack(linear), "classification", 0.1, **options).fit(train) for linear in (False, True))
    torch.testing.assert_close(got.influences(*queries, *train), expected.influences(*queries, *train), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(got.self_influences(*train), expected.self_influences(*train), rtol=1e-10, atol=1e-13)


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    """A 2-layer GPT-2 (n_embd 16, vocabulary 20) with random weights: no download."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=20, n_positions=8, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).double().eval()


def test_gpt2_projections_are_tracked_and_gradients_match(gpt2):
    """Every GPT-2 projection is a Conv1D layer contracted from captures, and so is the token embedding tied to
    lm_head (both shares); the position embedding and LayerNorms go through vmap; together they equal the backward
    loop on the LM task (rtol 1e-10)."""
    ids = torch.randint(0, 20, (3, 6), generator=torch.Generator().manual_seed(4))
    grads, cut = contracted_gradients(gpt2, LanguageModelling(), ids, ids)
    assert len(cut) == 9 and all(layer_type(dict(gpt2.named_modules())[name]) == "Conv1D" for name in cut[:8]) and cut[8] == "transformer.wte"
    assert [layer.name for layer in select_layers(gpt2, ["Conv1D"])] == cut[:8]
    torch.testing.assert_close(grads, loop_gradients(gpt2, LanguageModelling(), ids, ids), rtol=1e-10, atol=1e-13)


def test_gpt2_squared_norms_with_the_tied_embedding_match(gpt2):
    """Each example's squared gradient norm from the captures, the tied wte/lm_head weight's cross term between its
    two shares included, equals the backward loop's (rtol 1e-10)."""
    ids = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(7))
    objective = Objective(gpt2, LanguageModelling())
    split = GradientSplit(objective, (ids, ids))
    norms = split.block_norms(gradient_batch(split, ids, ids, Work()), [slice(0, objective.space.dim)], Work())[0]
    torch.testing.assert_close(norms, (loop_gradients(gpt2, LanguageModelling(), ids, ids) ** 2).sum(1), rtol=1e-10, atol=1e-13)


def test_gpt2_ekfac_eigenvalues_are_the_exact_curvature_in_its_eigenbasis(gpt2):
    """With the exact Fisher, EK-FAC's eigenvalues for a GPT-2 Conv1D projection are diag(Pᵀ C P) for the layer's
    exact Gauss-Newton block C (Direct's, built independently) and its Kronecker eigenbasis P."""
    layer = "transformer.h.1.attn.c_proj"
    ids = torch.randint(0, 20, (6, 5), generator=torch.Generator().manual_seed(5))
    assert_ekfac_eigenvalues_are_exact(gpt2, layer, ids)


def test_gpt2_tied_lm_head_is_left_out_of_kronecker_factors(gpt2):
    """GPT-2's lm_head shares the token embedding's weight, which the model registers under the embedding's name:
    K-FAC's default layers are the 8 Conv1D projections (they used to include lm_head, whose weight K-FAC then could
    not find), scoring exactly as when those are named; naming lm_head is refused with the reason and the fix."""
    ids = torch.randint(0, 20, (8, 6), generator=torch.Generator().manual_seed(6))
    projections = [layer.name for layer in select_layers(gpt2, ["Conv1D"])]
    assert [layer.name for layer in select_layers(gpt2)] == projections and "lm_head" not in projections
    default = KfacInfluence(gpt2, LanguageModelling(), 1e-2, fisher="exact").fit((ids, ids))
    named = KfacInfluence(gpt2, LanguageModelling(modules=tuple(projections)), 1e-2, fisher="exact").fit((ids, ids))
    torch.testing.assert_close(default.influences(ids[:3], ids[:3], ids, ids), named.influences(ids[:3], ids[:3], ids, ids), rtol=0, atol=0)
    assert "transformer.wte.weight" in default.attributed_parameters()["excluded"]["names"]
    with pytest.raises(ConfigError, match=r"\['lm_head'\] share their weight with another module"):
        KfacInfluence(gpt2, LanguageModelling(modules=("lm_head",)), 1e-2)
