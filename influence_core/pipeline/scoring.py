"""Stage 5: scores (n_test, n_train) in one pass over the training data, one shard per task, resumable.

The array is created first; each task reads its own rows of the training set from the store, captures their
gradients once, contracts them with all query factors (and the self-influence plan), writes its shard and
self-influences, then leaves a marker. A rerun submits only the chunks without a marker. The fingerprint
attribute, which makes the output count as complete, is written after the last chunk.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zarr
from distributed import Client, as_completed

from . import candidate_scoring as candidate_stage, storage
from ..errors import ConfigError
from .layout import DIMENSIONS, ScoreLayout, score_layout
from ..methods import InfluenceFunctionModel
from ..methods.scorer import Scorer
from .models import load_state
from .refs import DataRef, ModelRef, ScoresRef, StageRef
from ..self_influence import SelfInfluencePlan, describe, plan_from_state, plan_state
from .specs import AggregateSpec, CandidatesSpec, ComputeSpec, MethodSpec
from .threads import TASK_THREADS, torch_threads
from ..work import Work
from .loading import load_influence_model, open_data, read_factors, save_tensors
from .stage import StageCall, StageLocation
from .run_store import RunStore

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ScoreJob:
    """Everything a task needs, by reference only: a few hundred bytes, never training data."""

    key: str
    method: MethodSpec
    model: ModelRef
    data: DataRef
    preconditioner: StageRef
    factors: StageRef
    layout: ScoreLayout
    influence_url: str
    markers_url: str
    plan_url: str  # the self-influence plan, computed once by the driver
    options: dict[str, Any]


class _Scorer:
    """What a worker keeps between tasks: the fitted influence model, the scorer of the query factors, open arrays."""

    def __init__(self, job: ScoreJob) -> None:
        self.im: InfluenceFunctionModel = load_influence_model(job.method, job.model, job.data, job.preconditioner, job.options)
        arrays = open_data(job.data, job.options)
        self.x, self.y = arrays["x_train"], arrays["y_train"]
        plan = plan_from_state(load_state(job.plan_url, job.options, field="self_influence_plan"))
        self.scorer = Scorer(self.im, read_factors(self.im, job.factors.url, job.options, self.x, self.y), plan)
        group = storage.open_group(job.influence_url, job.options, mode="a")
        self.scores = group["scores"]
        self.self_influence = group["self_influence"] if plan is not None else None


_SCORERS: OrderedDict[str, _Scorer] = OrderedDict()
_SCORERS_LOCK = threading.Lock()


def _scorer(job: ScoreJob) -> _Scorer:
    """Load once per worker process and job; later tasks of the same job reuse it. Keyed by the job and where it
    writes: two outputs of the same parameters share a key but never a scorer's open arrays."""
    where = f"{job.key}:{job.influence_url}"
    with _SCORERS_LOCK:
        if where not in _SCORERS:
            _SCORERS[where] = _Scorer(job)
            while len(_SCORERS) > 2:
                _SCORERS.popitem(last=False)
        return _SCORERS[where]


def score_chunk(job: ScoreJob, index: int) -> dict[str, float]:
    """Score training rows of chunk `index` against every query; write the shard, then the marker.

    Returns the work this did (gradients captured, flops, and any solves of an exact self-influence).
    """
    with torch_threads(TASK_THREADS):  # the same arithmetic on every cluster kind, sequential included
        scorer = _scorer(job)
        before = scorer.im.work.copy()
        _score_chunk(scorer, job, index)
        return (scorer.im.work - before).as_dict()


def _score_chunk(scorer: _Scorer, job: ScoreJob, index: int) -> None:
    lo, hi = job.layout.bounds(index)
    x = torch.from_numpy(np.asarray(scorer.x[lo:hi]))
    y = torch.from_numpy(np.asarray(scorer.y[lo:hi]))
    scores, self_inf = scorer.scorer(x, y)
    assert scores is not None
    scorer.scores[:, lo:hi] = scores.detach().cpu().numpy().astype(np.float32)
    if scorer.self_influence is not None:
        assert self_inf is not None
        scorer.self_influence[lo:hi] = self_inf.detach().cpu().numpy().astype(np.float32)
    storage.write_bytes(storage.join(job.markers_url, str(index)), b"", job.options)


def plan(
    compute: ComputeSpec, method: MethodSpec, aggregate: AggregateSpec, model: ModelRef, data: DataRef, preconditioner: StageRef, factors: StageRef, store: RunStore,
    candidates: CandidatesSpec | None = None,
) -> StageCall[ScoresRef]:
    config: dict[str, Any] = {
        "train_chunk_rows": compute.train_chunk_rows,
        "target_shard_mb": compute.target_shard_mb,
        "method": method.model_dump(mode="json"),
        "self_influence": {"mode": aggregate.self_influence, "rank": aggregate.self_influence_rank},
    }
    if candidates is not None and candidates.knn_k is not None:  # FastIF: candidate scores, no self-influence
        config.update(self_influence={"mode": "off"}, candidates=candidates.model_dump(mode="json"))
    # "curvature" names the preconditioner in stage keys and manifests already written: kept, so they still match
    inputs = {"model": model, "data": data, "curvature": preconditioner, "factors": factors}
    return StageCall("compute_influences", ScoresRef, config, inputs, store, compute.torch_threads, output_bytes=output_bytes(data, aggregate))


def output_bytes(data: DataRef, aggregate: AggregateSpec) -> int:
    """The float32 scores and self-influences, as stored uncompressed: what compute_influences needs on disk."""
    return 4 * data.n_test * data.n_train + (0 if aggregate.self_influence == "off" else 4 * data.n_train)


def space_warning(store: RunStore, data: DataRef, aggregate: AggregateSpec) -> str | None:
    """A warning when the output's disk has less free space than the scores need (None on S3 or when it fits)."""
    needed, free = output_bytes(data, aggregate), storage.free_bytes(store.output_url)
    if free is None or free >= needed:
        return None
    return f"output_url: {store.output_url} has {storage.megabytes(free)} free, but compute_influences writes {storage.megabytes(needed)} of scores: the run will fail when the disk fills. Fix: free space there or choose another output_url"


def _self_influence_plan(job: ScoreJob, aggregate: AggregateSpec, work: Work) -> SelfInfluencePlan:
    """The plan of this job: read back when an interrupted run already stored it, else computed here (a low-rank
    sketch costs curvature products, added to `work`) and stored for the workers."""
    try:
        return plan_from_state(load_state(job.plan_url, job.options, field="self_influence_plan"))
    except ConfigError:  # not stored yet, or cut short by a crash
        pass
    im = load_influence_model(job.method, job.model, job.data, job.preconditioner, job.options)
    made = im.self_influence_plan(aggregate.self_influence, aggregate.self_influence_rank, n_queries=job.layout.n_test)
    work += im.work
    save_tensors(job.plan_url, plan_state(made), job.options)
    return made


def _prepare_arrays(job: ScoreJob, with_self_influence: bool) -> zarr.Group:
    """Create the output arrays, or keep them when they belong to this job (a resumed run)."""
    group = storage.open_group(job.influence_url, job.options, mode="a")
    group.attrs["status"] = "running"
    existing = group.get("scores")
    if existing is not None and existing.attrs.get("job") == job.key and ("self_influence" in group) == with_self_influence:
        return group
    storage.remove(job.markers_url, job.options)
    layout = job.layout
    group.create_array("scores", shape=(layout.n_test, layout.n_train), chunks=layout.chunk, shards=layout.shard, dtype="float32", fill_value=np.nan, overwrite=True, attributes={"job": job.key}, dimension_names=DIMENSIONS["scores"])
    if with_self_influence:
        group.create_array("self_influence", shape=(layout.n_train,), chunks=(layout.train_rows,), dtype="float32", fill_value=np.nan, overwrite=True, attributes={"job": job.key}, dimension_names=DIMENSIONS["self_influence"])
    elif "self_influence" in group:
        del group["self_influence"]  # a self-influence of another configuration must not survive beside these scores
    return group


def _stored_chunks(job: ScoreJob, name: str) -> set[int]:
    """Train chunks whose every object of array `name` is in the store (one listing; tasks tile its last axis)."""
    url = storage.join(job.influence_url, name)
    present = storage.file_sizes(url, job.options)
    meta = storage.open_array(url, job.options).metadata
    grid = [math.ceil(size / chunk) for size, chunk in zip(meta.shape, meta.chunk_grid.chunk_shape)]
    leading = list(itertools.product(*map(range, grid[:-1])))
    return {i for i in range(grid[-1]) if all(meta.encode_chunk_key((*lead, i)) in present for lead in leading)}


def pending_chunks(job: ScoreJob) -> list[int]:
    """Chunks without a completion marker, or whose written shard is gone: a marker alone never counts."""
    done = {int(name) for name in storage.list_names(job.markers_url, job.options) if name.isdigit()}
    group = storage.open_group(job.influence_url, job.options, mode="r")
    for name in ("scores", "self_influence"):
        if name in group:
            done &= _stored_chunks(job, name)
    return [i for i in range(job.layout.n_tasks) if i not in done]


def execute(job: ScoreJob, chunks: list[int], client: Client | None, on_progress: Progress | None = None) -> Work:
    """Run the chunk tasks, on the cluster or here; report (done, total) as they finish; return the work done."""
    total, done, work = job.layout.n_tasks, job.layout.n_tasks - len(chunks), Work()
    if client is None:
        results: Iterator[dict[str, float]] = (score_chunk(job, index) for index in chunks)
    else:
        futures = client.map(score_chunk, [job] * len(chunks), chunks, pure=False, retries=2)
        results = (future.result() for future in as_completed(futures))
    for counted in results:
        work += Work(**counted)
        done += 1
        if on_progress:
            on_progress(done, total)
    return work


def _compute(job: ScoreJob, aggregate: AggregateSpec, client_factory: Callable[[], Any], on_progress: Progress | None, loc: StageLocation) -> dict[str, Any]:
    work = Work()
    self_plan = _self_influence_plan(job, aggregate, work)
    group = _prepare_arrays(job, self_plan is not None)
    chunks = pending_chunks(job)
    if chunks:
        with client_factory() as client:
            work += execute(job, chunks, client, on_progress)
    if self_plan is not None:
        group["self_influence"].attrs["fingerprint"] = job.key
    group["scores"].attrs["fingerprint"] = job.key
    return {
        "url": storage.join(job.influence_url, "scores"),
        "fingerprint": job.key,
        "shape": (job.layout.n_test, job.layout.n_train),
        "dtype": "float32",
        "n_chunks": job.layout.n_tasks,
        "chunks_computed": len(chunks),
        "gradient_rows": work.gradient_rows,
        "work": work.as_dict(),
        "self_influence": {"mode": aggregate.self_influence, **describe(self_plan)},
    }


def run(
    compute: ComputeSpec,
    method: MethodSpec,
    aggregate: AggregateSpec,
    model: ModelRef,
    data: DataRef,
    preconditioner: StageRef,
    factors: StageRef,
    store: RunStore,
    client_factory: Callable[[], Any],
    on_progress: Progress | None = None,
    candidates: CandidatesSpec | None = None,
) -> ScoresRef:
    """Compute (or finish computing) the scores, or with `candidates.knn_k` only each query's candidates;
    `client_factory()` is a context manager yielding a Dask client or None."""
    call = plan(compute, method, aggregate, model, data, preconditioner, factors, store, candidates)
    if candidates is not None and candidates.knn_k is not None:
        return candidate_stage.run(call, candidates, compute, method, model, data, preconditioner, factors, store, client_factory, on_progress)
    job = make_job(call, compute, data, method, model, preconditioner, factors, store)
    return call.run(lambda loc: _compute(job, aggregate, client_factory, on_progress, loc))


def make_job(call: StageCall[ScoresRef], compute: ComputeSpec, data: DataRef, method: MethodSpec, model: ModelRef, preconditioner: StageRef, factors: StageRef, store: RunStore) -> ScoreJob:
    """The per-task payload: refs, the layout and where to write; never data."""
    layout = score_layout(data.n_test, data.n_train, compute.target_shard_mb, compute.train_chunk_rows)
    location = call.location
    return ScoreJob(call.key, method, model, data, preconditioner, factors, layout, store.influence_url, location.path("done"), location.path("self_influence_plan.pt"), store.options)
