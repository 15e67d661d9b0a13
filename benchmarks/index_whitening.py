"""The whitened LoGra index's training side, formed against factored (issue 38): index_training's computation alone
on a workload whose training side is already in a stage cache, in one process, the two paths alternating.

    .venv/bin/python benchmarks/index_whitening.py --cache DIR [--side 64] [--threads 1] [--repeats 2] [--rtols 1e-2 1e-3 1e-4]

DIR is a `storage.cache_url` holding prepare_data, fit_model and fit_preconditioner of a K-FAC/EK-FAC run (W3's is
`benchmarks/index_rerun.py --workloads W3 --queries 20`'s `W3-20-cache`). Each side computes every training row's
index features as an index_training task does (`Scorer.features` with `IndexProjection.training`, batches rotated
into the eigenbasis), without Dask or the store: **formed** (G ∘ D^(-1/2) formed per example, then projected: the
path before the factored one, forced here) and **factored** (the default rule: W's truncated SVD where cheaper).
Prints per cut the rank R chosen and the path, the seconds of each side, and against the formed rows: the factored
rows' relative error, and the scores of the run's queries (Pearson, recall@10 helpful/harmful, each against the
uncompressed EK-FAC scores too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from pydantic import TypeAdapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from influence_core import examples, index_projection  # noqa: E402
from influence_core.methods.scorer import Scorer  # noqa: E402
from influence_core.pipeline.specs import MethodSpec, StorageSpec  # noqa: E402
from influence_core.pipeline.store.loading import index_projection as build_projection, load_influence_model, open_data  # noqa: E402
from influence_core.pipeline.store.refs import DataRef, ModelRef, StageRef  # noqa: E402
from influence_core.pipeline.store.run_store import RunStore  # noqa: E402


def manifest(cache: Path, stage: str) -> dict[str, Any]:
    """The latest manifest of `stage` in the cache (prepare_data: the last run's queries)."""
    found = [json.loads(path.read_text()) for path in (cache / stage).glob("*/manifest.json")]
    assert found, f"no {stage} in {cache}"
    return max(found, key=lambda m: m["output"]["created_at"])


def recall(a: np.ndarray, b: np.ndarray, k: int = 10) -> float:
    """Mean share of each row's top k of `b` found in its top k of `a`."""
    top = lambda s: np.argsort(-s, axis=1, kind="stable")[:, :k]  # noqa: E731
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(top(a), top(b))]))


def agreement(got: np.ndarray, want: np.ndarray) -> str:
    return f"Pearson {np.corrcoef(got.ravel(), want.ravel())[0, 1]:.6f}, recall@10 {recall(got, want):.3f} / {recall(-got, -want):.3f}"


def index_rows(im: Any, x: Any, y: torch.Tensor, projection: Any, formed: bool) -> tuple[torch.Tensor, float]:
    """Every training row's index features and the seconds they took; `formed`: the formed path forced."""
    with mock.patch.object(index_projection, "factored_is_cheaper", lambda *args: False) if formed else contextlib.nullcontext():
        start = time.perf_counter()
        rows = Scorer(im, None, None).features(x, y, projection.training)[0]
        return rows, time.perf_counter() - start


def cached_run(cache: Path) -> tuple[Any, DataRef, Any, torch.Tensor, Any, torch.Tensor]:
    """The cache's fitted influence model, its data, and the training and query rows: (im, data, x, y, xq, yq)."""
    store = RunStore(output_url=str(cache), storage=StorageSpec(cache_url=str(cache)))  # manifests record "{cache}/..."
    data = DataRef.model_validate(manifest(cache, "prepare_data")["output"]).moved(store.resolve)
    model = ModelRef.model_validate(manifest(cache, "fit_model")["output"]).moved(store.resolve)
    curvature = manifest(cache, "fit_preconditioner")
    method = TypeAdapter(MethodSpec).validate_python(curvature["arguments"]["method"])
    im = load_influence_model(method, model, data, StageRef.model_validate(curvature["output"]).moved(store.resolve), {})
    arrays = open_data(data, {})
    x, y = examples.read(arrays["x_train"]), torch.as_tensor(np.asarray(arrays["y_train"][:]))
    xq, yq = examples.read(arrays["x_test"]), torch.as_tensor(np.asarray(arrays["y_test"][:]))
    return im, data, x, y, xq, yq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rtols", nargs="+", type=float, default=[1e-2, 1e-3, 1e-4])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    im, data, x, y, xq, yq = cached_run(args.cache)
    projection = build_projection(im, data, {}, args.side)
    print(f"{data.n_train:,} training rows, {len(yq)} queries, side {args.side}, {args.threads} thread(s), whitening_rtol {projection.whitening_rtol:g}")
    for cut in projection.split.cuts:
        start = time.perf_counter()
        rank = len(projection.whitening(cut)[0])  # the SVD and its rank, once per cut (per worker in the stage)
        factored = index_projection.factored_is_cheaper(rank, cut.shape, projection.sides(cut), 1)
        print(f"  cut {cut.name}: {cut.shape[0]} × {cut.shape[1]}, sides {projection.sides(cut)}, R = {rank} of {min(cut.shape)}, {'factored' if factored else 'formed'} (one position); SVD and rank {time.perf_counter() - start:.2f} s")
    seconds: dict[str, list[float]] = {"formed": [], "factored": []}
    rows: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for side in ("formed", "factored"):
            rows[side], took = index_rows(im, x, y, projection, side == "formed")
            seconds[side].append(took)
            print(f"  {side}: {took:.2f} s", flush=True)
    formed, factored = rows["formed"].double(), rows["factored"].double()
    errors = (factored - formed).norm(dim=1) / formed.norm(dim=1)
    print(f"seconds formed {seconds['formed']}, factored {seconds['factored']}: {np.median(seconds['formed']) / np.median(seconds['factored']):.2f}× (medians)")
    print(f"factored rows against formed: relative error max {errors.max():.2e}, median {errors.median():.2e}")
    flat = im.influence_factors(xq, yq)
    queries = projection.factors(flat).double()
    exact = im.influences_from_factors(flat, x, y).double().numpy()
    scores = {side: (queries @ r.double().T).numpy() for side, r in (("formed", formed), ("factored", factored))}
    print(f"scores, factored against formed: {agreement(scores['factored'], scores['formed'])}, max |Δ| / max |s| {np.abs(scores['factored'] - scores['formed']).max() / np.abs(scores['formed']).max():.2e}")
    for side, got in scores.items():
        print(f"scores, {side} against uncompressed EK-FAC: {agreement(got, exact)}")
    for rtol in args.rtols:
        other = index_projection.IndexProjection(projection.split, projection.order, args.side, projection.seed, projection.damped, rtol)
        got, took = index_rows(im, x, y, other, False)
        ranks = [len(other.whitening(cut)[0]) for cut in other.split.cuts]
        errors = (got.double() - formed).norm(dim=1) / formed.norm(dim=1)
        print(f"  whitening_rtol {rtol:g}: R {ranks}, {took:.2f} s, rows' relative error max {errors.max():.2e}, median {errors.median():.2e}; "
              f"scores against formed: {agreement((queries @ got.double().T).numpy(), scores['formed'])}", flush=True)


if __name__ == "__main__":
    main()
