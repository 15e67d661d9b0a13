"""Chunk and shard shapes of the scores array, derived from target byte sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass

INNER_CHUNK_BYTES = 1 * 2**20  # what one read of a slice of scores pulls in
MAX_TEST_ROWS_PER_CHUNK = 1024
MIN_TASKS = 8  # without an explicit chunk size, at least this many tasks, so every worker of a cluster has work

# What each axis of each output array counts, stored as Zarr v3 `dimension_names` so plain-zarr readers need no docs
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "scores": ("query", "train"),
    "candidate_indices": ("query", "k"),
    "candidate_scores": ("query", "k"),
    "reranked_indices": ("query", "k"),
    "reranked_scores": ("query", "k"),
    "topk_helpful_indices": ("query", "k"),
    "topk_helpful_scores": ("query", "k"),
    "topk_harmful_indices": ("query", "k"),
    "topk_harmful_scores": ("query", "k"),
    "topk_helpful_token_scores": ("query", "k", "token"),
    "topk_harmful_token_scores": ("query", "k", "token"),
    "argmax": ("query",),
    "self_influence": ("train",),
    "train_totals": ("train",),
}

# A question's answer (`query --output-url`, the question flow) is a group of its own layout, marked so that `show`,
# `verify` and a later answer tell it from a run (attrs kind and schema_version; docs/output-format.md)
ANSWER_KIND = "answer"
ANSWER_SCHEMA_VERSION = 1

# The group attributes that say what a score means (DESIGN.md, "Score convention")
SCORE_CONVENTION = {
    "score_convention": "score[query, train] = grad loss(query)^T (H + lambda I)^-1 grad loss(train); H the Hessian or Gauss-Newton matrix of the mean training loss",
    "score_sign": "positive = helpful: removing the training example raises the query's loss by about score / n_train (-I_up,loss of Koh & Liang 2017; pyDVL and Kronfluence use the same sign)",
    "score_units": "the units of the query measurement (the loss by default); score / n_train approximates its change when the training example is removed",
    "self_influence_convention": "self_influence[train] = grad loss(train)^T (H + lambda I)^-1 grad loss(train)",
    "train_totals_convention": "train_totals[train] = sum over queries of score[query, train]",
}


@dataclass(frozen=True)
class ScoreLayout:
    """`train_rows` training columns per task; each task writes exactly one shard of `shard` shape."""

    n_test: int
    n_train: int
    train_rows: int
    chunk: tuple[int, int]
    shard: tuple[int, int]

    @property
    def n_tasks(self) -> int:
        return math.ceil(self.n_train / self.train_rows)

    def bounds(self, index: int) -> tuple[int, int]:
        lo = index * self.train_rows
        return lo, min(lo + self.train_rows, self.n_train)


def score_layout(n_test: int, n_train: int, target_shard_mb: float, train_rows: int | None = None, itemsize: int = 4) -> ScoreLayout:
    """Shards of about `target_shard_mb` spanning all queries (smaller when that leaves fewer than MIN_TASKS tasks);
    inner chunks of about 1 MB that tile them exactly. A shard holds as many whole chunks as fit its wanted width,
    never more, so it never leaves fewer tasks than wanted (W3's 500 x 5,000 took 5 of 1,048 columns, not 8 or more:
    on 2 threads one did 3)."""
    test_rows = min(n_test, MAX_TEST_ROWS_PER_CHUNK)
    inner_cols = max(1, INNER_CHUNK_BYTES // (itemsize * test_rows))
    wanted = train_rows or min(max(1, int(target_shard_mb * 2**20) // (itemsize * n_test)), math.ceil(n_train / MIN_TASKS))
    wanted = min(wanted, n_train)
    inner_cols = min(inner_cols, wanted)
    cols = wanted // inner_cols * inner_cols  # a shard must hold whole chunks
    shard_test = math.ceil(n_test / test_rows) * test_rows
    return ScoreLayout(n_test, n_train, cols, (test_rows, inner_cols), (shard_test, cols))
