"""Stage 5: scores (n_test, n_train) in one pass over the training data, one shard per task, resumable.

The array is created first; each task reads its own rows of the training set from the store, evaluates their
gradients once, multiplies them with all query factors, writes its shard and self-influences, then leaves a
marker. A rerun submits only the chunks without a marker. The fingerprint attribute, which makes the output
count as complete, is written after the last chunk.
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

from .. import storage
from ..layout import ScoreLayout, score_layout
from ..methods import InfluenceFunctionModel
from ..refs import DataRef, ModelRef, ScoresRef, StageRef
from ..specs import ComputeSpec, MethodSpec
from ..threads import TASK_THREADS, torch_threads
from .loading import load_influence_model, open_data
from .stage import StageCall, StageLocation
from .store import RunStore

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ScoreJob:
    """Everything a task needs, by reference only: a few hundred bytes, never training data."""

    key: str
    method: MethodSpec
    model: ModelRef
    data: DataRef
    curvature: StageRef
    factors: StageRef
    layout: ScoreLayout
    influence_url: str
    markers_url: str
    options: dict[str, Any]


class _Scorer:
    """What a worker keeps between tasks: the fitted influence model, the query factors, open arrays."""

    def __init__(self, job: ScoreJob) -> None:
        self.im: InfluenceFunctionModel = load_influence_model(job.method, job.model, job.data, job.curvature, job.options)
        factors = np.asarray(storage.open_array(job.factors.url, job.options)[:])
        self.factors = torch.from_numpy(factors).to(self.im.objective.space.device)
        arrays = open_data(job.data, job.options)
        self.x, self.y = arrays["x_train"], arrays["y_train"]
        group = storage.open_group(job.influence_url, job.options, mode="a")
        self.scores, self.self_influence = group["scores"], group["self_influence"]


_SCORERS: OrderedDict[str, _Scorer] = OrderedDict()
_SCORERS_LOCK = threading.Lock()


def _scorer(job: ScoreJob) -> _Scorer:
    """Load once per worker process and job; later tasks of the same job reuse it."""
    with _SCORERS_LOCK:
        if job.key not in _SCORERS:
            _SCORERS[job.key] = _Scorer(job)
            while len(_SCORERS) > 2:
                _SCORERS.popitem(last=False)
        return _SCORERS[job.key]


def score_chunk(job: ScoreJob, index: int) -> int:
    """Score training rows of chunk `index` against every query; write the shard, then the marker.

    Returns the number of per-sample gradients this evaluated.
    """
    with torch_threads(TASK_THREADS):  # the same arithmetic on every cluster kind, sequential included
        scorer = _scorer(job)
        before = scorer.im.objective.gradient_rows
        _score_chunk(scorer, job, index)
        return scorer.im.objective.gradient_rows - before


def _score_chunk(scorer: _Scorer, job: ScoreJob, index: int) -> None:
    lo, hi = job.layout.bounds(index)
    x = torch.from_numpy(np.asarray(scorer.x[lo:hi]))
    y = torch.from_numpy(np.asarray(scorer.y[lo:hi]))
    block = np.empty((job.layout.n_test, hi - lo), dtype=np.float32)
    self_block = np.empty(hi - lo, dtype=np.float32)
    step = scorer.im.batch_size
    for start in range(0, hi - lo, step):
        part = slice(start, start + step)
        scores, self_inf = scorer.im.scores_and_self_influences(scorer.factors, x[part], y[part])
        assert scores is not None
        block[:, part] = scores.detach().cpu().numpy()
        self_block[part] = self_inf.detach().cpu().numpy()
    scorer.scores[:, lo:hi] = block
    scorer.self_influence[lo:hi] = self_block
    storage.write_bytes(storage.join(job.markers_url, str(index)), b"", job.options)


def plan(compute: ComputeSpec, method: MethodSpec, model: ModelRef, data: DataRef, curvature: StageRef, factors: StageRef, store: RunStore) -> StageCall[ScoresRef]:
    config = {
        "output_url": store.output_url,
        "train_chunk_rows": compute.train_chunk_rows,
        "target_shard_mb": compute.target_shard_mb,
        "method": method.model_dump(mode="json"),
    }
    inputs = {"model": model, "data": data, "curvature": curvature, "factors": factors}
    return StageCall("compute_influences", ScoresRef, config, inputs, store)


def _prepare_arrays(job: ScoreJob) -> zarr.Group:
    """Create the output arrays, or keep them when they belong to this job (a resumed run)."""
    group = storage.open_group(job.influence_url, job.options, mode="a")
    group.attrs["status"] = "running"
    existing = group.get("scores")
    if existing is not None and existing.attrs.get("job") == job.key and "self_influence" in group:
        return group
    storage.remove(job.markers_url, job.options)
    layout = job.layout
    group.create_array("scores", shape=(layout.n_test, layout.n_train), chunks=layout.chunk, shards=layout.shard, dtype="float32", fill_value=np.nan, overwrite=True, attributes={"job": job.key})
    group.create_array("self_influence", shape=(layout.n_train,), chunks=(layout.train_rows,), dtype="float32", fill_value=np.nan, overwrite=True, attributes={"job": job.key})
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


def execute(job: ScoreJob, chunks: list[int], client: Client | None, on_progress: Progress | None = None) -> int:
    """Run the chunk tasks, on the cluster or here; report (done, total) as they finish; return gradients evaluated."""
    total, done, gradients = job.layout.n_tasks, job.layout.n_tasks - len(chunks), 0
    if client is None:
        results: Iterator[int] = (score_chunk(job, index) for index in chunks)
    else:
        futures = client.map(score_chunk, [job] * len(chunks), chunks, pure=False, retries=2)
        results = (future.result() for future in as_completed(futures))
    for evaluated in results:
        gradients += evaluated
        done += 1
        if on_progress:
            on_progress(done, total)
    return gradients


def _compute(job: ScoreJob, client_factory: Callable[[], Any], on_progress: Progress | None, loc: StageLocation) -> dict[str, Any]:
    group = _prepare_arrays(job)
    chunks = pending_chunks(job)
    gradients = 0
    if chunks:
        with client_factory() as client:
            gradients = execute(job, chunks, client, on_progress)
    group["self_influence"].attrs["fingerprint"] = job.key
    group["scores"].attrs["fingerprint"] = job.key
    return {
        "url": storage.join(job.influence_url, "scores"),
        "fingerprint": job.key,
        "shape": (job.layout.n_test, job.layout.n_train),
        "dtype": "float32",
        "n_chunks": job.layout.n_tasks,
        "chunks_computed": len(chunks),
        "gradient_rows": gradients,
    }


def run(
    compute: ComputeSpec,
    method: MethodSpec,
    model: ModelRef,
    data: DataRef,
    curvature: StageRef,
    factors: StageRef,
    store: RunStore,
    client_factory: Callable[[], Any],
    on_progress: Progress | None = None,
) -> ScoresRef:
    """Compute (or finish computing) the scores; `client_factory()` is a context manager yielding a Dask client or None."""
    call = plan(compute, method, model, data, curvature, factors, store)
    job = make_job(call, compute, method, model, data, curvature, factors, store)
    return call.run(lambda loc: _compute(job, client_factory, on_progress, loc))


def make_job(call: StageCall[ScoresRef], compute: ComputeSpec, method: MethodSpec, model: ModelRef, data: DataRef, curvature: StageRef, factors: StageRef, store: RunStore) -> ScoreJob:
    """The per-task payload: refs, the layout and where to write; never data."""
    layout = score_layout(data.n_test, data.n_train, compute.target_shard_mb, compute.train_chunk_rows)
    return ScoreJob(call.key, method, model, data, curvature, factors, layout, store.influence_url, call.location.path("done"), store.options)
