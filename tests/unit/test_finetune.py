"""The pieces of fine-tuning, each against an independent reference: the warm-up's step sizes against Hugging Face's
schedules, a LoRA model's training (only the adapters move), and attribution over the adapters' parameters (the
captured gradients against a backward loop, Direct's scores against an autograd Hessian, EK-FAC's eigenvalues
against Direct's exact curvature block)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.func import functional_call

from influence_core import ConfigError, DirectInfluence
from influence_core.contraction import GradientSplit, gradient_batch, materialise
from influence_core.objective import Objective
from influence_core.pipeline.model.models import with_lora
from influence_core.pipeline.specs import LoraSpec, ModelSpec
from influence_core.task import LanguageModelling
from influence_core.training import AdamRecipe, train
from influence_core.work import Work
from tests.ekfac_checks import assert_ekfac_eigenvalues_are_exact

transformers = pytest.importorskip("transformers")
from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup  # noqa: E402

HF_SCHEDULES = {"constant": get_constant_schedule_with_warmup, "linear": get_linear_schedule_with_warmup, "cosine": get_cosine_schedule_with_warmup}
SPEC = ModelSpec(architecture="transformer", task="language_modelling", d_model=8, heads=2, layers=1, vocab_size=32, dtype="float64")
LORA = LoraSpec(rank=2, alpha=4, target_modules=["query", "up"])


def hugging_face_step_sizes(recipe: AdamRecipe, total: int, warm: int) -> list[float]:
    """The learning rate torch.optim.Adam takes at each step under Hugging Face's schedule with `warm` warm-up steps."""
    optimiser = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=recipe.learning_rate)
    options = {} if recipe.decay == "constant" else {"num_training_steps": total}
    schedule = HF_SCHEDULES[recipe.decay](optimiser, num_warmup_steps=warm, **options)
    sizes = []
    for _ in range(total):
        sizes.append(optimiser.param_groups[0]["lr"])
        optimiser.step()
        schedule.step()
    return sizes


@pytest.mark.parametrize("decay", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup, total", [(0.1, 40), (0.25, 7), (0.5, 3)])
def test_warmup_step_sizes_follow_hugging_faces_schedules(decay: str, warmup: float, total: int) -> None:
    """W = round(warmup·T) steps rise from exactly 0 by lr/W; the rest decay over T − W steps as Hugging Face's
    get_{constant,linear,cosine}_schedule_with_warmup do (to round-off: they multiply lr by a ratio)."""
    recipe = AdamRecipe(epochs=1, batch_size=1, learning_rate=3e-3, weight_decay=0.0, seed=0, decay=decay, warmup=warmup)
    warm = round(warmup * total)
    sizes = [recipe.step_size(t, total) for t in range(total)]
    assert recipe.warmup_steps(total) == warm >= 1 and sizes[0] == 0.0
    assert sizes[warm] == 3e-3  # the first step after the warm-up is the full learning rate, whatever the decay
    assert sizes[:warm] == [3e-3 * t / warm for t in range(warm)]
    assert sizes == pytest.approx(hugging_face_step_sizes(recipe, total, warm), rel=1e-12, abs=1e-18)


@pytest.mark.parametrize("decay", ["constant", "linear", "cosine"])
def test_no_warmup_keeps_the_step_sizes_bit_for_bit(decay: str) -> None:
    """warmup 0 (every existing config) gives the same floats as before the warm-up existed: trained weights and keys unchanged."""
    recipe, lr, total = AdamRecipe(1, 1, 1e-2, 0.0, 0, decay=decay), 1e-2, 37
    before = {"constant": lambda t: lr, "linear": lambda t: lr * (1 - t / total), "cosine": lambda t: lr * 0.5 * (1 + math.cos(math.pi * t / total))}[decay]
    assert [recipe.step_size(t, total) for t in range(total)] == [before(t) for t in range(total)]


def lora_model(seed: int = 0) -> torch.nn.Module:
    """The built-in byte transformer (float64) with LoRA adapters on its query and up projections."""
    torch.manual_seed(seed)
    return with_lora(SPEC.build(8, 32, (8,)).double(), LORA)


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 32, (n, 8), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def trained() -> torch.nn.Module:
    """The LoRA model trained 2 epochs (its adapters' lora_B start at 0; after training every adapter has moved)."""
    model = lora_model()
    x = tokens(16, 1)
    train(model, LanguageModelling(), AdamRecipe(epochs=2, batch_size=4, learning_rate=5e-2, weight_decay=0.0, seed=0, warmup=0.25), x, x)
    return model


def test_lora_training_moves_only_the_adapters(trained: torch.nn.Module) -> None:
    before = dict(lora_model().named_parameters())
    moved = {name for name, p in trained.named_parameters() if not torch.equal(p, before[name])}
    adapters = {name for name, p in trained.named_parameters() if p.requires_grad}
    assert adapters == {name for name in before if ".lora_A." in name or ".lora_B." in name} and len(adapters) == 4
    assert moved == adapters  # the base weights are the initial ones bit for bit


def adapter_vector(model: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return names, torch.cat([dict(model.named_parameters())[name].detach().reshape(-1) for name in names])


def loss_at(model: torch.nn.Module, names: list[str], flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The mean loss of the rows x as a function of the adapters' flat vector, by functional_call (no library code)."""
    shapes = [dict(model.named_parameters())[name].shape for name in names]
    parts = torch.split(flat, [math.prod(shape) for shape in shapes])
    params = {name: part.reshape(shape) for name, part, shape in zip(names, parts, shapes)}
    logits = functional_call(model, params, (x,))
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), x[:, 1:].reshape(-1), reduction="sum") / len(x)


def test_captured_adapter_gradients_equal_a_backward_loop(trained: torch.nn.Module) -> None:
    """Each adapter's lora_A and lora_B is an nn.Linear contracted from captures over the 8 positions, the frozen
    base layers left out: the per-example gradients equal autograd's, one example at a time (rtol 1e-10)."""
    x = tokens(5, 2)
    objective = Objective(trained, LanguageModelling())
    split = GradientSplit(objective, (x, x))
    grads = materialise(gradient_batch(split, x, x, Work()), split, "parameters", objective.space.dim)
    names, flat = adapter_vector(trained)
    expected = torch.stack([torch.func.grad(lambda v: loss_at(trained, names, v, x[i : i + 1]))(flat) for i in range(5)])
    assert [cut.name for cut in split.cuts] == [name.removesuffix(".weight") for name in names] and objective.space.names == names
    torch.testing.assert_close(grads, expected, rtol=1e-10, atol=1e-13)


def test_direct_scores_over_the_adapters_equal_a_naive_reference(trained: torch.nn.Module) -> None:
    """score[t, i] = ∇ℓ_tᵀ (H + λI)⁻¹ ∇ℓ_i with H the autograd Hessian of the mean training loss over the adapters'
    112 parameters alone (the base is constant): Direct's exact-Hessian scores and self-influences equal it."""
    x, xq, lam = tokens(12, 3), tokens(3, 4), 1.0
    names, flat = adapter_vector(trained)
    hessian = torch.func.hessian(lambda v: loss_at(trained, names, v, x))(flat)
    gradients = [torch.stack([torch.func.grad(lambda v: loss_at(trained, names, v, rows[i : i + 1]))(flat) for i in range(len(rows))]) for rows in (x, xq)]
    solved = torch.linalg.solve(hessian + lam * torch.eye(len(flat), dtype=flat.dtype), gradients[0].T)
    direct = DirectInfluence(trained, LanguageModelling(), lam, second_order_mode="hessian").fit((x, x))
    assert direct.attributed_parameters()["included"]["elements"] == len(flat) == 112
    torch.testing.assert_close(direct.influences(xq, xq, x, x), gradients[1] @ solved, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(direct.self_influences(x, x), (gradients[0] * solved.T).sum(1), rtol=1e-8, atol=1e-10)


def test_ekfac_eigenvalues_of_an_adapter_are_its_exact_curvature_in_its_eigenbasis(trained: torch.nn.Module) -> None:
    """With the exact Fisher, EK-FAC's eigenvalues for one adapter matrix (lora_B of the query projection) are
    diag(Pᵀ C P) for its exact Gauss-Newton block C (Direct's, built independently) and its Kronecker eigenbasis P."""
    layer = "blocks.0.attention.query.lora_B.default"
    x = tokens(6, 5)
    assert_ekfac_eigenvalues_are_exact(trained, layer, x)


def test_target_modules_that_name_no_layer_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        with_lora(SPEC.build(8, 32, (8,)), LoraSpec(target_modules=["attn"]))
    message = str(refused.value)
    assert refused.value.field == "training.lora.target_modules" and "\n" not in message and "blocks.0.attention.query" in message


def test_fastifs_default_feature_of_a_lora_model_is_the_last_hidden_activation() -> None:
    """With adapters on the MLP's last layer, the prefilter's default feature is still its input, the 6 hidden
    activations (the adapted layer's base_layer), not the rank-2 input of its lora_B."""
    from influence_core.pipeline.score.knn_prefilter import module_features

    spec = ModelSpec(hidden=[6])
    torch.manual_seed(0)
    plain = spec.build(4, 3, (4,))
    adapted = with_lora(spec.build(4, 3, (4,)), LoraSpec(rank=2, target_modules=["1", "3"]))
    adapted.load_state_dict({**adapted.state_dict(), **{k.replace("1.", "1.base_layer.").replace("3.", "3.base_layer."): v for k, v in plain.state_dict().items()}})
    x = torch.randn(5, 4)
    features = module_features(adapted, x)
    assert features.shape == (5, 6)
    torch.testing.assert_close(torch.from_numpy(features), torch.tanh(plain[1](x)), rtol=1e-6, atol=1e-6)  # lora_B is 0 at the start


def test_the_fine_tuning_configs_are_valid_and_train_on_disjoint_windows() -> None:
    """configs/finetune-lora.yaml fine-tunes configs/pretrain-docs.yaml's model (the same architecture, the weights
    the README copies from it) with LoRA, on windows the pretraining never saw, with a warm-up from 0."""
    import yaml

    from flows.parameters import RunParameters

    root = Path(__file__).resolve().parents[2] / "configs"
    base, tuned = (RunParameters.model_validate(yaml.safe_load((root / name).read_text())) for name in ("pretrain-docs.yaml", "finetune-lora.yaml"))
    assert tuned.model == base.model and tuned.training.init == "runs/pretrained-docs.pt" and tuned.training.lora is not None
    assert base.dataset.train_offset == 0 and tuned.dataset.train_offset >= base.dataset.n_train and tuned.dataset.window == base.dataset.window
    assert tuned.training.recipe().step_size(0, tuned.training.recipe().steps(tuned.dataset.n_train)) == 0.0
