"""The compressed index's probe check, taken in index_training's own pass: a seeded sample of training rows, scored as
queries against every training row both exactly (contracted from the pass's captures, as compute_influences scores
without an index) and through the compressed rows the pass writes (narrowed to their stored dtype, as scoring reads
them). Its recall@10 and Pearson say how much the compression costs on this very problem, before any query is asked.

The probe rows come from the training rows alone (seeded), so the index stays keyed on the training side. Each
chunk task writes its part (both scores of its rows, and its seconds); the driver reduces the parts in row order with
the running top-k that aggregation keeps, each probe row left out of its own ranking (its self-influence would be
its first match both ways).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ... import examples
from ...contraction import Batch, Rows, contract, factor_rows
from ...index_projection import IndexProjection
from ...methods import InfluenceFunctionModel
from ..model.models import load_stored
from ..score.score_reductions import RunningTopK
from ..store.loading import save_tensors

PROBE_SEED = 0  # the probe rows' draw
PROBE_K = 10  # recall@k of the probe's exact top k in its compressed top k
RECALL_FLOOR = 0.8  # below this recall (either side) the run warns
FIELD = "index_training"


def probe_rows(n_train: int, count: int) -> np.ndarray:
    """`count` training rows (all of them when fewer), drawn with PROBE_SEED, in index order."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return np.sort(torch.randperm(n_train, generator=generator)[: min(count, n_train)].numpy())


def save_factors(url: str, im: InfluenceFunctionModel, projection: IndexProjection, x: Any, y: torch.Tensor, rows: np.ndarray, options: dict[str, Any]) -> None:
    """The probe rows' query factors, computed once by the driver for the workers: exact (the method's coordinates,
    as compute_test_factors solves them without an index) and in the index's coordinates (as it takes them with one)."""
    xp, yp = examples.read(x, rows), examples.read(y, rows)
    exact = im.influence_factors(xp, yp)
    save_tensors(url, {"rows": torch.from_numpy(rows), "exact": exact, "compressed": projection.queries(im, xp, yp)}, options)


class Probe:
    """A worker's side of the probe: the factors loaded once, and the scores of the chunk being indexed."""

    def __init__(self, url: str, im: InfluenceFunctionModel, projection: IndexProjection, stored: torch.dtype, options: dict[str, Any], device: str) -> None:
        state = load_stored(url, options, field=FIELD, device=device)
        self.exact: Rows = factor_rows(state["exact"], projection.split, im.row_order, None)
        self.compressed: torch.Tensor = state["compressed"]
        self.stored, self.work = stored, im.work
        self.blocks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.seconds = 0.0

    def observe(self, batch: Batch, rows: torch.Tensor) -> None:
        """Score a captured batch (in the method's basis) both ways: its captures contracted with the exact factors,
        its compressed rows, narrowed as stored, with the compressed factors."""
        start = time.perf_counter()
        exact = contract(self.exact, batch, self.work)
        narrowed = rows.to(self.stored).to(self.compressed.dtype)
        self.blocks.append((exact.float(), (self.compressed @ narrowed.T).float()))
        self.seconds += time.perf_counter() - start

    def part(self, seconds: float) -> dict[str, Any]:
        """The chunk's part: its exact and compressed scores (probes × rows), the chunk's seconds and the probe's
        share of them; the worker starts the next chunk afresh."""
        exact, compressed = (torch.cat(side, dim=1) for side in zip(*self.blocks))
        part = {"exact": exact, "compressed": compressed, "seconds": seconds, "probe_seconds": self.seconds}
        self.blocks, self.seconds = [], 0.0
        return part


def part_url(folder: str, index: int) -> str:
    return f"{folder}/probe/{index}.pt"


@dataclass
class _Pearson:
    """Running sums of (x, y) pairs for their Pearson correlation, in float64."""

    n: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    yy: float = 0.0
    xy: float = 0.0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double(), y.double()
        self.n += x.numel()
        self.x, self.y = self.x + float(x.sum()), self.y + float(y.sum())
        self.xx, self.yy, self.xy = self.xx + float((x * x).sum()), self.yy + float((y * y).sum()), self.xy + float((x * y).sum())

    def value(self) -> float:
        cov = self.xy - self.x * self.y / self.n
        spread = math.sqrt(max(self.xx - self.x**2 / self.n, 0.0) * max(self.yy - self.y**2 / self.n, 0.0))
        return cov / spread if spread > 0 else float("nan")


def summarize(parts: list[tuple[int, dict[str, Any]]], rows: np.ndarray, n_train: int, side: int) -> dict[str, Any]:
    """The probe's report from the chunks' parts ((first row, part), in row order): recall@k of each probe row's
    exact top k helpful and harmful among its compressed top k, the Pearson of the two scores over every other
    training row, what the probe cost, and a warning naming the fixes when recall falls below RECALL_FLOOR."""
    k = min(PROBE_K, n_train - 1)
    exact, compressed, pearson = RunningTopK(len(rows), k), RunningTopK(len(rows), k), _Pearson()
    seconds = probe_seconds = 0.0
    for lo, part in parts:
        width = part["exact"].shape[1]
        indices = torch.arange(lo, lo + width).expand(len(rows), width)
        own = indices == torch.from_numpy(rows)[:, None]  # a probe row against itself: left out
        for best, scores in ((exact, part["exact"]), (compressed, part["compressed"])):
            best.offer(scores.masked_fill(own, -math.inf), indices, largest=True)
            best.offer(scores.masked_fill(own, math.inf), indices, largest=False)
        pearson.add(part["exact"][~own], part["compressed"][~own])
        seconds, probe_seconds = seconds + part["seconds"], probe_seconds + part["probe_seconds"]
    recall = {kind: _recall(getattr(exact, side_)[1], getattr(compressed, side_)[1]) for kind, side_ in (("helpful", "top"), ("harmful", "bottom"))}
    report: dict[str, Any] = {
        "rows": len(rows), "row_indices": rows.tolist(), "k": k, f"recall_at_{PROBE_K}": recall, "pearson": round(pearson.value(), 4),
        "seconds": round(probe_seconds, 3), "share": round(probe_seconds / seconds, 4) if seconds > 0 else None, "floor": RECALL_FLOOR,
    }
    if min(recall.values()) < RECALL_FLOOR:
        report["warning"] = (
            f"index_training: the compressed index (side {side}) keeps recall@{k} {recall['helpful']:.2f} (helpful) / {recall['harmful']:.2f} (harmful) "
            f"and Pearson {report['pearson']:.3f} of the exact scores on its {len(rows)} probe rows, below {RECALL_FLOOR}: its scores and train totals "
            "are approximate, and its top-k too unless re-ranked. Fix: raise compute.index_budget_gb (the side follows it with index_side auto), "
            "set a larger compute.index_side, or keep re-ranking on (aggregate.rerank; query --rerank N) for exact top-k"
        )
    return report


def _recall(exact: torch.Tensor, compressed: torch.Tensor) -> float:
    """Mean over probe rows of the share of the exact top k in the compressed top k."""
    k = exact.shape[1]
    return round(float(np.mean([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(exact, compressed)])), 4)


def read_part(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """A chunk's part as its task wrote it (checked bytes)."""
    return load_stored(url, options, field=FIELD)

