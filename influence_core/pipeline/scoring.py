"""Stage 5: scores (n_test, n_train) in one pass over the training data, one shard per task, resumable.

The array is created first; each task reads its own rows of the training set from the store, captures their
gradients once, contracts them with all query factors (and the self-influence plan), writes its shard and
self-influences, then leaves a marker (`chunks.py`). A rerun submits only the chunks not done. The fingerprint
attribute, which makes the output count as complete, is written after the last chunk.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from . import candidate_scoring, storage
from .. import examples
from ..errors import ConfigError
from .chunks import ChunkJob, ChunkWorker, Progress, execute
from .layout import DIMENSIONS
from .models import load_state
from .refs import DataRef, ScoresRef
from ..self_influence import SelfInfluencePlan, describe, plan_from_state, plan_state
from .score_input import ScoringInput, output_bytes
from .specs import AggregateSpec
from ..work import Work
from .loading import load_influence_model, save_tensors
from .stage import StageLocation
from .run_store import RunStore


@dataclass(frozen=True)
class ScoreJob(ChunkJob):
    """A chunk job that writes a shard of the full scores (and its self-influences)."""

    def plan_url(self, member: int) -> str:
        """Member `member`'s self-influence plan, computed once by the driver (member 0's under the single model's name)."""
        return self.path(f"self_influence_plan_{member}.pt" if member else "self_influence_plan.pt")

    def self_influence_plan(self, member: int) -> SelfInfluencePlan | None:
        return plan_from_state(load_state(self.plan_url(member), self.options, field="self_influence_plan", device=self.stage.compute.torch_device))

    def hold(self, plan: SelfInfluencePlan | None) -> tuple[zarr.Array, zarr.Array | None]:
        """The open scores array, and the self-influence one when the plan computes them."""
        group = storage.open_group(self.influence_url, self.options, mode="a")
        return group["scores"], group["self_influence"] if plan is not None else None

    def score(self, worker: ChunkWorker, index: int) -> None:
        lo, hi = self.stage.layout.bounds(index)
        x, y = examples.read(worker.x, slice(lo, hi)), examples.read(worker.y, slice(lo, hi))
        scores, self_inf = worker(x, y)
        assert scores is not None
        scores_out, self_out = worker.held
        scores_out[:, lo:hi] = scores.detach().cpu().numpy().astype(np.float32)
        if self_out is not None:
            assert self_inf is not None
            self_out[lo:hi] = self_inf.detach().cpu().numpy().astype(np.float32)

    def written(self) -> set[int]:
        """Chunks whose every object is in the store, in the scores and any self-influences."""
        done = set(range(self.stage.layout.n_tasks))
        group = storage.open_group(self.influence_url, self.options, mode="r")
        for name in ("scores", "self_influence"):
            if name in group:
                done &= self._stored_chunks(name)
        return done

    def _stored_chunks(self, name: str) -> set[int]:
        """Train chunks whose every object of array `name` is in the store (one listing; tasks tile its last axis)."""
        url = storage.join(self.influence_url, name)
        present = storage.file_sizes(url, self.options)
        meta = storage.open_array(url, self.options).metadata
        grid = [math.ceil(size / chunk) for size, chunk in zip(meta.shape, meta.chunk_grid.chunk_shape)]
        leading = list(itertools.product(*map(range, grid[:-1])))
        return {i for i in range(grid[-1]) if all(meta.encode_chunk_key((*lead, i)) in present for lead in leading)}


def space_warning(store: RunStore, data: DataRef, aggregate: AggregateSpec) -> str | None:
    """A warning when the output's disk has less free space than the scores need (None on S3 or when it fits)."""
    needed, free = output_bytes(data, aggregate), storage.free_bytes(store.output_url)
    if free is None or free >= needed:
        return None
    return f"output_url: {store.output_url} has {storage.megabytes(free)} free, but compute_influences writes {storage.megabytes(needed)} of scores: the run will fail when the disk fills. Fix: free space there or choose another output_url"


def _self_influence_plan(job: ScoreJob, member: int, work: Work) -> SelfInfluencePlan:
    """Member `member`'s plan: read back when an interrupted run already stored it, else computed here (a low-rank
    sketch costs curvature products, added to `work`) and stored for the workers."""
    try:
        return job.self_influence_plan(member)
    except ConfigError:  # not stored yet, or cut short by a crash
        pass
    stage, refs = job.stage, job.stage.members[member]
    im = load_influence_model(stage.method, refs.model, stage.data, refs.preconditioner, job.options, stage.compute.torch_device)
    made = im.self_influence_plan(stage.aggregate.self_influence, stage.aggregate.self_influence_rank, n_queries=stage.layout.n_test)
    work += im.work
    save_tensors(job.plan_url(member), plan_state(made), job.options)
    return made


def _prepare_arrays(job: ScoreJob, with_self_influence: bool) -> zarr.Group:
    """Create the output arrays, or keep them when they belong to this job (a resumed run)."""
    group = storage.open_group(job.influence_url, job.options, mode="a")
    group.attrs["status"] = "running"
    existing = group.get("scores")
    if existing is not None and existing.attrs.get("job") == job.key and ("self_influence" in group) == with_self_influence:
        return group
    storage.remove(job.path("done"), job.options)
    layout = job.stage.layout
    group.create_array("scores", shape=(layout.n_test, layout.n_train), chunks=layout.chunk, shards=layout.shard, dtype="float32", fill_value=np.nan, overwrite=True, attributes={"job": job.key}, dimension_names=DIMENSIONS["scores"])
    if with_self_influence:
        group.create_array("self_influence", shape=(layout.n_train,), chunks=(layout.train_rows,), dtype="float32", fill_value=np.nan, overwrite=True, attributes={"job": job.key}, dimension_names=DIMENSIONS["self_influence"])
    elif "self_influence" in group:
        del group["self_influence"]  # a self-influence of another configuration must not survive beside these scores
    return group


def _compute(job: ScoreJob, client_factory: Callable[[], Any], on_progress: Progress | None, loc: StageLocation) -> dict[str, Any]:
    work = Work()
    plans = [_self_influence_plan(job, member, work) for member in range(len(job.stage.members))]  # each stored for the workers
    self_plan = plans[0]  # the members share method and settings, so their plans share a form: the summary describes member 0's
    group = _prepare_arrays(job, self_plan is not None)
    layout = job.stage.layout
    chunks = job.pending(list(range(layout.n_tasks)))
    if chunks:
        with client_factory() as client:
            work += execute(job, chunks, layout.n_tasks, client, on_progress)
    if self_plan is not None:
        group["self_influence"].attrs["fingerprint"] = job.key
    group["scores"].attrs["fingerprint"] = job.key
    return {
        "url": storage.join(job.influence_url, "scores"),
        "fingerprint": job.key,
        "shape": (layout.n_test, layout.n_train),
        "dtype": "float32",
        "n_chunks": layout.n_tasks,
        "chunks_computed": len(chunks),
        "gradient_rows": work.gradient_rows,
        "work": work.as_dict(),
        "self_influence": {"mode": job.stage.aggregate.self_influence, **describe(self_plan)},
    }


def run(stage: ScoringInput, client_factory: Callable[[], Any], on_progress: Progress | None = None) -> ScoresRef:
    """Compute (or finish computing) the scores, or with `candidates.knn_k` only each query's candidates;
    `client_factory()` is a context manager yielding a Dask client or None."""
    if stage.prefiltered:
        return candidate_scoring.run(stage, client_factory, on_progress)
    job = ScoreJob(stage)
    return stage.call.run(lambda loc: _compute(job, client_factory, on_progress, loc))
