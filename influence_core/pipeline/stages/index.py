"""Stage 3b: the training-gradient index ("index once, query many", as TRAK, LogIX and bergson do).

For every training row, the vector that scoring contracts with the query factors (the method's per-example features:
the loss gradient, or its rotation into the curvature's eigenbasis, or its projection), and its self-influence, in
row-chunked Zarr under the stage store. The stage is keyed on the model, the training rows, the curvature and its own
options, never on the queries: every later run over the same training side scores new queries against it with one
GEMM per chunk and no training gradient (`scoring.py`).

One Dask task per row chunk reads its own rows, writes its chunk of `features` and `self_influence`, then a marker
(`chunks.py`), so a stopped stage resumes with the chunks not done. An exact index larger than
`compute.index_budget_gb` is compressed (LoGra per gradient matrix, `influence_core.index_projection`) when the
method's features are gradients; one that still does not fit is not written: the stage records why, and scoring
recomputes training gradients.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zarr

from ..store import integrity, storage
from ... import examples
from ...methods import IdentityInfluence, InfluenceFunctionModel, KfacInfluence
from ...index_projection import IndexProjection
from ...methods.scorer import Scorer
from ...self_influence import SelfInfluencePlan, describe
from ...work import Work, forward_flops
from ..runtime.cluster import place
from ..score.chunks import ChunkJob, Progress, execute
from ..score.finite import check_finite
from ..score.layout import MIN_TASKS
from ..store.loading import first_training_row, index_projection, keep_whitening, load_influence_model, training_rows
from ..store.refs import WHITENING_FILE, DataRef, IndexRef, ModelRef, StageRef
from ..store.run_store import RunStore
from ..score.scoring import self_influence_plan, stored_plan
from ..specs import AggregateSpec, ComputeSpec, MethodSpec
from ..store.stage import StageCall, StageInput, StageLocation

INDEX_CHUNK_BYTES = 4 * 2**20  # one stored chunk of index rows: what a scoring task reads per step
INDEX_PASS_FORWARDS = 4  # indexing a row costs about 4 forward passes: forward and backward (3), the projection (~1)


@dataclass(frozen=True)
class IndexInput(StageInput[IndexRef]):
    """The method and its fitted curvature, the model, the training rows, the self-influence settings and the
    compute spec (its cluster writes the chunks; its index_budget_gb bounds the index)."""

    method: MethodSpec
    aggregate: AggregateSpec
    model: ModelRef
    data: DataRef
    preconditioner: StageRef
    store: RunStore
    compute: ComputeSpec

    def plan(self) -> StageCall[IndexRef]:
        """Keyed on model, training rows, curvature, the method and the index's own options: never the queries."""
        config = {
            "method": self.method.model_dump(mode="json"),
            "self_influence": {"mode": self.aggregate.self_influence, "rank": self.aggregate.self_influence_rank},
            "index": {"budget_gb": self.compute.index_budget_gb, "side": self.compute.index_side, "dtype": self.compute.index_dtype, "train_chunk_rows": self.compute.train_chunk_rows},
        }
        inputs = {"model": self.model, "train": self.data.training, "curvature": self.preconditioner}
        return StageCall("index_training", IndexRef, config, inputs, self.store, self.compute.torch_threads)


def index_chunk_rows(n_train: int, row_bytes: int, wanted: int | None) -> int:
    """Rows per stored chunk (and per task): `wanted` (compute.train_chunk_rows), else about INDEX_CHUNK_BYTES, and
    at least MIN_TASKS tasks."""
    rows = wanted or min(max(1, INDEX_CHUNK_BYTES // row_bytes), math.ceil(n_train / MIN_TASKS))
    return max(1, min(rows, n_train))


@dataclass(frozen=True)
class IndexJob(ChunkJob):
    """A chunk job that writes one chunk of index rows (features and self-influences) per task."""

    stage: IndexInput  # type: ignore[assignment]
    rows: int  # rows per chunk and per task
    side: int | None = None  # LoGra's side when the index is compressed

    def bounds(self, index: int) -> tuple[int, int]:
        lo = index * self.rows
        return lo, min(lo + self.rows, self.stage.data.n_train)

    @property
    def url(self) -> str:
        return self.path("index.zarr")

    @property
    def whitening_url(self) -> str:
        """The whitening factors in the index's group (`IndexRef.whitening_url`)."""
        return storage.join(self.url, WHITENING_FILE)

    def open(self) -> "IndexWorker":
        return IndexWorker(self)

    def self_influence_plan(self, member: int) -> SelfInfluencePlan | None:
        return stored_plan(self, member)

    @property
    def base_url(self) -> str:
        """The stage's folder, which holds index.zarr."""
        return self.stage.call.location.url

    def objects(self, index: int) -> list[str]:
        """Chunk `index` of the features and of the self-influences (when computed)."""
        group = storage.open_group(self.url, self.options, mode="r")
        return [f"index.zarr/{name}/{key}" for name in ("features", "self_influence") if name in group for key in storage.chunk_keys(group[name], 0, index)]

    def score(self, worker: Any, index: int) -> None:
        """Index chunk `index`: its rows' features and self-influences, written in place."""
        lo, hi = self.bounds(index)
        features, values = worker.scorer.features(examples.read(worker.x, slice(lo, hi)), examples.read(worker.y, slice(lo, hi)), worker.project)
        check_finite("index_training", features, f"index features of train chunk {index}")
        stored = worker.features.dtype
        narrowed = features.detach().to(getattr(torch, str(stored)))  # torch narrows 2.5x faster than numpy
        check_finite("index_training", narrowed, f"index features of train chunk {index} as {stored}", f"they exceed {stored}'s range", "set compute.index_dtype: float32, then run again")
        worker.features[lo:hi] = narrowed.cpu().numpy()
        if worker.self_influence is not None:
            assert values is not None
            check_finite("index_training", values, f"self-influences of train chunk {index}")
            worker.self_influence[lo:hi] = values.detach().cpu().numpy()


class IndexWorker:
    """What a worker process keeps between index tasks: the influence model with its curvature and self-influence
    plan, the training arrays and the open index arrays."""

    def __init__(self, job: IndexJob) -> None:
        stage = job.stage
        self.x, self.y = training_rows(stage.data, job.options)
        im = load_influence_model(stage.method, stage.model, stage.data, stage.preconditioner, job.options, stage.compute.torch_device)
        self.scorer = Scorer(im, None, job.self_influence_plan(0))
        self.project = None if job.side is None else index_projection(im, stage.data, job.options, job.side, job.whitening_url).training
        group = storage.open_group(job.url, job.options, mode="a")
        self.features: zarr.Array = group["features"]
        self.self_influence: zarr.Array | None = group["self_influence"] if "self_influence" in group else None

    def work(self) -> Work:
        return self.scorer.im.work.copy()


def _create(job: IndexJob, dim: int, dtype: torch.dtype, with_self_influence: bool, exact_dtype: torch.dtype) -> None:
    """The index arrays, created once (a resumed stage keeps them with the chunks already written); self-influences
    in `exact_dtype` (the model's), whatever the features' storage."""
    group = storage.open_group(job.url, job.options, mode="a")
    name = str(dtype).removeprefix("torch.")
    if "features" in group and group["features"].shape == (job.stage.data.n_train, dim) and str(group["features"].dtype) == name and ("self_influence" in group) == with_self_influence:
        return
    # uncompressed: gradient rows are dense floats
    kwargs: dict[str, Any] = {"dtype": name, "compressors": None, "overwrite": True}
    storage.create_array(group, "features", shape=(job.stage.data.n_train, dim), chunks=(job.rows, dim), fill_value=np.nan, dimension_names=("train", "feature"), **kwargs)
    if with_self_influence:
        storage.create_array(group, "self_influence", shape=(job.stage.data.n_train,), chunks=(job.rows,), fill_value=np.nan, dimension_names=("train",), **{**kwargs, "dtype": str(exact_dtype).removeprefix("torch.")})
    storage.remove(job.path("done"), job.options)


@dataclass(frozen=True)
class Layout:
    """How the index stores a row: `dim` numbers of `dtype`, exact or LoGra-compressed (`side`, by `projection`)."""

    dim: int
    dtype: torch.dtype
    compression: str
    side: int | None = None
    projection: IndexProjection | None = None

    @property
    def row_bytes(self) -> int:
        return self.dim * self.dtype.itemsize


def plan_layout(stage: IndexInput, im: InfluenceFunctionModel) -> Layout | str:
    """Exact when n_train rows of the method's features fit compute.index_budget_gb; else LoGra-compressed when the
    features are gradients (or their rotation) and the compressed rows fit; else the reason the index is skipped."""
    compute, n_train, model_dtype = stage.compute, stage.data.n_train, im.objective.space.dtype
    stored = lambda compressed: getattr(torch, compute.index_dtype) if compute.index_dtype != "auto" else (torch.float16 if compressed else model_dtype)  # noqa: E731
    budget = compute.index_budget_gb * 1e9
    if im.query_rank is not None:
        return "method.query_rank compresses the query factors"
    exact = Layout(im.factor_dim, stored(False), "none")
    if n_train * exact.row_bytes <= budget:
        return exact
    if not im.contracts() or not isinstance(im, (KfacInfluence, IdentityInfluence)):
        why = "features (projected or low-rank) are not compressed further" if not im.contracts() else "factors (H + λI)⁻¹∇ℓ are not compressed (a random projection of them loses the scores: Pearson 0.17 on the digits MLP at side 32); K-FAC/EK-FAC compress whitened"
        return f"{storage.megabytes(n_train * exact.row_bytes)} exceeds compute.index_budget_gb={compute.index_budget_gb:g}, and this method's {why}"
    projection = index_projection(im, stage.data, stage.store.options, compute.index_side)
    compressed = Layout(projection.dim, stored(True), "logra", compute.index_side, projection)
    if n_train * compressed.row_bytes <= budget:
        return compressed
    return f"{storage.megabytes(n_train * compressed.row_bytes)} even compressed (index_side={compute.index_side}) exceeds compute.index_budget_gb={compute.index_budget_gb:g}"


def _compute(stage: IndexInput, client_factory: Callable[[], Any], on_progress: Progress | None, loc: StageLocation) -> dict[str, Any]:
    im = load_influence_model(stage.method, stage.model, stage.data, stage.preconditioner, stage.store.options, stage.compute.torch_device)
    n_train = stage.data.n_train
    layout = plan_layout(stage, im)
    if isinstance(layout, str):
        skipped = {"compression": "skipped", "skipped": f"{layout}: scoring recomputes the training gradients; set a method.projection, a smaller compute.index_side, or raise compute.index_budget_gb"}
        integrity.write_checked(loc.path("skipped.json"), json.dumps(skipped).encode(), stage.store.options)  # the decision, kept as the stage's output
        return {"url": loc.path("skipped.json"), "fingerprint": loc.key, "shape": (n_train, im.factor_dim), "dtype": str(im.objective.space.dtype).removeprefix("torch."), "bytes_per_row": 0, **skipped}
    job = IndexJob(stage, index_chunk_rows(n_train, layout.row_bytes, stage.compute.train_chunk_rows), layout.side)
    work = Work()
    plan = self_influence_plan(job, 0, lambda: im, stage.aggregate, None, work)  # no queries here: auto's sketch takes self_influence_rank
    _create(job, layout.dim, layout.dtype, plan is not None, im.objective.space.dtype)
    # factored once here, for the workers and every later query; written anew (a first attempt's were lost or
    # damaged), no chunk of an earlier attempt, projected with other factors, is kept
    if layout.projection is not None and keep_whitening(layout.projection, job.whitening_url, stage.store.options):
        storage.remove(job.path("done"), job.options)
    n_tasks = math.ceil(n_train / job.rows)
    chunks = job.pending(list(range(n_tasks)))
    row = forward_flops(im.objective.model, first_training_row(stage.data, stage.store.options, stage.compute.torch_device))
    placement = place(stage.compute, INDEX_PASS_FORWARDS * row * len(chunks) * job.rows)
    if chunks:
        with placement.client(client_factory) as client:
            work += execute(job, chunks, n_tasks, client, on_progress, placement.threads)
    group = storage.open_group(job.url, stage.store.options, mode="a")
    for name in ("features", "self_influence"):
        if name in group:
            group[name].attrs["fingerprint"] = loc.key
    group.attrs["fingerprint"] = loc.key
    return {
        "url": storage.join(loc.url, "index.zarr"), "fingerprint": loc.key, "shape": (n_train, layout.dim), "dtype": str(layout.dtype).removeprefix("torch."),
        "bytes_per_row": layout.row_bytes, "compression": layout.compression, "side": layout.side, "rows_per_chunk": job.rows, "chunks_computed": len(chunks),
        "n_chunks": n_tasks, "ran": placement.ran, "gradient_rows": work.gradient_rows, "work": work.as_dict(), "self_influence": {"mode": stage.aggregate.self_influence, **describe(plan)},
    }


def run(stage: IndexInput, client_factory: Callable[[], Any], on_progress: Progress | None = None) -> IndexRef:
    """Write (or finish writing) the index, or return the stored one; `client_factory()` is a context manager
    yielding a Dask client or None."""
    return stage.call.run(lambda loc: _compute(stage, client_factory, on_progress, loc))
