"""A question's FAISS search: an inner-product index over a run's stored training index, for indexes too large to scan
per question.

The first question that asks for it builds it from the stored vectors (read chunk by chunk) and keeps it beside the
training index in the stage store (local or s3://), keyed by the index's fingerprint and content digest and the
FAISS index's own parameters (a rebuilt index, or one repaired after damage, never meets a FAISS index built from
other rows); later questions load it, its bytes checked against their sha256. Its searches give each query's candidate rows for its largest scores and, with
the negated query factors, for its smallest; `query.py` scores the candidates exactly.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr

from ..specs import SearchSpec
from ..store import integrity, storage
from ..store.refs import IndexRef
from .knn_prefilter import build_index, index_params, nearest

if TYPE_CHECKING:  # faiss loads when an index is built or read
    import faiss

FORMAT = 1  # what a cached file holds; a change makes new keys, so files of another format are never read
PROBED_FRACTION = 16  # an IVF index probes 1/16 of its lists unless search.nprobe says otherwise (at least MIN_PROBES)
MIN_PROBES = 8


@dataclass
class FaissIndex:
    """A FAISS index over a training index, where it is kept, what it is, and whether this question built it."""

    index: faiss.Index
    url: str
    params: dict[str, Any]
    built: bool
    seconds: float  # building and storing it, or loading it
    build_seconds: float  # when it was built, by this question or an earlier one


def cache_url(index: IndexRef, params: dict[str, Any]) -> str:
    """Where the FAISS index with `params` over `index` is kept: in its stage folder, keyed by both."""
    key = hashlib.sha256(json.dumps({"index": index.identity, "format": FORMAT, **params}, sort_keys=True).encode()).hexdigest()[:24]
    return storage.join(posixpath.dirname(index.url), "faiss", f"{key}.faiss")


def open_index(index: IndexRef, search: SearchSpec, options: dict[str, Any], threads: int) -> FaissIndex:
    """The inner-product index over `index`'s stored vectors: loaded when a question kept it before, else built
    (on `threads` threads) and kept."""
    features = storage.open_array(index.array("features"), options)
    params = {"metric": "ip", **index_params(features.shape[0], search.index)}
    url = cache_url(index, params)
    start = time.perf_counter()
    loaded = _load(url, options)
    if loaded is not None:
        return FaissIndex(loaded[0], url, params, False, time.perf_counter() - start, loaded[1])
    built = build_index(_vectors(features), search.index, threads, metric="ip")
    if params["kind"] == "ivf":
        built.make_direct_map()  # candidates' vectors are read back from the index to score them exactly
    seconds = time.perf_counter() - start
    _store(url, built, {"index": index.identity, "params": params, "build_seconds": round(seconds, 3)}, options)
    return FaissIndex(built, url, params, True, time.perf_counter() - start, seconds)


def _vectors(features: zarr.Array) -> np.ndarray:
    """The stored rows as one float32 array, read a chunk at a time."""
    out = np.empty(features.shape, dtype=np.float32)
    step = features.chunks[0]
    for lo in range(0, features.shape[0], step):
        out[lo : lo + step] = features[lo : lo + step]
    return out


def _store(url: str, built: faiss.Index, manifest: dict[str, Any], options: dict[str, Any]) -> None:
    """The serialized index with its sha256, then its manifest (what it is), written last: a file without one is
    never read."""
    import faiss

    integrity.write_checked(url, faiss.serialize_index(built).tobytes(), options)
    storage.write_json(_manifest_url(url), manifest, options)


def _load(url: str, options: dict[str, Any]) -> tuple[faiss.Index, float] | None:
    """The kept index and how long it took to build, or None when it is absent, incomplete or damaged (it is then
    built again)."""
    import faiss

    try:
        manifest = storage.read_json(_manifest_url(url), options)
        raw = integrity.read_checked(url, options, "--search", "")
    except (FileNotFoundError, ValueError):  # DamagedError is a ValueError
        return None
    return faiss.deserialize_index(np.frombuffer(raw, dtype=np.uint8)), float(manifest["build_seconds"])


def _manifest_url(url: str) -> str:
    return url.removesuffix(".faiss") + ".json"


def candidates(found: FaissIndex, factors: np.ndarray, k: int, nprobe: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Each query's k candidate rows (n_queries, k) for its largest scores, and for its smallest (the negated
    factors' largest inner products)."""
    probes = max(MIN_PROBES, found.params["nlist"] // PROBED_FRACTION) if found.params["kind"] == "ivf" and nprobe is None else nprobe
    return nearest(found.index, factors, k, probes), nearest(found.index, -factors, k, probes)


def vectors(found: FaissIndex, rows: np.ndarray) -> np.ndarray:
    """The vectors (float32) of `rows` (any shape of row numbers) as the FAISS index holds them: shape rows.shape + (d,)."""
    return found.index.reconstruct_batch(np.ascontiguousarray(rows.ravel(), dtype=np.int64)).reshape(*rows.shape, found.index.d)


def describe(found: FaissIndex, per_query: int) -> dict[str, Any]:
    """The search as the answer records it: the index, its parameters and search settings, where it is kept, and
    whether this question built it or loaded it."""
    import faiss

    settings: dict[str, Any] = {}
    if isinstance(found.index, faiss.IndexIVF):
        settings["nprobe"] = int(found.index.nprobe)
    elif isinstance(found.index, faiss.IndexHNSW):
        settings["ef_search"] = int(found.index.hnsw.efSearch)
    return {
        "kind": "faiss", "index": found.params["kind"], **{k: v for k, v in found.params.items() if k != "kind"}, **settings,
        "candidates_per_query": per_query, "url": found.url, "built": found.built, "seconds": round(found.seconds, 3), "build_seconds": round(found.build_seconds, 3),
    }
