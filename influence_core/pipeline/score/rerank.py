"""Exact top-k over a compressed training index (the `rerank` stage): each query's `per_side` most helpful and most
harmful candidates by the compressed scores are scored again exactly, as compute_influences scores without an index
(each member's exact query factors against the candidate rows' captured gradients), and the top-k are taken from
those. The work follows the candidates, not n_train: one gradient pass over their union, one Dask task per training
chunk that holds any (FastIF's candidate job, `candidate_scoring.CandidateJob`), each query meeting only its own
candidates (`Scorer.entries`); each task writes its part, then a marker, so a stopped stage resumes with the chunks
not done. The stage is keyed on the queries' side (the compressed scores and the exact factors): never part of the
training index. It writes `reranked_indices` and `reranked_scores` (n_test, min(2 per_side, n_train)) beside the
scores; aggregation takes the top-k from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zarr

from ..store import integrity, storage
from .candidate_scoring import CandidateJob, assemble, load_npy, save_npy, write_candidates
from .chunks import Progress, execute
from .score_input import ScoringInput
from .score_reductions import READ_BYTES, RunningTopK, read_ahead, rerank_candidates
from .scoring import placement
from ..store.refs import ScoresRef
from ..store.stage import StageCall, StageLocation


@dataclass(frozen=True)
class RerankInput(ScoringInput):
    """A scoring input whose members carry their exact query factors (compute_test_factors without an index) and no
    index, with the compressed scores whose candidates it scores again, `per_side` a side."""

    scores: ScoresRef | None = None
    per_side: int = 0

    def plan(self) -> StageCall[ScoresRef]:
        """Keyed on the compressed scores, the members' models, curvatures and exact factors, and its own options."""
        assert self.scores is not None
        config = {"per_side": self.per_side, "train_chunk_rows": self.compute.train_chunk_rows, "target_shard_mb": self.compute.target_shard_mb, "method": self.method.model_dump(mode="json")}
        inputs: dict[str, Any] = {"data": self.data, "scores": self.scores}
        for index, member in enumerate(self.members):
            inputs.update(member.inputs(index))
        return StageCall("rerank", ScoresRef, config, inputs, self.store, self.compute.torch_threads)


def candidates_of(scores: zarr.Array, per_side: int) -> np.ndarray:
    """Each query's candidates (`rerank_candidates`) by the compressed scores (n_test, n_train), streamed a block of
    column shards at a time through the running top-k that aggregation and questions keep (ties to the lower index)."""
    n_test, n_train = scores.shape
    best = RunningTopK(n_test, min(2 * per_side, n_train))
    for lo, block in read_ahead(scores, axis=1, block_bytes=READ_BYTES):
        best.add(torch.from_numpy(block), lo)
    return rerank_candidates(best.top[1].numpy(), best.bottom[1].numpy(), per_side, n_train)


def _candidates(job: CandidateJob, stage: RerankInput) -> np.ndarray:
    """The candidates: read back when an interrupted stage stored them, else chosen from the scores and stored."""
    url = job.path("candidates.npy")
    try:
        return load_npy(url, job.options)
    except (FileNotFoundError, integrity.DamagedError):  # not stored yet, or damaged: chosen again
        pass
    assert stage.scores is not None
    found = candidates_of(storage.open_array(stage.scores.url, job.options), stage.per_side)
    save_npy(url, found, job.options)
    return found


def _compute(stage: RerankInput, client_factory: Callable[[], Any], on_progress: Progress | None, loc: StageLocation) -> dict[str, Any]:
    job = CandidateJob(stage)
    candidates = _candidates(job, stage)
    rows = np.unique(candidates)
    needed = sorted(set((rows // stage.layout.train_rows).tolist()))
    chunks = job.pending(needed)
    where = placement(job, rows=len(rows), pairs=candidates.size)
    with where.client(client_factory) as client:
        work = execute(job, chunks, len(needed), client, on_progress, where.threads)
    group = storage.open_group(stage.store.influence_url, job.options, mode="a")
    write_candidates(group, "reranked", candidates, assemble(job, candidates, needed), job)
    return {
        "url": storage.join(stage.store.influence_url, "reranked_scores"), "fingerprint": job.key, "shape": candidates.shape, "dtype": "float32",
        "n_chunks": len(needed), "chunks_computed": len(chunks), "ran": where.ran, "gradient_rows": work.gradient_rows, "work": work.as_dict(), "self_influence": {"mode": "off"},
        "candidates": {"per_side": stage.per_side, "per_query": candidates.shape[1], "rows": len(rows), "entries": candidates.size, "train_chunks": stage.layout.n_tasks},
    }


def run(stage: RerankInput, client_factory: Callable[[], Any], on_progress: Progress | None = None) -> ScoresRef:
    """Score each query's candidates exactly (or finish doing so), or return the stored ones; `client_factory()` is a
    context manager yielding a Dask client or None."""
    return stage.call.run(lambda loc: _compute(stage, client_factory, on_progress, loc))
