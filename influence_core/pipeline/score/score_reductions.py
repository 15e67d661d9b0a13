"""Streamed reductions over scores, a block of training rows at a time: each query's running top-k both ways (ties
to the lower index), the train totals and the NaN count, so a scores matrix or an index of any size is reduced in
the memory of two blocks."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Aggregates:
    helpful_indices: np.ndarray  # (n_test, k) int64, most helpful first
    helpful_scores: np.ndarray  # (n_test, k) descending
    harmful_indices: np.ndarray  # (n_test, k) int64, most harmful (most negative) first
    harmful_scores: np.ndarray  # (n_test, k) ascending
    missing: int  # NaN entries: a partial matrix must never be summarised as complete


def read_ahead(array: Any, axis: int = 0, block_bytes: int = 0) -> Iterator[tuple[int, np.ndarray]]:
    """The array's blocks along `axis` in order, each with its first position, the next one read (in a thread) while
    the caller reduces this one: a scan overlaps the disk with its arithmetic, and holds two blocks. A block is a
    stored shard (or chunk) wide, or as many whole ones as fit `block_bytes`, so small arrays take one read and one
    reduction, not one per shard."""
    stored, n = (array.shards or array.chunks)[axis], array.shape[axis]
    stored_bytes = array.nbytes * stored // max(n, 1)
    step = stored * max(1, block_bytes // max(stored_bytes, 1))

    def block(lo: int) -> np.ndarray:
        return np.asarray(array[(slice(None),) * axis + (slice(lo, lo + step),)])

    with ThreadPoolExecutor(1, thread_name_prefix="block-read") as pool:
        reading = pool.submit(block, 0)
        for lo in range(0, n, step):
            values = reading.result()
            if lo + step < n:
                reading = pool.submit(block, lo + step)
            yield lo, values


READ_BYTES = 64 * 2**20  # aggregate reads the scores in blocks of whole shards up to this size
TIE_MARGIN = 8  # entries a chunk's selection takes past each query's k, to hold ties with the k-th


class RunningTopK:
    """Each query's k largest and k smallest scores seen so far, with their training indices; ties go to the lower
    index, however the rows are split into blocks."""

    def __init__(self, n: int, k: int) -> None:
        self.k = k
        empty = (torch.empty(n, 0), torch.empty(n, 0, dtype=torch.int64))
        self.top, self.bottom = empty, empty

    def add(self, scores: torch.Tensor, offset: int) -> None:
        """Every query's scores of the training rows offset, offset + 1, ...: a chunk of the index."""
        indices = torch.arange(offset, offset + scores.shape[1]).expand_as(scores)
        self.offer(scores, indices, largest=True)
        self.offer(scores, indices, largest=False)

    def offer(self, scores: torch.Tensor, indices: torch.Tensor, largest: bool) -> None:
        """Each query's scores of its training rows `indices` (in index order), for its k largest (or smallest)."""
        if largest:
            self.top = self._keep(self.top, scores, indices, largest=True)
        else:
            self.bottom = self._keep(self.bottom, scores, indices, largest=False)

    def _keep(self, kept: tuple[torch.Tensor, torch.Tensor], scores: torch.Tensor, indices: torch.Tensor, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
        scores, indices = self._candidates(scores, indices, largest)
        values, where = torch.cat([kept[0], scores], 1), torch.cat([kept[1], indices], 1)
        order = torch.sort(values, dim=1, descending=largest, stable=True).indices[:, : self.k]  # ties: the lower index first
        return values.gather(1, order), where.gather(1, order)

    def _candidates(self, scores: torch.Tensor, indices: torch.Tensor, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's entries that can still enter its top k, in index order: the k best and every tie with the k-th,
        from one partial selection of k + TIE_MARGIN (the whole chunk when a row ties beyond it), where sorting the
        whole chunk cost 90% of a question over a large index."""
        wide = self.k + TIE_MARGIN
        if scores.shape[1] <= wide:
            return scores, indices
        values, at = torch.topk(scores, wide, dim=1, largest=largest)
        if bool((values[:, -1] == values[:, self.k - 1]).any()):  # the k-th value may recur past the selection
            return scores, indices
        order = torch.argsort(at, dim=1)  # index order, so the stable sort's ties still go to the lower index
        return values.gather(1, order), indices.gather(1, at.gather(1, order))

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "topk_helpful_indices": self.top[1].numpy(), "topk_helpful_scores": self.top[0].numpy(),
            "topk_harmful_indices": self.bottom[1].numpy(), "topk_harmful_scores": self.bottom[0].numpy(),
        }


def aggregate_scores(scores: Any, k: int, totals_out: Any) -> Aggregates:
    """All reductions in one pass over the stored scores (n_test, n_train), a column shard at a time: top-k both
    ways as `RunningTopK` keeps them (the same answer as `influence-pipeline query`'s scan), the NaN count, and the
    column totals (float64 sums) written into `totals_out`, an array chunked like the scores' shards. Blocks of
    whole shards up to READ_BYTES: W3's 500 x 5,000 in 10 shards of 1 MB is one read and one selection."""
    best, missing = RunningTopK(scores.shape[0], k), 0
    for lo, block in read_ahead(scores, axis=1, block_bytes=READ_BYTES):
        best.add(torch.from_numpy(block), lo)
        totals_out[lo : lo + block.shape[1]] = block.sum(axis=0, dtype=np.float64).astype(np.float32)
        missing += int(np.isnan(block).sum())
    top = best.arrays()
    return Aggregates(top["topk_helpful_indices"], top["topk_helpful_scores"], top["topk_harmful_indices"], top["topk_harmful_scores"], missing)


def candidate_top_k(indices: np.ndarray, scores: np.ndarray, k: int) -> Aggregates:
    """Top-k both ways of each query's candidate scores (n_test, m) at training indices `indices`, ties to the lower
    index, as for full scores."""
    by_index = np.argsort(indices, axis=1, kind="stable")
    indices, scores = np.take_along_axis(indices, by_index, 1), np.take_along_axis(scores, by_index, 1)
    helpful = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    harmful = np.argsort(scores, axis=1, kind="stable")[:, :k]
    pick = np.take_along_axis
    return Aggregates(
        pick(indices, helpful, 1).astype(np.int64), pick(scores, helpful, 1).astype(np.float32),
        pick(indices, harmful, 1).astype(np.int64), pick(scores, harmful, 1).astype(np.float32),
        int(np.isnan(scores).sum()),
    )


def aggregate_candidates(indices: np.ndarray, scores: np.ndarray, k: int, n_train: int) -> tuple[Aggregates, np.ndarray]:
    """The same reductions over candidate scores (n_test, k_candidates) at training indices `indices`: top-k of each
    query's candidates (`candidate_top_k`), and train totals summed over the candidate entries only (0 where no
    query has the example)."""
    totals = np.zeros(n_train, dtype=np.float64)
    np.add.at(totals, indices.ravel(), scores.ravel().astype(np.float64))
    return candidate_top_k(indices, scores, k), totals.astype(np.float32)


def rerank_candidates(helpful: np.ndarray, harmful: np.ndarray, per_side: int, n_train: int) -> np.ndarray:
    """Each query's re-ranking candidates (n_test, min(2 per_side, n_train)), distinct, in index order: its first
    `per_side` of `helpful` (indices by descending score), then as many of `harmful` (by ascending score, at least
    2 per_side of them) as are not among those (ties can put a row on both sides)."""
    width = min(2 * per_side, n_train)
    out = np.empty((len(helpful), width), dtype=np.int64)
    for q, (top, bottom) in enumerate(zip(helpful, harmful)):
        first = top[:per_side]
        rest = bottom[~np.isin(bottom, first)][: width - len(first)]
        out[q] = np.sort(np.concatenate([first, rest]))
    return out
