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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zarr

from . import index_probe
from ..store import integrity, storage
from ... import examples
from ...methods import IdentityInfluence, InfluenceFunctionModel, KfacInfluence
from ...index_projection import IndexProjection, largest_side, projected_dim
from ...contraction import Batch
from ...methods.scorer import Scorer
from ...self_influence import SelfInfluencePlan, describe
from ...work import Work, forward_flops
from ..runtime.cluster import place
from ..score.chunks import ChunkJob, Progress, execute
from ..score.finite import check_finite
from ..score.layout import MIN_TASKS
from ..store.loading import first_training_row, index_projection, intact_file, keep_whitening, load_influence_model, save_tensors, training_rows
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
            "index": {"budget_gb": self.compute.index_budget_gb, "side": self.compute.index_side, "dtype": self.compute.index_dtype, "train_chunk_rows": self.compute.train_chunk_rows, "probe": self.compute.index_probe},
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
    """A chunk job that writes one chunk of index rows (features and self-influences) per task, and with a probe
    (a compressed index's), the chunk's part of the probe check (`index_probe.py`)."""

    stage: IndexInput  # type: ignore[assignment]
    rows: int  # rows per chunk and per task
    side: int | None = None  # LoGra's side when the index is compressed
    probe: bool = False  # whether its tasks score the probe rows both ways

    @property
    def probe_url(self) -> str:
        """The probe rows' factors, stored by the driver for the workers."""
        return self.path("probe_factors.pt")

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
        """Chunk `index` of the features and of the self-influences (when computed), and its probe part."""
        group = storage.open_group(self.url, self.options, mode="r")
        chunks = [f"index.zarr/{name}/{key}" for name in ("features", "self_influence") if name in group for key in storage.chunk_keys(group[name], 0, index)]
        return chunks + (integrity.file_keys(f"probe/{index}.pt") if self.probe else [])

    def score(self, worker: Any, index: int) -> None:
        """Index chunk `index`: its rows' features and self-influences, written in place; its probe part beside."""
        start = time.perf_counter()
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
        if worker.probe is not None:
            save_tensors(index_probe.part_url(self.base_url, index), worker.probe.part(time.perf_counter() - start), self.options)


class IndexWorker:
    """What a worker process keeps between index tasks: the influence model with its curvature and self-influence
    plan, the training arrays and the open index arrays."""

    def __init__(self, job: IndexJob) -> None:
        stage = job.stage
        self.x, self.y = training_rows(stage.data, job.options)
        im = load_influence_model(stage.method, stage.model, stage.data, stage.preconditioner, job.options, stage.compute.torch_device)
        self.scorer = Scorer(im, None, job.self_influence_plan(0))
        group = storage.open_group(job.url, job.options, mode="a")
        self.features: zarr.Array = group["features"]
        self.self_influence: zarr.Array | None = group["self_influence"] if "self_influence" in group else None
        self.projection = None if job.side is None else index_projection(im, stage.data, job.options, job.side, job.whitening_url)
        self.probe = None
        if job.probe:
            assert self.projection is not None
            self.probe = index_probe.Probe(job.probe_url, im, self.projection, getattr(torch, str(self.features.dtype)), job.options, stage.compute.torch_device)
        self.project = None if self.projection is None else self._project

    def _project(self, batch: Batch) -> torch.Tensor:
        """A captured batch's compressed rows, which the probe (when there is one) also scores."""
        assert self.projection is not None
        rows = self.projection.training(batch)
        if self.probe is not None:
            self.probe.observe(batch, rows)
        return rows

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

    @property
    def sides(self) -> dict[str, list[int]]:
        """Each layer's (k_out, k_in) when compressed (a layer smaller than the side keeps its own size)."""
        return {} if self.projection is None else {cut.name: list(self.projection.sides(cut)) for cut in self.projection.split.cuts}


def plan_layout(stage: IndexInput, im: InfluenceFunctionModel) -> Layout | str:
    """Exact when n_train rows of the method's features fit compute.index_budget_gb; else LoGra-compressed when the
    features are gradients (or their rotation) and the compressed rows fit, at compute.index_side or, with side auto,
    the largest side that fits; else the reason the index is skipped."""
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
    itemsize = stored(True).itemsize
    fits = lambda dim: n_train * dim * itemsize <= budget  # noqa: E731
    projection = index_projection(im, stage.data, stage.store.options, 1 if compute.index_side == "auto" else compute.index_side)
    side = largest_side(projection.split, fits) if compute.index_side == "auto" else compute.index_side
    if side is None or not fits(projected_dim(projection.split, side)):
        tried = "at side 1, the smallest" if side is None else f"at index_side={side}"
        return f"{storage.megabytes(n_train * projected_dim(projection.split, side or 1) * itemsize)} even compressed ({tried}) exceeds compute.index_budget_gb={compute.index_budget_gb:g}"
    projection = projection if side == projection.side else projection.resized(side)
    return Layout(projection.dim, stored(True), "logra", side, projection)


def _compute(stage: IndexInput, client_factory: Callable[[], Any], on_progress: Progress | None, loc: StageLocation) -> dict[str, Any]:
    im = load_influence_model(stage.method, stage.model, stage.data, stage.preconditioner, stage.store.options, stage.compute.torch_device)
    n_train = stage.data.n_train
    layout = plan_layout(stage, im)
    if isinstance(layout, str):
        skipped = {"compression": "skipped", "skipped": f"{layout}: scoring recomputes the training gradients; set a method.projection, a smaller compute.index_side (or auto), or raise compute.index_budget_gb"}
        integrity.write_checked(loc.path("skipped.json"), json.dumps(skipped).encode(), stage.store.options)  # the decision, kept as the stage's output
        return {"url": loc.path("skipped.json"), "fingerprint": loc.key, "shape": (n_train, im.factor_dim), "dtype": str(im.objective.space.dtype).removeprefix("torch."), "bytes_per_row": 0, **skipped}
    probed = index_probe.probe_rows(n_train, stage.compute.index_probe) if layout.projection is not None and stage.compute.index_probe and n_train > 1 else None
    job = IndexJob(stage, index_chunk_rows(n_train, layout.row_bytes, stage.compute.train_chunk_rows), layout.side, probed is not None)
    work = Work()
    plan = self_influence_plan(job, 0, lambda: im, stage.aggregate, None, work)  # no queries here: auto's sketch takes self_influence_rank
    _create(job, layout.dim, layout.dtype, plan is not None, im.objective.space.dtype)
    # factored once here, for the workers and every later query; written anew (a first attempt's were lost or
    # damaged), no chunk of an earlier attempt, projected with other factors, is kept
    rewhitened = layout.projection is not None and keep_whitening(layout.projection, job.whitening_url, stage.store.options)
    if rewhitened:
        storage.remove(job.path("done"), job.options)
    n_tasks = math.ceil(n_train / job.rows)
    chunks = job.pending(list(range(n_tasks)))
    if probed is not None and chunks and (rewhitened or not intact_file(job.probe_url, job.options)):  # once, for every chunk's task
        assert layout.projection is not None
        before = im.work.copy()
        index_probe.save_factors(job.probe_url, im, layout.projection, *training_rows(stage.data, stage.store.options), probed, job.options)
        work += im.work - before
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
    probe = {} if probed is None else index_probe.summarize([(job.bounds(i)[0], index_probe.read_part(index_probe.part_url(job.base_url, i), job.options)) for i in range(n_tasks)], probed, n_train, layout.side or 0)
    return {
        "url": storage.join(loc.url, "index.zarr"), "fingerprint": loc.key, "shape": (n_train, layout.dim), "dtype": str(layout.dtype).removeprefix("torch."),
        "bytes_per_row": layout.row_bytes, "total_bytes": n_train * layout.row_bytes, "compression": layout.compression, "side": layout.side, "sides": layout.sides,
        "dim": layout.dim, "exact_dim": im.factor_dim, "rows_per_chunk": job.rows, "chunks_computed": len(chunks), "n_chunks": n_tasks, "ran": placement.ran, "gradient_rows": work.gradient_rows,
        "work": work.as_dict(), "self_influence": {"mode": stage.aggregate.self_influence, **describe(plan)}, "probe": probe,
    }


def run(stage: IndexInput, client_factory: Callable[[], Any], on_progress: Progress | None = None) -> IndexRef:
    """Write (or finish writing) the index, or return the stored one; `client_factory()` is a context manager
    yielding a Dask client or None."""
    return stage.call.run(lambda loc: _compute(stage, client_factory, on_progress, loc))
