"""Fine-tuning in the pipeline (`training.init`, `training.warmup`, `training.lora`): fit_model trains from the init
file (local or S3) exactly as torch.optim.Adam does by hand under Hugging Face's warm-up schedule; a replaced init
retrains and a moved one does not; validation's retrainings and MAGIC's replay start from the init; LoRA trains and
attributes the adapters alone; a LoRA language model answers `query`; what cannot work is refused in one line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import get_linear_schedule_with_warmup

from flows.influence_run import influence_run
from flows.parameters import RunParameters
from influence_core import DirectInfluence
from influence_core.errors import ConfigError
from influence_core.magic import metagradients
from influence_core.pipeline.model.models import load_into, load_stored, with_lora
from influence_core.pipeline.runtime.preflight import preflight
from influence_core.pipeline.score.query import answer, query_arrays
from influence_core.pipeline.specs import LoraSpec, ModelSpec, StorageSpec
from influence_core.pipeline.stages import prepare, training
from influence_core.pipeline.stages.metagradients import first_step_warning
from influence_core.pipeline.stages.validation import subset_mask
from influence_core.pipeline.store import storage
from influence_core.pipeline.store.loading import load_model, open_data
from influence_core.training import AdamRecipe
from tests.helpers import read_outputs, small_params

MODEL = {"hidden": [6], "dtype": "float64"}
TRAINING = {"epochs": 3, "batch_size": 16, "learning_rate": 2e-2, "seed": 5, "warmup": 0.2, "lr_decay": "linear"}
DATASET = {"n_train": 96, "n_test": 6, "chunk_rows": 32}


def pretrained(path: Path, seed: int = 11) -> dict[str, torch.Tensor]:
    """The state_dict of the digits MLP drawn from another seed, scaled (so it is far from the run's own draw),
    saved at `path` (.safetensors or torch.save)."""
    torch.manual_seed(seed)
    state = {name: 3 * value for name, value in ModelSpec(**MODEL).build(64, 10, (64,)).double().state_dict().items()}
    if path.suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    return state


def params(output: Path, init: str, **overrides: Any) -> RunParameters:
    sections = {"dataset": DATASET, "model": MODEL, "training": {**TRAINING, "init": init}}
    for key, value in overrides.items():
        sections[key] = {**sections.get(key, {}), **value}
    return small_params(str(output), **sections)


def fit(run: RunParameters) -> tuple[Any, Any]:
    """prepare_data and fit_model of `run`: the data and model refs."""
    store = run.store()
    data = prepare.run(prepare.PrepareInput(run.dataset, store))
    return data, training.run(training.TrainingInput(run.model, run.training, data, store, run.compute.torch_threads))


def hand_trained(model: torch.nn.Module, recipe: AdamRecipe, x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
    """The reference: torch.optim.Adam over the trainable weights in the recipe's batch order, the step size from
    transformers' get_linear_schedule_with_warmup, each batch's loss by F.cross_entropy."""
    weights = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.Adam(weights, lr=recipe.learning_rate, weight_decay=recipe.weight_decay)
    total = recipe.steps(len(y))
    schedule = get_linear_schedule_with_warmup(optimiser, round(recipe.warmup * total), total)
    model.train()
    for rows in recipe.schedule(len(y)).steps(recipe.epochs):
        optimiser.zero_grad()
        F.cross_entropy(model(x[rows].double()), y[rows].long()).backward()
        optimiser.step()
        schedule.step()
    return model.eval()


def from_init(state: dict[str, torch.Tensor], lora: LoraSpec | None = None, seed: int = 5) -> torch.nn.Module:
    """A run's start, built here by hand: the digits MLP drawn from training.seed, `state` loaded, then LoRA
    adapters (drawn from the generator after the MLP's draw)."""
    torch.manual_seed(seed)
    model = ModelSpec(**MODEL).build(64, 10, (64,)).double()
    model.load_state_dict(state)
    return with_lora(model, lora)


def training_rows(data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    arrays = open_data(data, {})
    return torch.from_numpy(np.asarray(arrays["x_train"][...])), torch.from_numpy(np.asarray(arrays["y_train"][...]))


def assert_same_weights(got: torch.nn.Module, expected: torch.nn.Module) -> None:
    expected_state = expected.state_dict()
    assert got.state_dict().keys() == expected_state.keys()
    for name, value in got.state_dict().items():
        torch.testing.assert_close(value, expected_state[name], rtol=1e-10, atol=1e-13, msg=name)  # HF multiplies lr by a ratio: round-off


@pytest.mark.parametrize("where", ["local", "s3"])
def test_fine_tuning_from_an_init_equals_training_it_by_hand(tmp_path, where, request):
    state = pretrained(tmp_path / "init.safetensors")
    init, options = str(tmp_path / "init.safetensors"), {}
    if where == "s3":
        endpoint, bucket = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket")
        options = StorageSpec(endpoint_url=endpoint).fsspec_options()
        init = f"s3://{bucket}/weights/init.safetensors"
        storage.write_bytes(init, (tmp_path / "init.safetensors").read_bytes(), options)
    run = params(tmp_path / "run", init, **({"storage": {"endpoint_url": request.getfixturevalue("s3_endpoint")}} if where == "s3" else {}))
    data, model = fit(run)
    expected = hand_trained(from_init(state), run.training.recipe(), *training_rows(data))
    assert_same_weights(load_model(model, options), expected)
    scratch = fit(params(tmp_path / "scratch", init, training={"init": None}, **({"storage": {"endpoint_url": request.getfixturevalue("s3_endpoint")}} if where == "s3" else {})))[1]
    assert scratch.key != model.key and not torch.allclose(next(load_model(scratch, options).parameters()), next(expected.parameters()))


def test_a_replaced_init_retrains_and_a_moved_one_does_not(tmp_path):
    """Another init of the same size and modification time (as `cp -p` leaves it) trains again, from its weights;
    the same bytes at another path reuse the stored model."""
    init = tmp_path / "init.safetensors"
    pretrained(init)
    first = fit(params(tmp_path / "run", str(init), storage={"cache_url": str(tmp_path / "cache")}))[1]
    stamp, size = init.stat(), init.stat().st_size
    replaced = pretrained(init, seed=12)
    assert init.stat().st_size == size
    os.utime(init, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    run = params(tmp_path / "run", str(init), storage={"cache_url": str(tmp_path / "cache")})
    data, again = fit(run)
    assert again.key != first.key and again.created_at > first.created_at
    assert_same_weights(load_model(again, {}), hand_trained(from_init(replaced), run.training.recipe(), *training_rows(data)))
    moved = tmp_path / "elsewhere.safetensors"
    init.rename(moved)
    reused = fit(params(tmp_path / "run", str(moved), storage={"cache_url": str(tmp_path / "cache")}))[1]
    assert reused.key == again.key and reused.created_at == again.created_at


def test_validation_retrains_each_subset_from_the_init(tmp_path, prefect_api):
    """validate's LDS counterfactual is a fine-tune: subset 0's retrained model equals the init trained by hand on
    the subset's rows (its own batch schedule) with the run's recipe."""
    state = pretrained(tmp_path / "init.pt")
    run = params(tmp_path / "run", str(tmp_path / "init.pt"), validation={"subsets": 3, "fraction": 0.5, "queries": 6})
    summary = influence_run(**run.sections())
    assert summary["validation"]["subsets_computed"] == 3 and summary["validation"]["lds_mean"] is not None
    [stored] = Path(run.store().cache_url, "retrain").glob("*/0.pt")
    x, y = training_rows(_data_ref(run))
    mask = torch.from_numpy(subset_mask(run.validation, 0, len(y)))
    expected = hand_trained(from_init(state), run.training.recipe(), x[mask], y[mask])
    retrained = load_into(ModelSpec(**MODEL).build(64, 10, (64,)).double(), load_stored(str(stored), {}, "validate"))
    assert_same_weights(retrained, expected)


def _data_ref(run: RunParameters) -> Any:
    store = run.store()
    return prepare.run(prepare.PrepareInput(run.dataset, store))  # found complete: the run stored it


LORA = {"rank": 2, "alpha": 4.0, "target_modules": ["1", "3"]}  # the MLP's two nn.Linear layers


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_magic_replays_the_fine_tune_from_the_init(tmp_path, prefect_api, lora):
    """Method magic on a fine-tune (with a warm-up; with LoRA, through the adapters alone): its scores equal the
    library's metagradients of the init (and its seeded adapters) trained with the run's recipe; the summary
    records the largest score over the median."""
    state = pretrained(tmp_path / "init.pt")
    run = params(tmp_path / "run", str(tmp_path / "init.pt"), training={"lora": lora, "epochs": 2}, method={"name": "magic", "query_block": 4})
    summary = influence_run(**run.sections())
    scores = read_outputs(run.store())[1]["scores"]
    x, y = training_rows(_data_ref(run))
    arrays = open_data(_data_ref(run), {})
    xq, yq = (torch.from_numpy(np.asarray(arrays[name][...])) for name in ("x_test", "y_test"))
    spec = None if lora is None else LoraSpec(**lora)
    expected = metagradients(from_init(state, spec), run.model.make_task(), run.training.recipe(), x, y, xq, yq).scores.numpy()
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    magnitudes = np.abs(scores.astype(np.float64))
    assert summary["stages"]["compute_influences"]["spread"] == pytest.approx(magnitudes.max() / np.median(magnitudes), rel=1e-6)
    included = summary["parameters"]["included"]["names"]
    assert all(".lora_" in name for name in included) if lora else len(included) == 4
    assert first_step_warning(run.training, 96) is None  # warm-up from 0: no warning
    assert "full Adam step" in first_step_warning(run.training.model_copy(update={"warmup": 0.0}), 96)


def test_lora_trains_and_attributes_only_the_adapters(tmp_path, prefect_api):
    """With training.lora the stored model's base is the init bit for bit and only the adapters moved (as trained by
    hand); the scores are the library's Direct over the adapters; summary.json lists them as the attributed
    parameters and the index's rows hold the adapters' coordinates."""
    state = pretrained(tmp_path / "init.pt")
    run = params(tmp_path / "run", str(tmp_path / "init.pt"), training={"lora": LORA}, method={"name": "direct", "regularization": 1e-2, "second_order_mode": "gauss_newton"})
    summary = influence_run(**run.sections())
    data = _data_ref(run)
    model_ref = training.run(training.TrainingInput(run.model, run.training, data, run.store(), run.compute.torch_threads))  # found complete
    model, (x, y) = load_model(model_ref, {}), training_rows(data)
    expected = hand_trained(from_init(state, LoraSpec(**LORA)), run.training.recipe(), x, y)
    assert_same_weights(model, expected)
    base = {name.replace(".base_layer", ""): value for name, value in model.state_dict().items() if ".lora_" not in name}
    assert all(torch.equal(base[name], value) for name, value in state.items())
    adapters = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    assert set(adapters) == set(summary["parameters"]["included"]["names"]) and all(".lora_" in name for name in adapters)
    dim = sum(adapters.values())  # (64 + 6)·2 + (6 + 10)·2 = 172 against 460 weights of the MLP
    assert dim == summary["parameters"]["included"]["elements"] == 172
    assert summary["stages"]["index_training"]["bytes_per_row"] == 8 * dim  # float64 rows of the adapters' gradients
    arrays = open_data(data, {})
    xq, yq = (torch.from_numpy(np.asarray(arrays[name][...])) for name in ("x_test", "y_test"))
    reference = DirectInfluence(model, "cross_entropy", 1e-2, second_order_mode="gauss_newton").fit((x, y)).influences(xq, yq, x, y).numpy()
    scores = read_outputs(run.store())[1]["scores"]
    np.testing.assert_allclose(scores, reference, rtol=1e-4, atol=1e-5 * np.abs(reference).max())


def test_a_lora_language_model_answers_query_as_its_run_scored(tmp_path, prefect_api):
    """A byte transformer pretrained on some windows, fine-tuned with LoRA on others (EK-FAC, per-token scores, the
    training index): `query` with the run's own queries gives its top-k, from the index alone."""
    text = {"source": "python_docs", "window": 16, "n_train": 48, "n_test": 4, "chunk_rows": 16}
    model = {"architecture": "transformer", "d_model": 16, "heads": 2, "layers": 1}
    base = small_params(str(tmp_path / "base"), dataset=text, model=model, training={"epochs": 1, "batch_size": 16})
    fit(base)
    [weights] = Path(base.store().cache_url, "fit_model").glob("*/model.pt")
    run = small_params(
        str(tmp_path / "run"), dataset={**text, "seed": 1}, model=model,
        training={"epochs": 2, "batch_size": 16, "init": str(weights), "warmup": 0.1, "lora": {"rank": 2, "target_modules": ["query", "value"]}},
        method={"name": "ekfac", "regularization": 1e-2}, aggregate={"top_k": 3, "report_queries": 2, "token_scores": True},
    )
    summary = influence_run(**run.sections())
    outputs = read_outputs(run.store())[1]
    assert outputs["topk_helpful_token_scores"].shape == (4, 3, 16)
    np.testing.assert_allclose(outputs["topk_helpful_token_scores"].sum(-1), outputs["topk_helpful_scores"], rtol=1e-4, atol=1e-5 * np.abs(outputs["topk_helpful_scores"]).max())
    assert all(".lora_" in name for name in summary["parameters"]["included"]["names"]) and summary["parameters"]["included"]["elements"] == 2 * (2 * 16 + 16 * 2)  # query and value: A (2 × 16), B (16 × 2)
    arrays = open_data(_data_ref(run), {})
    np.savez(tmp_path / "queries.npz", x_test=arrays["x_test"][...], y_test=arrays["y_test"][...])
    found = answer(run.store(), *query_arrays(str(tmp_path / "queries.npz"), {}), top_k=3)
    assert found.work.gradient_rows == 4
    np.testing.assert_array_equal(found.arrays["topk_helpful_indices"], outputs["topk_helpful_indices"])
    np.testing.assert_allclose(found.arrays["topk_helpful_scores"], outputs["topk_helpful_scores"], rtol=1e-4, atol=1e-5 * np.abs(outputs["topk_helpful_scores"]).max())


@pytest.mark.parametrize("section, value, field, words", [
    ("model", {"checkpoint": __file__}, "training.init", "loads without training"),
    ("training", {"lora": {**LORA, "dropout": 0.1}, "init": None, "warmup": 0.0}, "training.lora.dropout", "set training.lora.dropout to 0"),
])
def test_what_cannot_fine_tune_is_refused_in_one_line(tmp_path, section, value, field, words):
    sections = {"dataset": DATASET, "model": MODEL, "training": {**TRAINING, "init": str(tmp_path / "init.pt")}, "method": {"name": "magic"}}
    sections[section] = {**sections[section], **value}
    with pytest.raises(ConfigError) as refused:
        RunParameters.from_sections(output_url=str(tmp_path / "run"), **sections)
    assert refused.value.field == field and words in str(refused.value) and "\n" not in str(refused.value)


def test_lora_with_a_checkpoint_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as refused:
        RunParameters.from_sections(output_url=str(tmp_path / "run"), model={**MODEL, "checkpoint": __file__}, training={"lora": LORA})
    assert refused.value.field == "training.lora" and "Fix: " in str(refused.value) and "\n" not in str(refused.value)


def test_an_init_for_another_model_is_refused_before_training(tmp_path):
    """Weights of a wider MLP: refused by fit_model, before any training step, naming training.init and the shapes."""
    torch.manual_seed(0)
    torch.save(ModelSpec(hidden=[7]).build(64, 10, (64,)).double().state_dict(), tmp_path / "other.pt")
    with pytest.raises(ConfigError) as refused:
        fit(params(tmp_path / "run", str(tmp_path / "other.pt")))
    message = str(refused.value)
    assert refused.value.field == "training.init" and "size mismatch for 1.weight" in message and "\n" not in message
    assert not list(Path(tmp_path / "run" / "stages" / "fit_model").glob("*/model.pt"))


def test_a_missing_init_is_refused_before_anything_runs(tmp_path):
    run = params(tmp_path / "run", str(tmp_path / "nope.safetensors"))
    with pytest.raises(ConfigError, match=r"^training.init: no initial weights at '.*nope.safetensors'\. Fix: give the path or s3:// URL of a saved state_dict$"):
        preflight(run.store(), run.compute, run.model, run.training)


def test_a_factorys_own_pretrained_weights_are_keyed_on_what_it_builds(tmp_path):
    """A model factory that reads pretrained weights from a file the pipeline never sees: fit_model fine-tunes them
    (as trained by hand), and other weights in that file, at the same size and modification time, train again."""
    weights = tmp_path / "weights.pt"
    state = pretrained(weights)
    factory = {"factory": "tests.plugin_models:pretrained_mlp", "options": {"weights": str(weights)}, "dtype": "float64"}
    run = small_params(str(tmp_path / "run"), dataset=DATASET, model=factory, training=TRAINING)
    data, first = fit(run)
    assert_same_weights(load_model(first, {}), hand_trained(from_init(state), run.training.recipe(), *training_rows(data)))
    stamp = weights.stat()
    replaced = pretrained(weights, seed=12)
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    again = fit(run)[1]
    assert again.key != first.key
    assert_same_weights(load_model(again, {}), hand_trained(from_init(replaced), run.training.recipe(), *training_rows(data)))
