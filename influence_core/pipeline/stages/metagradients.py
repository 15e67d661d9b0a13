"""Stage 5 for method magic: MAGIC's scores (n_test, n_train), one block of queries per Dask task, resumable.

Each task rebuilds the model's initial weights as fit_model did (models.initial_model: the seed, training.init, the
LoRA adapters; with adapters, the metagradients run through theirs alone, the frozen base a constant), replays fit_model's training
(influence_core.magic) under the stage's torch threads, checks that the replay reaches the stored model, and writes
its rows of the scores, then a marker (chunks.py). The scores array has one chunk row per block, so tasks never
share an object; a rerun submits only the blocks not done. Self-influence is not computed (see check_magic).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zarr

from ..store import storage
from ... import examples
from ...errors import ConfigError, NumericalError
from ...magic import metagradients
from ...work import Work
from ..score.chunks import ChunkJob, Progress, execute
from ..score.finite import check_finite
from ..score.layout import DIMENSIONS, INNER_CHUNK_BYTES
from ..store.loading import load_model, open_data
from ..model.models import initial_model
from ..store.refs import DataRef, ModelRef, ScoresRef
from ..store.run_store import RunStore
from ..specs import AggregateSpec, CandidatesSpec, ComputeSpec, MagicMethod, ModelSpec, TrainingSpec
from ..store.stage import StageCall, StageInput, StageLocation
from ..runtime.threads import torch_threads

NO_SELF_INFLUENCE = "magic attributes query measurements to training examples through the training run; a training example's own loss is not among the queries"


def check_magic(model: ModelSpec, training: TrainingSpec, aggregate: AggregateSpec, candidates: CandidatesSpec) -> None:
    """Method magic replays fit_model's training: refused for a loaded checkpoint, an ensemble, the FastIF prefilter and
    an asked-for self-influence, each with its reason."""
    if model.checkpoint:
        raise ConfigError(
            "model.checkpoint", f"method magic differentiates through the pipeline's own training, but {model.checkpoint} is loaded, so its training cannot be replayed",
            "leave model.checkpoint empty so that fit_model trains the model (training.*), or choose another method",
        )
    if training.ensemble > 1:
        raise ConfigError("training.ensemble", f"method magic attributes one replayed training, but ensemble={training.ensemble} trains {training.ensemble} models", "set training.ensemble to 1 with method magic")
    if candidates.knn_k is not None:
        raise ConfigError("candidates.knn_k", "method magic scores every training example in each reverse pass, so the FastIF prefilter saves nothing", "set candidates.knn_k to null with method magic")
    if aggregate.self_influence in ("exact", "lowrank"):
        raise ConfigError("aggregate.self_influence", f"method magic computes no self-influence ({NO_SELF_INFLUENCE})", "set aggregate.self_influence to auto or off with method magic")
    if training.lora is not None and training.lora.dropout > 0:
        raise ConfigError(
            "training.lora.dropout", f"method magic replays fit_model's training, but adapter dropout ({training.lora.dropout}) draws random masks that a replay cannot retrace",
            "set training.lora.dropout to 0 with method magic",
        )


def first_step_warning(training: TrainingSpec, n_train: int) -> str | None:
    """One line when the replayed training's first step is a full Adam step: with both moments at 0 it moves every
    weight by ±learning_rate, the sign of its batch gradient however small, so the trained model (and MAGIC's
    derivative) is a step function of the loss weights wherever that gradient is near 0."""
    recipe = training.recipe()
    total = recipe.steps(n_train)
    if total == 0 or recipe.step_size(0, total) == 0:
        return None
    return (
        f"method magic: the first of the {total} training steps is a full Adam step (training.warmup={training.warmup} warms up {recipe.warmup_steps(total)} steps), "
        "which moves every weight by ±learning_rate whatever its gradient's size, so the scores can describe that kink rather than the training "
        "(see the summary's largest score over the median); set training.warmup (e.g. 0.05) to start from a step of 0"
    )


@dataclass(frozen=True)
class MagicInput(StageInput[ScoresRef]):
    """The compute spec, the method, the recipe (model and training specs), the data and the trained model (the
    replay's target; its fingerprint keys the stage on the training run)."""

    compute: ComputeSpec
    method: MagicMethod
    model_spec: ModelSpec
    training: TrainingSpec
    data: DataRef
    model: ModelRef
    store: RunStore

    @property
    def rows(self) -> int:
        """Queries per block."""
        return min(self.method.query_block, self.data.n_test)

    @property
    def n_blocks(self) -> int:
        return math.ceil(self.data.n_test / self.rows)

    def bounds(self, index: int) -> tuple[int, int]:
        return index * self.rows, min((index + 1) * self.rows, self.data.n_test)

    def plan(self) -> StageCall[ScoresRef]:
        config = {"method": self.method.model_dump(mode="json"), "training": self.training.recipe_config(), "threads": self.compute.torch_threads}
        output = 4 * self.data.n_test * self.data.n_train
        return StageCall("compute_influences", ScoresRef, config, {"data": self.data, "model": self.model}, self.store, self.compute.torch_threads, output_bytes=output)


class MagicWorker:
    """What a worker process keeps between a job's block tasks: the training and query arrays, the stored model's
    weights (the replay's target), the open scores array and the work done."""

    def __init__(self, job: MagicJob) -> None:
        stage = job.stage
        arrays = open_data(stage.data, job.options)
        self.x, self.y = examples.read(arrays["x_train"]), examples.read(arrays["y_train"])
        self.x_test, self.y_test = arrays["x_test"], arrays["y_test"]
        self.trained = dict(load_model(stage.model, job.options, stage.compute.torch_device).named_parameters())
        self.scores = storage.open_group(job.influence_url, job.options, mode="a")["scores"]
        self._work = Work()

    def work(self) -> Work:
        return self._work.copy()


@dataclass(frozen=True)
class MagicJob(ChunkJob):
    """Block tasks of MAGIC's scores: task `index` is the queries of block `index` against every training example."""

    stage: MagicInput  # type: ignore[assignment]  # what ChunkJob reads of it (call, store) it has too

    def open(self) -> MagicWorker:
        return MagicWorker(self)

    def objects(self, index: int) -> list[str]:
        """The scores' chunks of query block `index` (its row of chunks)."""
        scores = storage.open_array(storage.join(self.influence_url, "scores"), self.options)
        return [f"scores/{key}" for key in storage.chunk_keys(scores, 0, index)]

    @property
    def task_threads(self) -> int:
        return self.stage.compute.torch_threads

    def score(self, worker: MagicWorker, index: int) -> None:  # type: ignore[override]
        stage = self.stage
        lo, hi = stage.bounds(index)
        with torch_threads(stage.compute.torch_threads), torch.random.fork_rng():  # fit_model's threads: the replay retraces its arithmetic
            model = initial_model(stage.model_spec, stage.training, stage.data, self.options, stage.compute.torch_device)  # as fit_model started
            xq, yq = examples.read(worker.x_test, slice(lo, hi)), examples.read(worker.y_test, slice(lo, hi))
            result = metagradients(model, stage.model_spec.make_task(), stage.training.recipe(), worker.x, worker.y, xq, yq, stage.method.checkpoint_every)
        _check_retraced(result.final, worker.trained)
        scores = result.scores.detach().cpu().numpy().astype(np.float32)
        steps = stage.training.recipe().steps(stage.data.n_train)
        wider = ", or set model.dtype: float64" if stage.model_spec.dtype == "float32" else ""
        check_finite(
            "compute_influences", scores, f"scores of query block {index}",
            f"method magic's metagradients overflowed in the reverse pass through {steps:,} training steps (they can grow with every step)",
            f"train for fewer training.epochs or with a smaller training.learning_rate{wider}, then run again", "queries", lo,
        )
        worker.scores[lo:hi, :] = scores
        worker._work.replayed_steps += result.work.replayed_steps


def _check_retraced(final: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> None:
    """The replay must reach the weights fit_model stored, or its scores attribute some other training."""
    for name, value in final.items():
        if not torch.allclose(value, trained[name].to(value.dtype), rtol=1e-4, atol=1e-6):
            gap = float((value - trained[name]).abs().max())
            raise NumericalError(f"the replayed training of method magic ends {gap:.3g} away from the stored model in {name}: the training is not reproducible here (a nondeterministic model or device)")


def _prepare_scores(job: MagicJob) -> zarr.Group:
    """Create the scores array with one chunk row per block, or keep it when it belongs to this job (a resumed run)."""
    group = storage.open_group(job.influence_url, job.options, mode="a")
    group.attrs["status"] = "running"
    existing = group.get("scores")
    if existing is None or existing.attrs.get("job") != job.key:
        storage.remove(job.path("done"), job.options)
        stage = job.stage
        columns = min(stage.data.n_train, max(1, INNER_CHUNK_BYTES // (4 * stage.rows)))
        shape = (stage.data.n_test, stage.data.n_train)
        storage.create_array(group, "scores", shape=shape, chunks=(stage.rows, columns), dtype="float32", fill_value=np.nan, overwrite=True, attributes={"job": job.key}, dimension_names=DIMENSIONS["scores"])
    if "self_influence" in group:
        del group["self_influence"]  # another configuration's: never beside these scores
    return group


def _compute(job: MagicJob, client_factory: Callable[[], Any], on_progress: Progress | None, loc: StageLocation) -> dict[str, Any]:
    group = _prepare_scores(job)
    stage = job.stage
    pending = job.pending(list(range(stage.n_blocks)))
    work = Work()
    if pending:
        with client_factory() as client:
            work += execute(job, pending, stage.n_blocks, client, on_progress)
    group["scores"].attrs["fingerprint"] = job.key
    return {
        "url": storage.join(job.influence_url, "scores"), "fingerprint": job.key, "shape": (stage.data.n_test, stage.data.n_train), "dtype": "float32",
        "n_chunks": stage.n_blocks, "chunks_computed": len(pending), "gradient_rows": 0, "work": work.as_dict(),
        "self_influence": {"mode": "off", "reason": NO_SELF_INFLUENCE},
        "parameters": _parameters(load_model(stage.model, stage.store.options)),
        "spread": score_spread(group["scores"]),
    }


def score_spread(scores: zarr.Array) -> float | None:
    """The largest |score| over the median |score|: thousands where Adam's first full step made the trained model a
    step function of the loss weights (docs/methods.md); None where the median is 0."""
    magnitudes = np.abs(np.asarray(scores[...]))  # float32, as stored: the median needs every score at once
    median = float(np.median(magnitudes))
    return float(magnitudes.max()) / median if median > 0 and np.isfinite(median) else None


def _parameters(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Which parameters the scores are over, as fit_preconditioner records them: every trained one (frozen ones are not trained)."""
    named = dict(model.named_parameters())
    groups = {"included": [n for n, p in named.items() if p.requires_grad], "excluded": [], "frozen": [n for n, p in named.items() if not p.requires_grad]}
    return {kind: {"tensors": len(names), "elements": sum(named[n].numel() for n in names), "names": names} for kind, names in groups.items()}


def run(stage: MagicInput, client_factory: Callable[[], Any], on_progress: Progress | None = None) -> ScoresRef:
    """Compute (or finish computing) MAGIC's scores; `client_factory()` is a context manager yielding a Dask client or None."""
    return stage.call.run(lambda loc: _compute(MagicJob(stage), client_factory, on_progress, loc))
