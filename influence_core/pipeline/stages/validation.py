"""Stage 7 (optional): the run's own linear datamodeling score (LDS).

The run's model is retrained on `validation.subsets` random subsets of the training set, one Dask task per subset,
with the run's recipe (architecture, task, training spec and seed). Each retrained model is stored under a key of
the training side alone (`retrain/{key}/{index}.pt`: training rows, recipe, subset draw), so runs with other queries
reuse it and only measure their queries; each subset's query measurements are kept as one small file of the stage,
so a stopped validation resumes with the subsets it has not finished. The LDS ranks, per query, the scores summed
over each subset against those measurements (influence_core.lds).
"""

from __future__ import annotations

import json

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..store import integrity, storage
from ... import examples
from ...errors import ConfigError
from ...lds import change_slope, linear_datamodeling_score
from ..model.models import build_model, initial_model, load_into, load_stored, save_stored, state_bytes, train, training_key
from ...objective import Objective
from ..store.refs import DataRef, ModelRef, StageRef, ValidationRef
from ..specs import ComputeSpec, ModelSpec, TrainingSpec, ValidationSpec
from ..runtime.cluster import task_slots, throttled
from ..runtime.threads import torch_threads
from ..store.loading import load_model, open_data
from ..store.stage import StageCall, StageInput, StageLocation, stage_key
from ..store.run_store import RunStore

Progress = Callable[[int, int], None]


def check_validate(spec: ValidationSpec, model: ModelSpec) -> None:
    """Validation retrains the model, so it needs the recipe that trained it: refused for a loaded checkpoint."""
    if spec.subsets and model.checkpoint:
        raise ConfigError(
            "validation.subsets", f"the model comes from model.checkpoint ({model.checkpoint}), so the pipeline has no recipe to retrain it on subsets",
            "let the pipeline train the model (leave model.checkpoint empty, set training.*), or set validation.subsets to 0",
        )


def subset_mask(spec: ValidationSpec, index: int, n_train: int) -> np.ndarray:
    """Subset `index`: round(fraction·n) distinct training rows, drawn from its own seeded stream."""
    rng = np.random.default_rng([spec.seed, index])
    mask = np.zeros(n_train, dtype=bool)
    mask[rng.choice(n_train, size=max(1, round(spec.fraction * n_train)), replace=False)] = True
    return mask


@dataclass(frozen=True)
class ValidationJob:
    """What one retraining task needs: refs and specs, never data."""

    spec: ValidationSpec
    model: ModelSpec
    training: TrainingSpec
    data: DataRef
    options: dict[str, Any]
    url: str  # the stage's directory: subsets/{index}.json hold each retrained model's measurements
    models_url: str  # the retrained models' directory, keyed on the training side alone: {index}.pt
    threads: int
    device: str = "cpu"

    @property
    def queries(self) -> int:
        return min(self.spec.queries, self.data.n_test)

    def subset_url(self, index: int) -> str:
        return storage.join(self.url, "subsets", f"{index}.json")

    def model_url(self, index: int) -> str:
        return storage.join(self.models_url, f"{index}.pt")


def retrained_model(job: ValidationJob, index: int, arrays: dict[str, Any]) -> tuple[torch.nn.Module, bool]:
    """The run's model retrained on subset `index`: read back when a run over the same training side stored it, else
    trained here from the run's initial weights (its seed, training.init, its adapters) and stored. Returns it and
    whether it was trained now."""
    with torch.random.fork_rng():
        try:
            stored = load_stored(job.model_url(index), job.options, field="validate", device=job.device)
            return load_into(build_model(job.model, job.data, job.device, job.training.lora), stored), False
        except (FileNotFoundError, ConfigError):  # not stored yet, or cut short by a crash, or damaged
            pass
        model = initial_model(job.model, job.training, job.data, job.options, job.device)  # as the run's model started
        mask = subset_mask(job.spec, index, job.data.n_train)
        if job.spec.counterfactual == "weights":  # every batch of the full run, the removed rows weighted 0
            train(model, job.model, job.training, arrays["x_train"], arrays["y_train"], torch.from_numpy(mask))
        else:
            x, y = examples.map_inputs(arrays["x_train"], lambda a: np.asarray(a[...])[mask]), np.asarray(arrays["y_train"][...])[mask]
            train(model, job.model, job.training, x, y)
    save_stored(job.model_url(index), state_bytes(model), job.options)
    return model, True


def measure_subset(job: ValidationJob, index: int) -> tuple[list[float], bool]:
    """One Dask task: the run's model retrained on subset `index` (or its stored copy), measured on the first queries
    (the task's measurement). Returns the measurements and whether the model was trained now."""
    arrays = open_data(job.data, job.options)
    with torch_threads(job.threads):
        model, trained = retrained_model(job, index, arrays)
        values = measure(job, model, arrays)
    integrity.write_checked(job.subset_url(index), json.dumps({"index": index, "measured": values}).encode(), job.options)
    return values, trained


def measure(job: ValidationJob, model: torch.nn.Module, arrays: dict[str, Any]) -> list[float]:
    """The task's measurement of the first queries (summed over each query's positions), in eval mode."""
    model.eval()
    task = job.model.make_task()
    objective = Objective(model, task)
    xq, yq = objective.to_model(examples.read(arrays["x_test"], slice(0, job.queries)), examples.read(arrays["y_test"], slice(0, job.queries)))
    with torch.no_grad():
        measured = task.measurement(task.output(examples.call(model, xq)), yq)
    return [float(v) for v in measured.reshape(job.queries, -1).sum(dim=1)]


def _stored(job: ValidationJob, index: int) -> list[float] | None:
    """A finished subset's measurements; None when absent or damaged (it is retrained)."""
    try:
        stored = json.loads(integrity.read_checked(job.subset_url(index), job.options, "validate", ""))
        values = stored["measured"] if stored["index"] == index else None
    except (FileNotFoundError, ValueError, KeyError, TypeError):  # DamagedError is a ValueError
        return None
    return values if isinstance(values, list) and len(values) == job.queries else None


def _measure(job: ValidationJob, pending: list[int], client: Any, slots: int, on_progress: Progress | None) -> Iterator[tuple[int, tuple[list[float], bool]]]:
    """Measure the pending subsets (retraining those not stored), on the cluster, `slots` at a time, or here,
    yielding (index, (measurements, trained now)) as each finishes."""
    done = job.spec.subsets - len(pending)
    if client is None:
        results: Iterator[tuple[int, tuple[list[float], bool]]] = ((i, measure_subset(job, i)) for i in pending)
    else:
        results = ((pending[k], outcome) for k, outcome in throttled(client, measure_subset, [(job, i) for i in pending], slots))
    for index, outcome in results:
        done += 1
        if on_progress:
            on_progress(done, job.spec.subsets)
        yield index, outcome


def _validate(job: ValidationJob, model: ModelRef, scores: StageRef, store: RunStore, client_factory: Callable[[], Any], on_progress: Progress | None, loc: StageLocation) -> dict[str, Any]:
    measured = {i: values for i in range(job.spec.subsets) if (values := _stored(job, i)) is not None}
    pending = [i for i in range(job.spec.subsets) if i not in measured]
    trained, slots = 0, 0
    if pending:
        with client_factory() as client:
            slots = 1 if client is None else task_slots(client, job.threads)
            for index, (values, now) in _measure(job, pending, client, slots, on_progress):
                measured[index], trained = values, trained + now
    masks = np.stack([subset_mask(job.spec, i, job.data.n_train) for i in range(job.spec.subsets)])
    table = np.array([measured[i] for i in range(job.spec.subsets)])
    score_rows = np.asarray(storage.open_array(scores.url, store.options)[: job.queries], dtype=np.float64)
    lds = linear_datamodeling_score(score_rows, masks, table)
    with torch_threads(job.threads):
        full = np.array(measure(job, load_model(model, store.options, job.device), open_data(job.data, store.options)))
    slope, pearson = change_slope(score_rows, masks, table, full)
    url = loc.path("validation.json")
    result = {"lds_mean": _finite(lds.mean), "lds_stderr": _finite(lds.stderr), "lds_per_query": [_finite(v) for v in lds.per_query], "slope": _finite(slope), "pearson": _finite(pearson)}
    integrity.write_checked(url, json.dumps({**result, "measured": table.tolist()}, indent=2).encode(), store.options)
    return {
        "url": url, "fingerprint": loc.key, "shape": (job.queries,), "dtype": "float64", **result,
        "subsets": job.spec.subsets, "subsets_computed": len(pending), "fraction": job.spec.fraction, "queries": job.queries,
        "concurrent_retrainings": slots,
        "work": {"trainings": trained, "training_rows": trained * _rows_trained(job, masks[0]) * job.training.epochs, "measured_subsets": len(pending)},
    }


def _rows_trained(job: ValidationJob, mask: np.ndarray) -> int:
    """Rows one retraining passes over per epoch: the subset's, or every row (the removed ones weighted 0)."""
    return job.data.n_train if job.spec.counterfactual == "weights" else int(mask.sum())


def _finite(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


@dataclass(frozen=True)
class ValidationInput(StageInput[ValidationRef]):
    """The validation spec, the run's recipe (model and training specs), its data, model and scores, and the compute
    spec: its cluster runs the retrainings, each with its torch threads."""

    spec: ValidationSpec
    model_spec: ModelSpec
    training: TrainingSpec
    data: DataRef
    model: ModelRef
    scores: StageRef
    store: RunStore
    compute: ComputeSpec

    def plan(self) -> StageCall[ValidationRef]:
        config = {"validate": self.spec.key_config(), "model": self.model_spec.hashed_dump(), **self.training_config}
        return StageCall("validate", ValidationRef, config, {"data": self.data, "model": self.model, "scores": self.scores}, self.store, self.compute.torch_threads)

    @cached_property
    def training_config(self) -> dict[str, Any]:
        """The retrainings' recipe and start (training.init's content, a factory's weights), as fit_model's key has them."""
        return training_key(self.model_spec, self.training, self.data, self.store.options)

    @property
    def models_url(self) -> str:
        """Where the retrained models live: keyed on the training side, the recipe, its start and the subsets' draw
        alone (never the queries or the scores), so every run over the same training rows shares them."""
        draw = {name: value for name, value in self.spec.key_config().items() if name in ("fraction", "seed", "counterfactual")}
        config = {"model": self.model_spec.hashed_dump(), **self.training_config, "subsets": draw, "threads": self.compute.torch_threads}
        return storage.join(self.store.cache_url, "retrain", stage_key("retrain", config, {"train": self.data.training}))


def run(stage: ValidationInput, client_factory: Callable[[], Any], on_progress: Progress | None = None) -> ValidationRef:
    """The run's LDS over `spec.subsets` retrainings; `client_factory()` is a context manager yielding a Dask client or None."""
    check_validate(stage.spec, stage.model_spec)
    job = ValidationJob(stage.spec, stage.model_spec, stage.training, stage.data, stage.store.options, stage.call.location.url, stage.models_url, stage.compute.torch_threads, stage.compute.torch_device)
    return stage.call.run(lambda loc: _validate(job, stage.model, stage.scores, stage.store, client_factory, on_progress, loc))
