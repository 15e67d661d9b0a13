"""The linear datamodeling score (LDS; Park et al., 2023, TRAK): how well summed scores over random training subsets
rank the query losses of models retrained on those subsets.

For query q: the Spearman correlation over subsets S between the predicted loss −Σ_{i∈S} score[q, i] (positive
scores are helpful, so keeping helpful examples lowers the loss) and the measured loss of the model retrained on S.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ConfigError


@dataclass(frozen=True)
class Lds:
    """Per-query LDS, its mean over queries and the standard error of that mean (NaN for a constant query)."""

    per_query: np.ndarray

    @property
    def mean(self) -> float:
        return float(np.nanmean(self.per_query))

    @property
    def stderr(self) -> float:
        finite = self.per_query[np.isfinite(self.per_query)]
        return float(finite.std(ddof=1) / np.sqrt(len(finite))) if len(finite) > 1 else float("nan")


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n of a vector, tied values sharing the mean of their ranks (what Spearman's ρ needs)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(values)]
    group = np.cumsum(np.r_[True, ordered[1:] != ordered[:-1]]) - 1
    ranks = np.empty(len(values))
    ranks[order] = (starts[group] + ends[group] + 1) / 2.0
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two vectors (Pearson of their average ranks); NaN if either is constant."""
    ra, rb = average_ranks(a) - (len(a) + 1) / 2.0, average_ranks(b) - (len(b) + 1) / 2.0
    denominator = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denominator) if denominator > 0 else float("nan")


def linear_datamodeling_score(scores: np.ndarray, masks: np.ndarray, measured: np.ndarray) -> Lds:
    """LDS of `scores` (n_queries, n_train) against retrained models: `masks` (n_subsets, n_train) marks each
    subset's training examples, `measured` (n_subsets, n_queries) the query losses of the model retrained on it."""
    n_queries, n_train = scores.shape
    if masks.shape[1] != n_train or measured.shape != (masks.shape[0], n_queries):
        raise ConfigError("lds", f"scores {scores.shape}, masks {masks.shape} and measured {measured.shape} do not line up", "give masks (subsets, n_train) and measured (subsets, n_queries)")
    if masks.shape[0] < 3:
        raise ConfigError("lds.subsets", f"{masks.shape[0]} subsets give no rank correlation", "use 3 or more subsets (the literature uses 50-100+)")
    predicted = -(masks.astype(scores.dtype) @ scores.T)  # (n_subsets, n_queries): predicted loss up to constants
    return Lds(np.array([spearman(predicted[:, q], measured[:, q]) for q in range(n_queries)]))


def change_slope(scores: np.ndarray, masks: np.ndarray, measured: np.ndarray, full: np.ndarray) -> tuple[float, float]:
    """How large the actual changes of the query losses are against the predicted ones: the least-squares slope
    through 0 of measured − full (the model trained on every example) on Σ_{i∉S} score[q, i] / n_train (removing
    S's complement raises the loss by about its scores / n), over every (subset, query); and their Pearson
    correlation. NaN where the predictions are all 0."""
    predicted = ((~masks).astype(np.float64) @ scores.T) / scores.shape[1]
    actual = measured - full[None, :]
    norm = float((predicted * predicted).sum())
    if norm == 0 or actual.std() == 0:
        return float("nan"), float("nan")
    return float((predicted * actual).sum() / norm), float(np.corrcoef(predicted.ravel(), actual.ravel())[0, 1])
