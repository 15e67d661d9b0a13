"""Reductions over the scores matrix, streamed chunk by chunk with Dask: top-k both ways, totals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import dask
import dask.array as da
import numpy as np


@dataclass(frozen=True)
class Aggregates:
    helpful_indices: np.ndarray  # (n_test, k) int64, most helpful first
    helpful_scores: np.ndarray  # (n_test, k) descending
    harmful_indices: np.ndarray  # (n_test, k) int64, most harmful (most negative) first
    harmful_scores: np.ndarray  # (n_test, k) ascending
    missing: int  # NaN entries: a partial matrix must never be summarised as complete


def aggregate_scores(scores: da.Array, k: int, totals_out: Any) -> Aggregates:
    """All reductions in one pass over the chunks. Only the (n_test, k) results are held; the column totals
    (= scores.sum(axis=0)) stream into `totals_out`, an array chunked like the scores' columns."""
    store_totals = da.store(scores.sum(axis=0, dtype=np.float64).astype(np.float32), totals_out, lock=False, compute=False)
    h_idx, h_val, b_idx, b_val, missing, _ = dask.compute(
        da.argtopk(scores, k, axis=1),
        da.topk(scores, k, axis=1),
        da.argtopk(scores, -k, axis=1),
        da.topk(scores, -k, axis=1),
        da.isnan(scores).sum(),
        store_totals,
    )
    return Aggregates(h_idx.astype(np.int64), h_val.astype(np.float32), b_idx.astype(np.int64), b_val.astype(np.float32), int(missing))


def aggregate_candidates(indices: np.ndarray, scores: np.ndarray, k: int, n_train: int) -> tuple[Aggregates, np.ndarray]:
    """The same reductions over candidate scores (n_test, k_candidates) at training indices `indices`: top-k of each
    query's candidates, and train totals summed over the candidate entries only (0 where no query has the example)."""
    helpful = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    harmful = np.argsort(scores, axis=1, kind="stable")[:, :k]
    totals = np.zeros(n_train, dtype=np.float64)
    np.add.at(totals, indices.ravel(), scores.ravel().astype(np.float64))
    pick = np.take_along_axis
    result = Aggregates(
        pick(indices, helpful, 1).astype(np.int64), pick(scores, helpful, 1).astype(np.float32),
        pick(indices, harmful, 1).astype(np.int64), pick(scores, harmful, 1).astype(np.float32),
        int(np.isnan(scores).sum()),
    )
    return result, totals.astype(np.float32)
