"""Stage 5 with FastIF's prefilter: candidate scores (n_test, k) instead of all scores (n_test, n_train).

Three steps, resumable: (1) the features of every training and query row, one train chunk per Dask task reading its
own rows from the store; (2) a FAISS index of the training features and each query's k nearest, in the driver,
stored once; (3) one task per train chunk that holds candidates: the gradients of those rows only, contracted with
the query factors, each query keeping its own candidates; the task writes its part, then a marker. A rerun
submits only the chunks without both. The driver assembles `candidate_indices` and `candidate_scores`; the
latter's fingerprint, which makes the output count as complete, is written last.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from distributed import Client, as_completed

from . import storage
from .knn_prefilter import build_index, candidate_entries, index_kind, module_features, nearest
from ..errors import ConfigError, NumericalError
from .layout import DIMENSIONS, ScoreLayout, score_layout
from ..methods import InfluenceFunctionModel
from ..methods.scorer import Scorer
from .refs import DataRef, ModelRef, ScoresRef, StageRef
from .specs import CandidatesSpec, ComputeSpec, MethodSpec
from .threads import TASK_THREADS, torch_threads
from ..work import Work
from .loading import load_influence_model, load_model, open_data, read_factors
from .stage import StageCall, StageLocation
from .run_store import RunStore

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class CandidateJob:
    """Everything a task needs, by reference only; never training data."""

    key: str
    spec: CandidatesSpec
    method: MethodSpec
    model: ModelRef
    data: DataRef
    preconditioner: StageRef
    factors: StageRef
    layout: ScoreLayout  # how the training rows split into tasks
    influence_url: str
    stage_url: str
    options: dict[str, Any]

    def path(self, *parts: str) -> str:
        return storage.join(self.stage_url, *parts)


class _Worker:
    """What a worker keeps between scoring tasks of one job: the influence model, the query factors' scorer, the
    candidates and the training arrays."""

    def __init__(self, job: CandidateJob) -> None:
        self.im: InfluenceFunctionModel = load_influence_model(job.method, job.model, job.data, job.preconditioner, job.options)
        arrays = open_data(job.data, job.options)
        self.x, self.y = arrays["x_train"], arrays["y_train"]
        self.scorer = Scorer(self.im, read_factors(self.im, job.factors.url, job.options, self.x, self.y), None)
        self.candidates = _load_npy(job.path("candidates.npy"), job.options)


_WORKERS: dict[str, _Worker] = {}
_WORKERS_LOCK = threading.Lock()


def _worker(job: CandidateJob) -> _Worker:
    """Load once per worker process and job (the last job only: a worker serves one run at a time)."""
    where = f"{job.key}:{job.influence_url}"  # two outputs of the same parameters share a key, not open arrays
    with _WORKERS_LOCK:
        if where not in _WORKERS:
            _WORKERS.clear()
            _WORKERS[where] = _Worker(job)
        return _WORKERS[where]


def _save_npy(url: str, array: np.ndarray, options: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    storage.write_bytes(url, buffer.getvalue(), options)


def _load_npy(url: str, options: dict[str, Any]) -> np.ndarray:
    return np.load(io.BytesIO(storage.read_bytes(url, options)), allow_pickle=False)


def feature_rows(job: CandidateJob, split: str, lo: int, hi: int) -> np.ndarray:
    """Features (hi - lo, d) of rows lo..hi of x_train or x_test, read from the store by the task itself."""
    with torch_threads(TASK_THREADS):
        model = load_model(job.model, job.options)
        x = np.asarray(open_data(job.data, job.options)[f"x_{split}"][lo:hi])
        return module_features(model, torch.from_numpy(x), job.spec.module)


def score_chunk(job: CandidateJob, index: int) -> dict[str, float]:
    """Scores of the candidates among training chunk `index`; writes the part (entries and values), then the marker."""
    with torch_threads(TASK_THREADS):
        worker = _worker(job)
        before = worker.im.work.copy()
        lo, hi = job.layout.bounds(index)
        candidates = worker.candidates
        rows = np.unique(candidates[(candidates >= lo) & (candidates < hi)])
        x, y = np.asarray(worker.x[lo:hi]), np.asarray(worker.y[lo:hi])
        scores, _ = worker.scorer(torch.from_numpy(x[rows - lo]), torch.from_numpy(y[rows - lo]))
        assert scores is not None
        q, j, c = candidate_entries(rows, candidates)
        entries = q * candidates.shape[1] + j
        values = scores.detach().cpu()[torch.from_numpy(q), torch.from_numpy(c)].numpy().astype(np.float32)
        _save_npy(job.path("parts", f"{index}.npy"), np.stack([entries.astype(np.float64), values.astype(np.float64)]), job.options)
        storage.write_bytes(job.path("done", str(index)), b"", job.options)
        return (worker.im.work - before).as_dict()


def _features(job: CandidateJob, client: Client | None) -> tuple[np.ndarray, np.ndarray]:
    """Training features (n_train, d) and query features (n_test, d), computed by the tasks, assembled in order."""
    spans = [("train", *job.layout.bounds(i)) for i in range(job.layout.n_tasks)] + [("test", 0, job.data.n_test)]
    if client is None:
        parts = [feature_rows(job, *span) for span in spans]
    else:
        futures = client.map(feature_rows, [job] * len(spans), *zip(*spans), pure=False, retries=2)
        parts = client.gather(futures)
    return np.concatenate(parts[:-1]), parts[-1]


def _candidates(job: CandidateJob, client: Client | None, threads: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Each query's k nearest training examples: read back when an interrupted run stored them, else found here."""
    url = job.path("candidates.npy")
    info: dict[str, Any] = {"knn_k": job.spec.knn_k, "index": index_kind(job.data.n_train, job.spec.index), "module": job.spec.module or "penultimate"}
    if storage.exists(url, job.options):
        return _load_npy(url, job.options), info
    started = time.perf_counter()
    train, test = _features(job, client)
    built = time.perf_counter()
    assert job.spec.knn_k is not None
    candidates = nearest(build_index(train, job.spec.index, threads), test, job.spec.knn_k)
    _save_npy(url, candidates, job.options)
    info.update(feature_dim=int(train.shape[1]), feature_seconds=round(built - started, 3), index_seconds=round(time.perf_counter() - built, 3))
    return candidates, info


def pending_chunks(job: CandidateJob, needed: list[int]) -> list[int]:
    """Chunks holding candidates whose marker or part is missing: a marker alone never counts."""
    done = {int(name) for name in storage.list_names(job.path("done"), job.options) if name.isdigit()}
    parts = {int(name.removesuffix(".npy")) for name in storage.list_names(job.path("parts"), job.options) if name.removesuffix(".npy").isdigit()}
    return [i for i in needed if i not in done & parts]


def execute(job: CandidateJob, chunks: list[int], client: Client | None, total: int, on_progress: Progress | None) -> Work:
    """Run the scoring tasks, on the cluster or here; report (done, total) as they finish; return the work done."""
    done, work = total - len(chunks), Work()
    if client is None:
        results: Any = (score_chunk(job, index) for index in chunks)
    else:
        futures = client.map(score_chunk, [job] * len(chunks), chunks, pure=False, retries=2)
        results = (future.result() for future in as_completed(futures))
    for counted in results:
        work += Work(**counted)
        done += 1
        if on_progress:
            on_progress(done, total)
    return work


def _assemble(job: CandidateJob, candidates: np.ndarray, needed: list[int]) -> np.ndarray:
    """candidate_scores (n_test, k) float32 from the parts; every entry must have been scored."""
    flat = np.full(candidates.size, np.nan, dtype=np.float32)
    for index in needed:
        entries, values = _load_npy(job.path("parts", f"{index}.npy"), job.options)
        flat[entries.astype(np.int64)] = values.astype(np.float32)
    missing = int(np.isnan(flat).sum())
    if missing:
        raise NumericalError(f"{missing} candidate scores are NaN: a part is incomplete or the model diverged; rerun compute_influences")
    return flat.reshape(candidates.shape)


def _compute(job: CandidateJob, client_factory: Callable[[], Any], threads: int, on_progress: Progress | None, loc: StageLocation) -> dict[str, Any]:
    group = storage.open_group(job.influence_url, job.options, mode="a")
    group.attrs["status"] = "running"
    for stale in ("scores", "self_influence", "candidate_scores", "candidate_indices"):
        if stale in group:
            del group[stale]  # of another configuration, or about to be rewritten: never beside these candidates
    with client_factory() as client:  # one cluster for both passes
        candidates, info = _candidates(job, client, threads)
        needed = sorted(set((candidates // job.layout.train_rows).ravel().tolist()))
        chunks = pending_chunks(job, needed)
        work = execute(job, chunks, client, len(needed), on_progress)
    scores = _assemble(job, candidates, needed)
    shape = candidates.shape
    for name, values in (("candidate_indices", candidates), ("candidate_scores", scores)):
        group.create_array(name, shape=shape, chunks=(min(shape[0], 1024), shape[1]), dtype=values.dtype, overwrite=True, attributes={"job": job.key, "n_train": job.data.n_train}, dimension_names=DIMENSIONS[name])[...] = values
    group["candidate_indices"].attrs["fingerprint"] = job.key
    group["candidate_scores"].attrs["fingerprint"] = job.key  # last: the output counts as complete from here
    return {
        "url": storage.join(job.influence_url, "candidate_scores"),
        "fingerprint": job.key,
        "shape": shape,
        "dtype": "float32",
        "n_chunks": len(needed),
        "chunks_computed": len(chunks),
        "gradient_rows": work.gradient_rows,
        "work": work.as_dict(),
        "self_influence": {"mode": "off"},
        "candidates": {**info, "scored_rows": int(np.unique(candidates).size), "train_chunks": job.layout.n_tasks},
    }


def check_knn_k(spec: CandidatesSpec, n_train: int) -> None:
    """k may not exceed the training set (null takes all of it)."""
    if spec.knn_k is not None and spec.knn_k > n_train:
        raise ConfigError("candidates.knn_k", f"knn_k={spec.knn_k} exceeds the {n_train} training examples", f"set candidates.knn_k to at most {n_train}, or null to score every training example")


def run(
    call: StageCall[ScoresRef], spec: CandidatesSpec, compute: ComputeSpec, method: MethodSpec, model: ModelRef, data: DataRef, preconditioner: StageRef, factors: StageRef,
    store: RunStore, client_factory: Callable[[], Any], on_progress: Progress | None = None,
) -> ScoresRef:
    """Compute (or finish computing) the candidate scores of the stage `call`."""
    layout = score_layout(data.n_test, data.n_train, compute.target_shard_mb, compute.train_chunk_rows)
    job = CandidateJob(call.key, spec, method, model, data, preconditioner, factors, layout, store.influence_url, call.location.url, store.options)
    return call.run(lambda loc: _compute(job, client_factory, compute.torch_threads, on_progress, loc))
