"""Reductions over the scores matrix, streamed chunk by chunk with Dask: top-k both ways, totals."""

from __future__ import annotations

from dataclasses import dataclass

import dask
import dask.array as da
import numpy as np


@dataclass(frozen=True)
class Aggregates:
    helpful_indices: np.ndarray  # (n_test, k) int64, most helpful first
    helpful_scores: np.ndarray  # (n_test, k) descending
    harmful_indices: np.ndarray  # (n_test, k) int64, most harmful (most negative) first
    harmful_scores: np.ndarray  # (n_test, k) ascending
    train_totals: np.ndarray  # (n_train,) = scores.sum(axis=0)
    missing: int  # NaN entries: a partial matrix must never be summarised as complete


def aggregate_scores(scores: da.Array, k: int) -> Aggregates:
    """All reductions in one pass over the chunks; only (n_test, k) and (n_train,) results are held."""
    results = dask.compute(
        da.argtopk(scores, k, axis=1),
        da.topk(scores, k, axis=1),
        da.argtopk(scores, -k, axis=1),
        da.topk(scores, -k, axis=1),
        scores.sum(axis=0),
        da.isnan(scores).sum(),
    )
    h_idx, h_val, b_idx, b_val, totals, missing = results
    return Aggregates(
        h_idx.astype(np.int64), h_val.astype(np.float32), b_idx.astype(np.int64), b_val.astype(np.float32), totals.astype(np.float32), int(missing)
    )
