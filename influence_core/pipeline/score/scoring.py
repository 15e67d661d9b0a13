"""Stage 5: scores (n_test, n_train) in one pass over the training data, one shard per task, resumable.

The array is created first; each task reads its own rows of the training set from the store, captures their
gradients once, contracts them with all query factors (and the self-influence plan), writes its shard and
self-influences, then leaves a marker (`chunks.py`). With a training index (`index.py`) a task instead reads its
rows of the index and multiplies them with the query factors (one GEMM, no training gradient), and self-influences
are the index's own. A rerun submits only the chunks not done. The fingerprint attribute, which makes the output
count as complete, is written after the last chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zarr

from . import candidate_scoring
from ..store import storage
from ... import examples
from ...errors import ConfigError
from .chunks import ChunkJob, ChunkWorker, Progress, execute
from .finite import stored_scores
from .layout import DIMENSIONS
from ..model.models import load_stored
from ..store.refs import DataRef, IndexRef, ScoresRef
from ...self_influence import SelfInfluencePlan, describe, plan_from_state, plan_state
from .score_input import Member, ScoringInput, output_bytes
from ..runtime.cluster import Placement, place
from ..specs import METHOD_CLASSES, AggregateSpec, ClusterKind
from ...work import Work, forward_flops
from ...methods import InfluenceFunctionModel
from ..store.loading import build_module, first_training_row, index_projection, intact_file, load_influence_model, save_tensors
from ..store.stage import StageLocation
from ..store.run_store import RunStore


def plan_url(job: ChunkJob, member: int) -> str:
    """Member `member`'s self-influence plan, computed once by the driver (member 0's under the single model's name)."""
    return job.path(f"self_influence_plan_{member}.pt" if member else "self_influence_plan.pt")


def stored_plan(job: ChunkJob, member: int) -> SelfInfluencePlan | None:
    """The plan the driver stored for member `member` (FileNotFoundError when absent, a ConfigError when damaged)."""
    return plan_from_state(load_stored(plan_url(job, member), job.options, field="compute_influences", device=job.stage.compute.torch_device))


def self_influence_plan(job: ChunkJob, member: int, make: Callable[[], InfluenceFunctionModel], aggregate: AggregateSpec, n_queries: int | None, work: Work) -> SelfInfluencePlan:
    """Member `member`'s plan: read back when an interrupted run already stored it, else made here from the fitted
    influence model `make()` returns (a low-rank sketch costs curvature products, added to `work`) and stored for
    the workers."""
    try:
        return stored_plan(job, member)
    except (FileNotFoundError, ConfigError):  # not stored yet, or cut short by a crash
        pass
    im = make()
    made = im.self_influence_plan(aggregate.self_influence, aggregate.self_influence_rank, n_queries=n_queries)
    work += im.work
    save_tensors(plan_url(job, member), plan_state(made), job.options)
    return made


@dataclass(frozen=True)
class ScoreJob(ChunkJob):
    """A chunk job that writes a shard of the full scores (and its self-influences)."""

    def self_influence_plan(self, member: int) -> SelfInfluencePlan | None:
        return stored_plan(self, member)

    def hold(self, plan: SelfInfluencePlan | None) -> tuple[zarr.Array, zarr.Array | None]:
        """The open scores array, and the self-influence one when the plan computes them."""
        return self.outputs(plan is not None)

    def outputs(self, with_self_influence: bool) -> tuple[zarr.Array, zarr.Array | None]:
        """The open scores array, and the self-influence one when it is written."""
        group = storage.open_group(self.influence_url, self.options, mode="a")
        return group["scores"], group["self_influence"] if with_self_influence else None

    def before_chunks(self, work: Work) -> tuple[bool, dict[str, Any]]:
        """In the driver, before the chunks: each member's self-influence plan, made (and stored for the workers)
        once; whether self-influences are written, and how, for the summary."""
        plans = [_self_influence_plan(self, member, work) for member in range(len(self.stage.members))]
        # the members share method and settings, so their plans share a form: the summary describes member 0's
        return plans[0] is not None, {"mode": self.stage.aggregate.self_influence, **describe(plans[0])}

    def score(self, worker: ChunkWorker, index: int) -> None:
        lo, hi = self.stage.layout.bounds(index)
        x, y = examples.read(worker.x, slice(lo, hi)), examples.read(worker.y, slice(lo, hi))
        scores, self_inf = worker(x, y)
        assert scores is not None
        scores_out, self_out = worker.held
        scores_out[:, lo:hi] = stored_scores(scores.detach().cpu().numpy(), f"scores of train chunk {index}", "queries")
        if self_out is not None:
            assert self_inf is not None
            self_out[lo:hi] = stored_scores(self_inf.detach().cpu().numpy(), f"self-influences of train chunk {index}")

    def objects(self, index: int) -> list[str]:
        """The shards of train chunk `index` in the scores (every query row's) and its self-influences' chunk."""
        group = storage.open_group(self.influence_url, self.options, mode="r")
        names = [name for name in ("scores", "self_influence") if name in group]
        return [f"{name}/{key}" for name in names for key in storage.chunk_keys(group[name], -1, index)]


@dataclass(frozen=True)
class IndexScoreJob(ScoreJob):
    """A score job whose tasks read the training index instead of evaluating training gradients."""

    def open(self) -> "IndexScoreWorker":
        return IndexScoreWorker(self)

    @property
    def with_self_influence(self) -> bool:
        """Self-influences are copied from the index when it has them (the index computed them unless they are off)."""
        return all("self_influence" in _group(m.index, self.options) for m in self.stage.members)

    def before_chunks(self, work: Work) -> tuple[bool, dict[str, Any]]:
        """In the driver: each compressed index's query factors projected once and stored for the workers. The
        self-influences were computed once with the index: copied, never recomputed (how, as the index recorded it)."""
        for member, refs in enumerate(self.stage.members):
            assert refs.index is not None
            if _projects_factors(refs) and not intact_file(self.factors_url(member), self.options):
                stage = self.stage
                im = load_influence_model(stage.method, refs.model, stage.data, refs.preconditioner, self.options, stage.compute.torch_device)
                flat = torch.from_numpy(np.asarray(storage.open_array(refs.factors.url, self.options)[:])).to(im.objective.space.device)
                save_tensors(self.factors_url(member), {"factors": index_projection(im, stage.data, self.options, refs.index.side or 0).factors(flat)}, self.options)
        index = self.stage.members[0].index
        assert index is not None
        return self.with_self_influence, {**index.self_influence, "from": "index_training"}

    def factors_url(self, member: int) -> str:
        """Member `member`'s query factors in its compressed index's coordinates."""
        return self.path(f"index_factors_{member}.pt")

    def score(self, worker: "IndexScoreWorker", index: int) -> None:  # type: ignore[override]
        lo, hi = self.stage.layout.bounds(index)
        scores, values = worker.rows(lo, hi)
        scores_out, self_out = worker.held
        scores_out[:, lo:hi] = stored_scores(scores.cpu().numpy(), f"scores of train chunk {index} (from the training index)", "queries")
        if self_out is not None:
            assert values is not None
            self_out[lo:hi] = stored_scores(values, f"self-influences of train chunk {index} (from the training index)")


def _projects_factors(member: Member) -> bool:
    """Whether scoring projects the member's query factors into its compressed index's coordinates (else they are
    stored in them, or the index is exact)."""
    assert member.index is not None
    return member.index.compression == "logra" and member.factors.coordinates != "index"


def _group(index: IndexRef | None, options: dict) -> zarr.Group:
    assert index is not None
    return storage.open_group(index.url, options, mode="r")


class IndexScoreWorker:
    """What a worker process keeps between a job's tasks: each member's query factors (flat, in the index's
    coordinates) and open index arrays, and the open output arrays."""

    def __init__(self, job: IndexScoreJob) -> None:
        self.options, self.device = job.options, job.stage.compute.torch_device
        self.members = [self._member(job, index, member) for index, member in enumerate(job.stage.members)]
        self.held = job.outputs(job.with_self_influence)
        self._work = Work()

    def _member(self, job: IndexScoreJob, index: int, member: Member) -> tuple[torch.Tensor, zarr.Array, zarr.Array | None]:
        group = _group(member.index, self.options)
        assert member.index is not None
        if _projects_factors(member):
            factors = load_stored(job.factors_url(index), self.options, field="compute_influences", device=self.device)["factors"]
        else:
            factors = torch.from_numpy(np.asarray(storage.open_array(member.factors.url, self.options)[:])).to(self.device)
        return factors, group["features"], group["self_influence"] if "self_influence" in group else None

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, np.ndarray | None]:
        """Scores (n_test, hi - lo) of training rows lo..hi and their self-influences: the members' means."""
        scores, values = None, None
        for factors, features, self_influence in self.members:
            block = np.asarray(features[lo:hi])
            self._work.index_rows += hi - lo
            self._work.index_bytes += block.nbytes
            self._work.score_flops += 2.0 * factors.shape[0] * block.shape[0] * block.shape[1]
            part = factors @ torch.from_numpy(block).to(device=self.device, dtype=factors.dtype).T  # a float16 index is widened first
            scores = part if scores is None else scores + part
            if self_influence is not None:
                more = np.asarray(self_influence[lo:hi], dtype=np.float64)
                values = more if values is None else values + more
        assert scores is not None
        n = len(self.members)
        return (scores / n if n > 1 else scores), (None if values is None else values / n)

    def work(self) -> Work:
        return self._work.copy()


def space_warning(store: RunStore, data: DataRef, aggregate: AggregateSpec) -> str | None:
    """A warning when the output's disk has less free space than the scores need (None on S3 or when it fits)."""
    needed, free = output_bytes(data, aggregate), storage.free_bytes(store.output_url)
    if free is None or free >= needed:
        return None
    return f"output_url: {store.output_url} has {storage.megabytes(free)} free, but compute_influences writes {storage.megabytes(needed)} of scores: the run will fail when the disk fills. Fix: free space there or choose another output_url"


def _self_influence_plan(job: ScoreJob, member: int, work: Work) -> SelfInfluencePlan:
    """Member `member`'s plan, from its fitted influence model (loaded only when the plan is not stored yet)."""
    stage, refs = job.stage, job.stage.members[member]
    make = lambda: load_influence_model(stage.method, refs.model, stage.data, refs.preconditioner, job.options, stage.compute.torch_device)  # noqa: E731
    return self_influence_plan(job, member, make, stage.aggregate, stage.layout.n_test, work)


def _prepare_arrays(job: ScoreJob, with_self_influence: bool) -> zarr.Group:
    """Create the output arrays, or keep them when they belong to this job (a resumed run)."""
    group = storage.open_group(job.influence_url, job.options, mode="a")
    group.attrs["status"] = "running"
    existing = group.get("scores")
    if existing is not None and existing.attrs.get("job") == job.key and ("self_influence" in group) == with_self_influence:
        return group
    storage.remove(job.path("done"), job.options)
    layout = job.stage.layout
    storage.create_array(group, "scores", shape=(layout.n_test, layout.n_train), chunks=layout.chunk, shards=layout.shard, dtype="float32", fill_value=np.nan, overwrite=True, attributes={"job": job.key}, dimension_names=DIMENSIONS["scores"])
    if with_self_influence:
        storage.create_array(group, "self_influence", shape=(layout.n_train,), chunks=(layout.train_rows,), dtype="float32", fill_value=np.nan, overwrite=True, attributes={"job": job.key}, dimension_names=DIMENSIONS["self_influence"])
    elif "self_influence" in group:
        del group["self_influence"]  # a self-influence of another configuration must not survive beside these scores
    return group


IN_PROCESS_INDEX_BYTES = 256 * 2**20  # a small index's products may run here (`placement`): its rows are read in this process
IN_PROCESS_FACTOR_BYTES = 2 * 2**30  # and scoring without an index, when the query factors (one copy, the threads share it) fit this
GRADIENT_FORWARDS = 3  # a training row's gradient costs about 3 forward passes (forward and backward)


def placement(job: ChunkJob, rows: int | None = None, pairs: int | None = None) -> Placement:
    """Where the chunks run: in this process, as the chunk tasks' arithmetic on `in_process_threads` (the same bits),
    when the work is small and may run on this machine (the cluster's own, so not an `address` cluster's): a small
    index's products, or, with a local cluster, the training gradients of `rows` (all of them by default) and their
    `pairs` products with the query factors (every query's with every row's by default) when the factors (the
    threads read one copy) fit IN_PROCESS_FACTOR_BYTES and no method solves on the data. Else on the cluster."""
    compute = job.stage.compute
    n_test, n_train = job.stage.layout.n_test, job.stage.data.n_train
    if compute.cluster == ClusterKind.address:
        return place(compute, 0.0, eligible=False)
    if isinstance(job, IndexScoreJob):
        indexes = [member.index for member in job.stage.members if member.index is not None]
        small = sum(index.bytes_per_row for index in indexes) * n_train < IN_PROCESS_INDEX_BYTES
        return place(compute, sum(2.0 * n_test * n_train * index.shape[1] for index in indexes), eligible=small)
    members = job.stage.members
    held = sum(math.prod(member.factors.shape) * np.dtype(member.factors.dtype).itemsize for member in members)
    if compute.cluster != ClusterKind.local or METHOD_CLASSES[job.stage.method.name].solves_on_data or held >= IN_PROCESS_FACTOR_BYTES:
        return place(compute, 0.0, eligible=False)
    rows, pairs = n_train if rows is None else rows, n_test * n_train if pairs is None else pairs
    return place(compute, _training_side_flops(job, rows) + sum(2.0 * pairs * member.factors.shape[-1] for member in members))


def _training_side_flops(job: ChunkJob, rows: int) -> float:
    """Every member's training gradients of `rows` rows, estimated from one forward over the first training row
    (the module as built: FLOPs do not depend on its weights, so its checkpoint is not read)."""
    stage = job.stage
    device = stage.compute.torch_device
    row = forward_flops(build_module(stage.members[0].model, device), first_training_row(stage.data, job.options, device))
    return len(stage.members) * GRADIENT_FORWARDS * row * rows


def _compute(job: ScoreJob, client_factory: Callable[[], Any], on_progress: Progress | None, loc: StageLocation) -> dict[str, Any]:
    work = Work()
    with_self_influence, described = job.before_chunks(work)
    group = _prepare_arrays(job, with_self_influence)
    layout = job.stage.layout
    chunks = job.pending(list(range(layout.n_tasks)))
    where = placement(job)
    if chunks:
        with where.client(client_factory) as client:
            work += execute(job, chunks, layout.n_tasks, client, on_progress, where.threads)
    if with_self_influence:
        group["self_influence"].attrs["fingerprint"] = job.key
    group["scores"].attrs["fingerprint"] = job.key
    return {
        "url": storage.join(job.influence_url, "scores"),
        "fingerprint": job.key,
        "shape": (layout.n_test, layout.n_train),
        "dtype": "float32",
        "n_chunks": layout.n_tasks,
        "chunks_computed": len(chunks),
        "ran": where.ran,
        "gradient_rows": work.gradient_rows,
        "work": work.as_dict(),
        "self_influence": described,
    }


def run(stage: ScoringInput, client_factory: Callable[[], Any], on_progress: Progress | None = None) -> ScoresRef:
    """Compute (or finish computing) the scores, or with `candidates.knn_k` only each query's candidates;
    `client_factory()` is a context manager yielding a Dask client or None."""
    if stage.prefiltered:
        return candidate_scoring.run(stage, client_factory, on_progress)
    job = IndexScoreJob(stage) if stage.indexed else ScoreJob(stage)
    return stage.call.run(lambda loc: _compute(job, client_factory, on_progress, loc))
