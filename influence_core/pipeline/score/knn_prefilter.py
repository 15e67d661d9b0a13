"""FastIF's candidate prefilter (Guo et al., 2021): the activations of one module as features, a FAISS index over
the training examples' features, and each query's k nearest training examples as the only ones it scores.

The index builder and its search serve the question's inner-product search too (`faiss_search.py`): the metric is
L2 here, inner product there."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from ... import examples
from ...errors import ConfigError
from ...examples import Inputs

if TYPE_CHECKING:  # faiss loads when an index is built, so reading a config never pays its import
    import faiss

    from ...methods import InfluenceFunctionModel

IndexKind = Literal["auto", "flat", "ivf", "hnsw"]
Metric = Literal["l2", "ip"]  # nearest by Euclidean distance, or largest inner product
FLAT_MAX_ROWS = 100_000  # auto: exact search up to this many training examples, IVF above
HNSW_NEIGHBOURS = 32
IVF_POINTS_PER_LIST = 64  # IVF's k-means trains on at most this many rows per list (FAISS's 256 trains a 1M-row index on every row: half an hour on 2 cores)


def resolve_module(model: nn.Module, name: str | None) -> tuple[nn.Module, bool]:
    """The module whose activations are the features, and whether its input (True) or output is taken.

    None means the penultimate layer: the input of the last module that holds parameters (for an MLP, the last
    hidden activation; LoRA's adapter matrices, whose inputs are the adapters' rank-wide bottleneck, left out: the
    adapted layer's base takes the activation). A name is a key of `model.named_modules()`, whose output is taken.
    """
    modules = dict(model.named_modules())
    if name is None:
        with_params = [m for n, m in modules.items() if not list(m.children()) and any(True for _ in m.parameters(recurse=False)) and ".lora_" not in n]
        if not with_params:
            raise ConfigError("candidates.module", "the model has no module with parameters", "name a module whose output is the feature, e.g. one of " + ", ".join(repr(n) for n in modules if n))
        return with_params[-1], True
    if name not in modules or name == "":
        raise ConfigError("candidates.module", f"no module {name!r} in the model", "use one of " + ", ".join(repr(n) for n in modules if n) + ", or leave it empty for the penultimate layer")
    return modules[name], False


@torch.no_grad()
def module_features(model: nn.Module, x: Inputs, module: str | None = None, batch_size: int = 1024) -> np.ndarray:
    """Features (n, d) float32 of the rows of x: the chosen module's activations, flattened per example."""
    target, take_input = resolve_module(model, module)
    captured: list[torch.Tensor] = []

    def keep(_: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor | None = None) -> None:
        value = inputs[0] if take_input else output
        assert isinstance(value, torch.Tensor)
        captured.append(value.detach().reshape(len(value), -1).float().cpu())

    handle = target.register_forward_pre_hook(keep) if take_input else target.register_forward_hook(keep)
    try:
        first = next(model.parameters())
        for lo in range(0, examples.count(x), batch_size):
            rows = examples.map_inputs(examples.take(x, slice(lo, lo + batch_size)), lambda t: t.to(device=first.device, dtype=first.dtype if t.is_floating_point() else t.dtype))
            examples.call(model, rows)
    finally:
        handle.remove()
    return np.ascontiguousarray(torch.cat(captured).numpy()) if captured else np.zeros((0, 0), np.float32)


def index_kind(n_train: int, kind: IndexKind = "auto") -> str:
    """auto: flat (exact) up to FLAT_MAX_ROWS training examples, IVF above."""
    return ("flat" if n_train <= FLAT_MAX_ROWS else "ivf") if kind == "auto" else kind


def index_params(n_train: int, kind: IndexKind = "auto") -> dict[str, Any]:
    """The index `build_index` makes over n_train rows: its kind (auto resolved) and what fixes its structure (IVF's
    4·√n lists, at most one per 39 rows as FAISS wants, and its k-means sample; HNSW's neighbours per node)."""
    chosen = index_kind(n_train, kind)
    if chosen == "flat":
        return {"kind": "flat"}
    if chosen == "ivf":
        return {"kind": "ivf", "nlist": max(1, min(int(4 * math.sqrt(n_train)), n_train // 39)), "train_points_per_list": IVF_POINTS_PER_LIST}
    if chosen == "hnsw":
        return {"kind": "hnsw", "neighbours": HNSW_NEIGHBOURS}
    raise ConfigError("candidates.index", f"unknown index {kind!r}", "use auto, flat, ivf or hnsw")


def build_index(features: np.ndarray, kind: IndexKind = "auto", threads: int = 1, metric: Metric = "l2") -> faiss.Index:
    """A FAISS index over the training features, by L2 distance or inner product: exact (flat), inverted lists (IVF),
    or HNSW (built on one thread, since a parallel HNSW build depends on thread timing); see `index_params`."""
    import faiss

    previous = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1 if index_kind(len(features), kind) == "hnsw" else threads)
    try:
        return _build(np.ascontiguousarray(features, dtype=np.float32), kind, metric)
    finally:
        faiss.omp_set_num_threads(previous)


def _build(features: np.ndarray, kind: IndexKind, metric: Metric) -> faiss.Index:
    import faiss

    n, d = features.shape
    params = index_params(n, kind)
    measure = faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2
    if params["kind"] == "flat":
        index = faiss.IndexFlat(d, measure)
    elif params["kind"] == "hnsw":
        index = faiss.IndexHNSWFlat(d, params["neighbours"], measure)
    else:
        index = faiss.IndexIVFFlat(faiss.IndexFlat(d, measure), d, params["nlist"], measure)
        index.cp.max_points_per_centroid = params["train_points_per_list"]
        index.train(features)
    index.add(features)
    return index


def nearest(index: faiss.Index, queries: np.ndarray, k: int, nprobe: int | None = None) -> np.ndarray:
    """Indices (n_queries, k) int64 of each query's k nearest training examples by the index's metric, nearest first;
    always k valid, distinct indices (an approximate index that returns fewer is searched again exhaustively for that
    query).
    IVF probes `nprobe` lists (default: enough to hold about 2k examples, at least 8)."""
    import faiss

    if not 1 <= k <= index.ntotal:
        raise ConfigError("candidates.knn_k", f"knn_k={k} with {index.ntotal} training examples", f"set candidates.knn_k between 1 and {index.ntotal}, or null for all")
    if isinstance(index, faiss.IndexIVF):
        index.nprobe = min(index.nlist, nprobe or max(8, math.ceil(2 * k * index.nlist / index.ntotal)))
    elif isinstance(index, faiss.IndexHNSW):
        index.hnsw.efSearch = max(128, 2 * k)
    _, found = index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
    short = np.flatnonzero((found < 0).any(axis=1))
    if short.size:  # approximate search came back with fewer than k: exact search for those queries
        exact = faiss.IndexFlat(index.d, index.metric_type)
        exact.add(index.reconstruct_n(0, index.ntotal) if not isinstance(index, faiss.IndexIVF) else _ivf_vectors(index))
        _, found[short] = exact.search(np.ascontiguousarray(queries[short], dtype=np.float32), k)
    return found.astype(np.int64)


def _ivf_vectors(index: faiss.IndexIVF) -> np.ndarray:
    index.make_direct_map()
    return index.reconstruct_n(0, index.ntotal)


def knn_candidates(model: nn.Module, x_train: torch.Tensor, x_test: torch.Tensor, k: int, module: str | None = None, index: IndexKind = "auto") -> np.ndarray:
    """Each query's k nearest training examples in the feature space of `module`: (n_test, k) int64."""
    built = build_index(module_features(model, x_train, module), index)
    return nearest(built, module_features(model, x_test, module), k)


def candidate_entries(rows: np.ndarray, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the sorted training rows `rows` occur among `candidates` (n_test, k): query q, rank j, and the row's
    column c in `rows`, so that scores[q, c] is candidate entry (q, j)."""
    position = np.searchsorted(rows, candidates)
    inside = (position < len(rows)) & (rows[np.minimum(position, max(len(rows) - 1, 0))] == candidates) if len(rows) else np.zeros(candidates.shape, bool)
    q, j = np.nonzero(inside)
    return q, j, position[q, j]


def gather_scores(scores: torch.Tensor, rows: np.ndarray, candidates: np.ndarray) -> torch.Tensor:
    """From scores (n_test, len(rows)) of the sorted training rows `rows`, each query's own candidates (n_test, k);
    candidates not among `rows` are NaN."""
    q, j, c = candidate_entries(rows, candidates)
    out = torch.full(candidates.shape, float("nan"), dtype=scores.dtype)
    out[q, j] = scores[torch.from_numpy(q), torch.from_numpy(c)]
    return out


def candidate_influences(
    im: "InfluenceFunctionModel", x_test: torch.Tensor, y_test: torch.Tensor, x: torch.Tensor, y: torch.Tensor, k: int, module: str | None = None, index: IndexKind = "auto"
) -> tuple[np.ndarray, torch.Tensor]:
    """FastIF: candidate indices (n_test, k) and their scores (n_test, k); gradients only of training examples
    that are some query's candidate."""
    candidates = knn_candidates(im.objective.model, x, x_test, k, module, index)
    rows = np.unique(candidates)
    factors = im.influence_factors(x_test, y_test)
    scores = im.influences_from_factors(factors, examples.take(x, torch.from_numpy(rows)), y[torch.from_numpy(rows)])
    return candidates, gather_scores(scores, rows, candidates)
