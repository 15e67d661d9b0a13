"""MAGIC's metagradients against an independent reference: torch.optim.Adam retrained with per-example loss weights
in the same batch schedule, differentiated by central finite differences in float64; and the replay's memory
(checkpointed states) grows as √T, not T."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from influence_core.errors import ConfigError
from influence_core.magic import check_replayable, metagradients
from influence_core.magic.replay import Replay
from influence_core.task import Classification, Task
from influence_core.training import AdamRecipe, train

RECIPE = AdamRecipe(epochs=3, batch_size=4, learning_rate=5e-2, weight_decay=1e-2, seed=1, block_rows=8)  # two blocks: 8 + 6 rows


def _problem() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x, xq = torch.randn(14, 3, generator=g, dtype=torch.float64), torch.randn(3, 3, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (14,), generator=g), xq, torch.randint(0, 3, (3,), generator=g)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()


def _lr_scheduler(optimiser: torch.optim.Optimizer, recipe: AdamRecipe, total: int) -> torch.optim.lr_scheduler.LRScheduler:
    """torch's own schedulers for the recipe's decay, Hugging Face's with a warm-up: the reference does not use
    `AdamRecipe.step_size`."""
    if recipe.warmup:
        from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

        schedule = get_cosine_schedule_with_warmup if recipe.decay == "cosine" else get_linear_schedule_with_warmup
        return schedule(optimiser, num_warmup_steps=round(recipe.warmup * total), num_training_steps=total)
    if recipe.decay == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=total)
    return torch.optim.lr_scheduler.LambdaLR(optimiser, lambda t: 1 - t / total if recipe.decay == "linear" else 1.0)


def _retrained_query_losses(w: torch.Tensor, recipe: AdamRecipe = RECIPE) -> torch.Tensor:
    """The reference: torch.optim.Adam on the recipe's schedule (its step size decayed by torch's schedulers), each
    batch's loss mean(w_i ℓ_i), then the queries' losses."""
    x, y, xq, yq = _problem()
    model, task = _model(), Classification()
    optimiser = torch.optim.Adam(model.parameters(), lr=recipe.learning_rate, weight_decay=recipe.weight_decay)
    decay = _lr_scheduler(optimiser, recipe, recipe.steps(len(y)))
    for rows in recipe.schedule(len(y)).steps(recipe.epochs):
        optimiser.zero_grad()
        (task.loss(model(x[rows]), y[rows]) * w[rows]).mean().backward()
        optimiser.step()
        decay.step()
    with torch.no_grad():
        return task.loss(model(xq), yq)


def _central_difference_scores(retrained: Callable[[torch.Tensor], torch.Tensor], n: int, h: float = 1e-5) -> torch.Tensor:
    """The scores' reference, −n ∂m/∂w_i: central differences of `retrained(w)` (the queries' measurements after
    training with loss weights w) at w = 1, one weight moved by ±h at a time."""
    columns = []
    for i in range(n):
        up, down = torch.ones(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
        up[i], down[i] = 1 + h, 1 - h
        columns.append((retrained(up) - retrained(down)) / (2 * h))
    return -n * torch.stack(columns, 1)


@pytest.mark.parametrize("decay, warmup", [("constant", 0.0), ("linear", 0.0), ("cosine", 0.0), ("linear", 0.25), ("cosine", 0.25)])
def test_scores_equal_finite_differences_of_retraining(decay: str, warmup: float) -> None:
    x, y, xq, yq = _problem()
    recipe = dataclasses.replace(RECIPE, decay=decay, warmup=warmup)
    result = metagradients(_model(), Classification(), recipe, x, y, xq, yq)
    n = len(y)
    expected = _central_difference_scores(lambda w: _retrained_query_losses(w, recipe), n)
    torch.testing.assert_close(result.scores, expected, rtol=1e-5, atol=1e-7 * float(expected.abs().max()))
    assert result.work.reverse_steps == RECIPE.steps(n) == 3 * 4  # batches of 4, 4, 4 and 2 per epoch
    if decay != "constant":  # the decay is differentiated, not ignored: the constant step size's scores differ
        assert not torch.allclose(result.scores, metagradients(_model(), Classification(), RECIPE, x, y, xq, yq).scores, rtol=1e-2)


def test_sign_removing_a_helpful_example_raises_the_query_loss() -> None:
    """Removing example i (weight 0 in the same schedule) changes query losses by about score/n."""
    x, y, xq, yq = _problem()
    scores = metagradients(_model(), Classification(), RECIPE, x, y, xq, yq).scores
    base, n = _retrained_query_losses(torch.ones(len(y), dtype=torch.float64)), len(y)
    actual = torch.stack([_retrained_query_losses(torch.ones(n, dtype=torch.float64).index_fill(0, torch.tensor([i]), 0.0)) - base for i in range(n)], 1)
    predicted = scores / n
    assert torch.corrcoef(torch.stack([predicted.flatten(), actual.flatten()]))[0, 1] > 0.9


@pytest.mark.parametrize("decay, warmup", [("constant", 0.0), ("cosine", 0.0), ("linear", 0.25)])
def test_replay_retraces_training_bit_for_bit(decay: str, warmup: float) -> None:
    x, y, xq, yq = _problem()
    trained, recipe = _model(), dataclasses.replace(RECIPE, decay=decay, warmup=warmup)
    train(trained, Classification(), recipe, x, y)
    final = metagradients(_model(), Classification(), recipe, x, y, xq, yq).final
    assert all(torch.equal(final[name], p) for name, p in trained.named_parameters())


def test_the_replay_of_a_gpt2_retraces_its_fused_attention_training_bit_for_bit() -> None:
    """transformers' GPT-2 in float32, trained with the default (fused) attention kernel: the replay's states are the
    trained run's, bit for bit (the math kernel, whose rounding differs, only differentiates the steps)."""
    from influence_core.task import LanguageModelling

    x = torch.randint(0, 13, (8, 6), generator=torch.Generator().manual_seed(0))
    task, recipe = LanguageModelling(), AdamRecipe(epochs=2, batch_size=4, learning_rate=1e-2, weight_decay=0.0, seed=0, block_rows=8)
    trained = _tiny_gpt2(13, 6)
    train(trained, task, recipe, x, x)
    final = metagradients(_tiny_gpt2(13, 6), task, recipe, x, x, x[:2], x[:2]).final
    assert all(torch.equal(final[name], p) for name, p in trained.named_parameters())


def test_memory_grows_as_the_square_root_of_the_steps() -> None:
    x, y, xq, yq = _problem()
    short, long = (dataclasses.replace(RECIPE, epochs=e) for e in (1, 16))
    works = [metagradients(_model(), Classification(), r, x, y, xq, yq).work for r in (short, long)]
    steps = [short.steps(14), long.steps(14)]  # 4 and 64: 16 times as many
    for work, t in zip(works, steps):
        assert work.reverse_steps == t and work.peak_states <= 2 * math.ceil(math.sqrt(t))
        assert work.forward_steps <= 2 * t  # one forward pass, one recomputation
    assert works[1].peak_state_bytes <= 6 * works[0].peak_state_bytes  # 3 states, then 15 (2√T - 1), where keeping every state would take 16 times as many


def test_a_memory_budget_gives_the_same_scores() -> None:
    x, y, xq, yq = _problem()
    default = metagradients(_model(), Classification(), RECIPE, x, y, xq, yq)
    every_step = metagradients(_model(), Classification(), RECIPE, x, y, xq, yq, checkpoint_every=1)
    torch.testing.assert_close(every_step.scores, default.scores, rtol=0, atol=0)
    assert every_step.work.forward_steps == RECIPE.steps(14) and every_step.work.peak_states == RECIPE.steps(14)


def test_dropout_is_refused() -> None:
    with pytest.raises(ConfigError, match="^model: module '1' is dropout"):
        check_replayable(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.1)))


def test_weighted_training_is_the_replay_at_those_weights() -> None:
    """What `validation.counterfactual: weights` retrains (torch.optim.Adam, removed rows weighted 0 in every batch)
    is the training MAGIC differentiates, evaluated at those weights."""
    x, y, _, _ = _problem()
    mask = (torch.arange(14) % 3 != 0).double()
    trained = _model()
    train(trained, Classification(), RECIPE, x, y, weights=mask)
    _, final = Replay(_model(), Classification(), RECIPE, x, y).checkpoints(mask)
    for name, p in trained.named_parameters():
        torch.testing.assert_close(final.params[name], p.detach(), rtol=1e-12, atol=1e-14)


def _assert_scores_equal_finite_differences(model: Callable[[], torch.nn.Module], task: Task, recipe: AdamRecipe, x: torch.Tensor, y: torch.Tensor, xq: torch.Tensor, yq: torch.Tensor) -> None:
    """MAGIC's scores of the queries' measurements (summed over positions) for the training of `model()` against
    central finite differences of `train` with perturbed loss weights, the counterfactual it linearises."""

    def query_measurements(w: torch.Tensor) -> torch.Tensor:
        trained = model()
        train(trained, task, recipe, x, y, weights=w)
        with torch.no_grad():
            return task.measurement(task.output(trained(xq)), yq).reshape(len(xq), -1).sum(1)

    result = metagradients(model(), task, recipe, x, y, xq, yq)
    expected = _central_difference_scores(query_measurements, len(y))
    torch.testing.assert_close(result.scores, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


def _tiny_gpt2(vocab: int, context: int) -> torch.nn.Module:
    """transformers' GPT-2, one block of width 8, no dropout, its weights drawn from seed 3."""
    from tests.plugin_models import gpt2_lm

    torch.manual_seed(3)
    return gpt2_lm(n_layer=1, n_embd=8, n_head=2, vocab_size=vocab, n_positions=context, dropout=0.0)


def test_a_language_models_scores_equal_finite_differences_of_retraining() -> None:
    """The pipeline's own transformer (attention, layer norm, embeddings) as a float64 language model."""
    from influence_core.pipeline.model.transformer import TokenTransformer
    from influence_core.task import LanguageModelling

    g = torch.Generator().manual_seed(0)
    vocab, context, n = 11, 6, 10
    x, xq = torch.randint(0, vocab, (n, context), generator=g), torch.randint(0, vocab, (3, context), generator=g)
    recipe = AdamRecipe(epochs=2, batch_size=4, learning_rate=1e-2, weight_decay=1e-3, seed=0, block_rows=8)

    def model() -> torch.nn.Module:
        torch.manual_seed(1)
        return TokenTransformer(vocab, context, 8, 2, 1, vocab, causal=True).double()

    _assert_scores_equal_finite_differences(model, LanguageModelling(), recipe, x, torch.roll(x, -1, 1), xq, torch.roll(xq, -1, 1))


def test_lora_adapters_scores_equal_finite_differences_of_retraining() -> None:
    """A LoRA fine-tune (peft's adapters on the query and feed-forward projections of the pipeline's transformer, its
    base frozen): the metagradients run through the adapters alone, with a warm-up from 0, against `train`."""
    from influence_core.pipeline.model.models import with_lora
    from influence_core.pipeline.model.transformer import TokenTransformer
    from influence_core.pipeline.specs import LoraSpec
    from influence_core.task import LanguageModelling

    g = torch.Generator().manual_seed(0)
    vocab, context, n = 11, 6, 8
    x, xq = torch.randint(0, vocab, (n, context), generator=g), torch.randint(0, vocab, (2, context), generator=g)
    recipe = AdamRecipe(epochs=2, batch_size=4, learning_rate=2e-2, weight_decay=1e-3, seed=0, block_rows=8, warmup=0.25)

    def model() -> torch.nn.Module:
        torch.manual_seed(1)
        return with_lora(TokenTransformer(vocab, context, 8, 2, 1, vocab, causal=True).double(), LoraSpec(rank=2, target_modules=["query", "up"]))

    assert set(metagradients(model(), LanguageModelling(), recipe, x, x, xq, xq).final) == {n for n, p in model().named_parameters() if "lora_" in n}
    _assert_scores_equal_finite_differences(model, LanguageModelling(), recipe, x, x, xq, xq)


def test_a_hugging_face_gpt2s_scores_equal_finite_differences_of_retraining() -> None:
    """transformers' GPT-2 (scaled_dot_product_attention, whose fused CPU kernel has no second derivative) in float64,
    against `train`, which runs the fused kernel."""
    from influence_core.task import LanguageModelling

    g = torch.Generator().manual_seed(0)
    vocab, context, n = 13, 6, 8
    x, xq = torch.randint(0, vocab, (n, context), generator=g), torch.randint(0, vocab, (2, context), generator=g)
    recipe = AdamRecipe(epochs=2, batch_size=4, learning_rate=1e-2, weight_decay=0.0, seed=0, block_rows=8, decay="linear")
    _assert_scores_equal_finite_differences(lambda: _tiny_gpt2(vocab, context).double(), LanguageModelling(), recipe, x, x, xq, xq)


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_a_cnns_scores_equal_finite_differences_of_retraining(pooling: str) -> None:
    """The pipeline's CNN (3×3 convolutions, tanh, 2×2 max- or average-pools, a linear head) in float64: MAGIC's
    scores against central finite differences of weighted retraining, so its poor LDS on the digits CNN with
    max-pools is the linearisation's, not the gradient's."""
    from influence_core.pipeline.specs import ModelSpec

    g = torch.Generator().manual_seed(0)
    n = 10
    x, xq = torch.rand(n, 1, 4, 4, generator=g, dtype=torch.float64), torch.rand(3, 1, 4, 4, generator=g, dtype=torch.float64)
    y, yq = torch.randint(0, 3, (n,), generator=g), torch.randint(0, 3, (3,), generator=g)
    task, recipe = Classification(), AdamRecipe(epochs=3, batch_size=4, learning_rate=2e-2, weight_decay=1e-3, seed=0, block_rows=8)

    def model() -> torch.nn.Module:
        torch.manual_seed(2)
        built = ModelSpec(architecture="cnn", channels=[2, 3], pooling=pooling).build(16, 3, (1, 4, 4)).double()
        assert {type(m).__name__ for m in built if "Pool" in type(m).__name__} == {"MaxPool2d" if pooling == "max" else "AvgPool2d"}
        return built

    def query_losses(w: torch.Tensor) -> torch.Tensor:
        trained = model()
        train(trained, task, recipe, x, y, weights=w)
        with torch.no_grad():
            return task.loss(trained(xq), yq)

    result = metagradients(model(), task, recipe, x, y, xq, yq)
    expected = _central_difference_scores(query_losses, n)
    torch.testing.assert_close(result.scores, expected, rtol=1e-5, atol=1e-7 * float(expected.abs().max()))
