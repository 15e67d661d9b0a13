"""Stage 2: a trained (or loaded) model, stored as a state_dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ... import examples
from ...errors import ConfigError
from ...objective import Objective
from ..model.models import build_model, checkpoint_content, check_model_fits, evaluate, initial_model, load_into, load_state, save_stored, state_bytes, train, training_key
from ..store.refs import DataRef, ModelRef
from ..specs import CandidatesSpec, ModelSpec, TrainingSpec
from ..score.finite import check_finite
from ..store.loading import load_model, open_data
from ..store.stage import StageCall, StageInput, StageLocation
from ..store.run_store import RunStore


def check_ensemble(training: TrainingSpec, model: ModelSpec, candidates: CandidatesSpec) -> None:
    """An ensemble trains its members, so it needs the recipe (no checkpoint), and one model's features (no FastIF prefilter)."""
    n = training.ensemble
    if n > 1 and model.checkpoint:
        raise ConfigError(
            "training.ensemble", f"ensemble={n} trains {n} models with seeds training.seed + m, but model.checkpoint ({model.checkpoint}) loads a single trained model",
            "set training.ensemble to 1 with a checkpoint, or leave model.checkpoint empty so that the pipeline trains the members",
        )
    if n > 1 and candidates.knn_k is not None:
        raise ConfigError(
            "training.ensemble", f"ensemble={n} is not supported with the FastIF prefilter (candidates.knn_k={candidates.knn_k}), whose candidates come from one model's features",
            "set training.ensemble to 1, or candidates.knn_k to null to score every training example with the ensemble",
        )


def check_start(training: TrainingSpec, model: ModelSpec) -> None:
    """training.init and training.lora say how fit_model trains; model.checkpoint is a model trained already, loaded
    without training: refused together, naming the training's field."""
    if training.init and model.checkpoint:
        raise ConfigError(
            "training.init", f"fit_model fine-tunes from training.init, but model.checkpoint ({model.checkpoint}) is a trained model that it loads without training",
            "to fine-tune, name the pretrained weights in training.init and leave model.checkpoint empty; to attribute a finished model, leave training.init empty",
        )
    if training.lora and model.checkpoint:
        raise ConfigError(
            "training.lora", f"fit_model trains LoRA adapters, but model.checkpoint ({model.checkpoint}) is a trained model that it loads without training",
            "to fine-tune adapters, name the base weights in training.init and leave model.checkpoint empty; to attribute a finished model, leave training.lora empty",
        )


@dataclass(frozen=True)
class TrainingInput(StageInput[ModelRef]):
    """The model and training specs, the data, and the torch threads and device the fit runs with (the device is not
    part of the key: it changes where the model trains, not what the stage is)."""

    spec: ModelSpec
    training: TrainingSpec
    data: DataRef
    store: RunStore
    threads: int
    device: str = "cpu"

    def plan(self) -> StageCall[ModelRef]:
        config: dict[str, Any] = {"model": self.spec.hashed_dump()}
        if self.spec.checkpoint:
            config["checkpoint_content"] = checkpoint_content(self.spec.checkpoint, self.store.options)
        else:
            config |= training_key(self.spec, self.training, self.data, self.store.options)
        return StageCall("fit_model", ModelRef, config, {"train": self.data.training}, self.store, self.threads)


def _fit(stage: TrainingInput, loc: StageLocation) -> dict[str, Any]:
    spec, training, data, store = stage.spec, stage.training, stage.data, stage.store
    arrays = open_data(data, store.options)
    with torch.random.fork_rng():  # initialisation and dropout masks are part of the seeded, reproducible fit
        if spec.checkpoint:  # a checkpoint for another model is named as such, before the outputs are checked
            model = load_into(build_model(spec, data, stage.device), load_state(spec.checkpoint, store.options))
        else:  # initial weights for another model are refused here, before any training step
            model = initial_model(spec, training, data, store.options, stage.device)
        check_model_fits(model, spec, arrays)
        if not spec.checkpoint:
            train(model, spec, training, arrays["x_train"], arrays["y_train"])
        _check_weights(model, spec)
        task = spec.make_task()
        metrics = evaluate(model, task, arrays["x_train"], arrays["y_train"], "train")  # the queries' are each run's: query_metrics
    raw = state_bytes(model)
    url = loc.path("model.pt")
    save_stored(url, raw, store.options)
    first = next(model.parameters())
    objective = Objective(model, spec.make_task())
    with torch.no_grad():
        out_features = int(objective.outputs(objective.params, objective.to_model(examples.read(arrays["x_train"], slice(0, 1)), torch.zeros(1))[0]).shape[-1])
    return {
        "url": url,
        "fingerprint": loc.key,
        "shape": (sum(p.numel() for p in model.parameters()),),
        "dtype": str(first.dtype).removeprefix("torch."),
        "spec": spec.model_dump(mode="json"),
        "in_features": int(torch.Size(data.feature_shape).numel()),
        "out_features": out_features,
        "feature_shape": list(data.feature_shape),
        "train_loss": None if spec.checkpoint else metrics["train_loss"],
        "lora": None if training.lora is None else training.lora.model_dump(mode="json"),  # refused with a checkpoint
        "metrics": metrics,
    }


def _check_weights(model: torch.nn.Module, spec: ModelSpec) -> None:
    """NaN or infinite weights, from a training that diverged or in a checkpoint, would make every later stage's
    numbers NaN: refused here, before the model is stored."""
    wider = ", or set model.dtype: float64" if spec.dtype == "float32" else ""
    for name, weights in model.named_parameters():
        if spec.checkpoint:
            check_finite("fit_model", weights.detach(), f"weights of {name} in the checkpoint", "the checkpoint is damaged or its training diverged", "load a checkpoint whose weights are finite")
        else:
            check_finite("fit_model", weights.detach(), f"trained weights of {name}", "the training diverged", f"lower training.learning_rate or train for fewer training.epochs{wider}, then run again")


def run(stage: TrainingInput) -> ModelRef:
    """Train (or load) the model with `stage.threads` torch threads, or return the stored one."""
    return stage.call.run(lambda loc: _fit(stage, loc))


def query_metrics(model: ModelRef, data: DataRef, store: RunStore, device: str = "cpu") -> dict[str, float]:
    """The trained model's loss (and accuracy) on this run's queries: evaluated by every run, since fit_model is keyed
    on the training rows alone and reused by runs that ask other queries."""
    arrays = open_data(data, store.options)
    task = ModelSpec.model_validate(model.spec).make_task()
    return evaluate(load_model(model, store.options, device), task, arrays["x_test"], arrays["y_test"], "query")
