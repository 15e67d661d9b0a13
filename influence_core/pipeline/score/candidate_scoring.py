"""Stage 5 with FastIF's prefilter: candidate scores (n_test, k) instead of all scores (n_test, n_train).

Three steps, resumable: (1) the features of every training and query row, one train chunk per Dask task reading its
own rows from the store; (2) a FAISS index of the training features and each query's k nearest, in the driver,
stored once; (3) one task per train chunk that holds candidates: the gradients of those rows only, contracted with
the query factors, each query keeping its own candidates; the task writes its part, then a marker (`chunks.py`). A
rerun submits only the chunks without both. The driver assembles `candidate_indices` and `candidate_scores`; the
latter's fingerprint, which makes the output count as complete, is written last.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from distributed import Client

from ..store import integrity, storage
from .chunks import ChunkJob, ChunkWorker, Progress, execute
from .finite import stored_scores
from .knn_prefilter import build_index, index_kind, module_features, nearest
from ... import examples
from ...errors import ConfigError, NumericalError
from .layout import DIMENSIONS
from ..store.refs import ScoresRef
from ...self_influence import SelfInfluencePlan
from .score_input import ScoringInput
from ..specs import CandidatesSpec
from ..runtime.threads import TASK_THREADS, torch_threads
from ..store.loading import load_model, open_data
from ..store.stage import StageLocation


@dataclass(frozen=True)
class CandidateJob(ChunkJob):
    """A chunk job that scores only the candidates among its training rows, each query its own."""

    @property
    def spec(self) -> CandidatesSpec:
        assert self.stage.candidates is not None
        return self.stage.candidates

    def hold(self, plan: SelfInfluencePlan | None) -> np.ndarray:
        """Each query's candidates."""
        return load_npy(self.path("candidates.npy"), self.options)

    def score(self, worker: ChunkWorker, index: int) -> None:
        """Scores of the candidates among training chunk `index`, each query's own only (`Scorer.entries`: one
        capture of each such row), saved as its part (entries and values)."""
        lo, hi = self.stage.layout.bounds(index)
        candidates = worker.held
        q, j = np.nonzero((candidates >= lo) & (candidates < hi))
        rows, position = np.unique(candidates[q, j], return_inverse=True)
        picked = torch.from_numpy(rows - lo)
        x, y = examples.take(examples.read(worker.x, slice(lo, hi)), picked), examples.read(worker.y, slice(lo, hi))[picked]
        values = stored_scores(worker.entries(x, y, torch.from_numpy(q), torch.from_numpy(position)).detach().cpu().numpy(), f"candidate scores of train chunk {index}", stage=self.stage.call.stage)
        entries = q * candidates.shape[1] + j
        save_npy(self.path("parts", f"{index}.npy"), np.stack([entries.astype(np.float64), values.astype(np.float64)]), self.options)

    @property
    def base_url(self) -> str:
        """The stage's folder, which holds the parts."""
        return self.stage.call.location.url

    def objects(self, index: int) -> list[str]:
        """Chunk `index`'s part and its digest."""
        return integrity.file_keys(f"parts/{index}.npy")


def save_npy(url: str, array: np.ndarray, options: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    integrity.write_checked(url, buffer.getvalue(), options)


def load_npy(url: str, options: dict[str, Any]) -> np.ndarray:
    """A saved array, its bytes checked (`integrity.read_checked`)."""
    raw = integrity.read_checked(url, options, "compute_influences", "run again: the candidates are computed again")
    return np.load(io.BytesIO(raw), allow_pickle=False)


def write_candidates(group: Any, prefix: str, candidates: np.ndarray, scores: np.ndarray, job: ChunkJob) -> None:
    """{prefix}_indices and {prefix}_scores (n_test, k) into the output group, the scores' fingerprint last: the
    output counts as complete from there."""
    for name, values in ((f"{prefix}_indices", candidates), (f"{prefix}_scores", scores)):
        array = storage.create_array(group, name, shape=values.shape, chunks=(min(values.shape[0], 1024), values.shape[1]), dtype=values.dtype, overwrite=True, attributes={"job": job.key, "n_train": job.stage.data.n_train}, dimension_names=DIMENSIONS[name])
        array[...] = values
    group[f"{prefix}_indices"].attrs["fingerprint"] = job.key
    group[f"{prefix}_scores"].attrs["fingerprint"] = job.key


def feature_rows(job: CandidateJob, split: str, lo: int, hi: int) -> np.ndarray:
    """Features (hi - lo, d) of rows lo..hi of x_train or x_test, read from the store by the task itself."""
    with torch_threads(TASK_THREADS):
        model = load_model(job.stage.model, job.options, job.stage.compute.torch_device)
        return module_features(model, examples.read(open_data(job.stage.data, job.options)[f"x_{split}"], slice(lo, hi)), job.spec.module)


def _features(job: CandidateJob, client: Client | None) -> tuple[np.ndarray, np.ndarray]:
    """Training features (n_train, d) and query features (n_test, d), computed by the tasks, assembled in order."""
    layout = job.stage.layout
    spans = [("train", *layout.bounds(i)) for i in range(layout.n_tasks)] + [("test", 0, job.stage.data.n_test)]
    if client is None:
        parts = [feature_rows(job, *span) for span in spans]
    else:
        futures = client.map(feature_rows, [job] * len(spans), *zip(*spans), pure=False, retries=2)
        parts = client.gather(futures)
    return np.concatenate(parts[:-1]), parts[-1]


def _candidates(job: CandidateJob, client: Client | None) -> tuple[np.ndarray, dict[str, Any]]:
    """Each query's k nearest training examples: read back when an interrupted run stored them, else found here."""
    url = job.path("candidates.npy")
    n_train = job.stage.data.n_train
    info: dict[str, Any] = {"knn_k": job.spec.knn_k, "index": index_kind(n_train, job.spec.index), "module": job.spec.module or "penultimate"}
    try:
        return load_npy(url, job.options), info
    except (FileNotFoundError, integrity.DamagedError):  # not stored yet, or damaged: found again
        pass
    started = time.perf_counter()
    train, test = _features(job, client)
    built = time.perf_counter()
    assert job.spec.knn_k is not None
    candidates = nearest(build_index(train, job.spec.index, job.stage.compute.torch_threads), test, job.spec.knn_k)
    save_npy(url, candidates, job.options)
    info.update(feature_dim=int(train.shape[1]), feature_seconds=round(built - started, 3), index_seconds=round(time.perf_counter() - built, 3))
    return candidates, info


def assemble(job: CandidateJob, candidates: np.ndarray, needed: list[int]) -> np.ndarray:
    """candidate_scores (n_test, k) float32 from the parts; every entry must have been scored."""
    flat = np.full(candidates.size, np.nan, dtype=np.float32)
    for index in needed:
        entries, values = load_npy(job.path("parts", f"{index}.npy"), job.options)
        flat[entries.astype(np.int64)] = values.astype(np.float32)
    missing = int(np.isnan(flat).sum())
    if missing:
        raise NumericalError(f"{missing} candidate scores are NaN: a part is incomplete or the model diverged; rerun compute_influences")
    return flat.reshape(candidates.shape)


def _compute(job: CandidateJob, client_factory: Callable[[], Any], on_progress: Progress | None, loc: StageLocation) -> dict[str, Any]:
    group = storage.open_group(job.influence_url, job.options, mode="a")
    group.attrs["status"] = "running"
    for stale in ("scores", "self_influence", "candidate_scores", "candidate_indices"):
        if stale in group:
            del group[stale]  # of another configuration, or about to be rewritten: never beside these candidates
    with client_factory() as client:  # one cluster for both passes
        candidates, info = _candidates(job, client)
        needed = sorted(set((candidates // job.stage.layout.train_rows).ravel().tolist()))
        chunks = job.pending(needed)
        work = execute(job, chunks, len(needed), client, on_progress)
    write_candidates(group, "candidate", candidates, assemble(job, candidates, needed), job)
    shape = candidates.shape
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
        "candidates": {**info, "scored_rows": int(np.unique(candidates).size), "train_chunks": job.stage.layout.n_tasks},
    }


def check_knn_k(spec: CandidatesSpec, n_train: int) -> None:
    """k may not exceed the training set (null takes all of it)."""
    if spec.knn_k is not None and spec.knn_k > n_train:
        raise ConfigError("candidates.knn_k", f"knn_k={spec.knn_k} exceeds the {n_train} training examples", f"set candidates.knn_k to at most {n_train}, or null to score every training example")


def run(stage: ScoringInput, client_factory: Callable[[], Any], on_progress: Progress | None = None) -> ScoresRef:
    """Compute (or finish computing) the candidate scores of the prefiltered stage input."""
    job = CandidateJob(stage)
    return stage.call.run(lambda loc: _compute(job, client_factory, on_progress, loc))
