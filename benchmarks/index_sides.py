"""The compressed (LoGra, whitened) index's quality at a workload's own scale, side by side: for each index side,
the index rows' dimension, bytes and seconds, and its scores against the uncompressed method's (issue 38).

    .venv/bin/python benchmarks/index_sides.py --cache DIR [--queries 100] [--sides 64 128 256] [--threads 1]

DIR is a `storage.cache_url` holding a K-FAC/EK-FAC run's training side (`benchmarks/index_rerun.py --workloads W3`'s
`W3-500-cache`). The uncompressed scores come from the library (`influences`, the captures contracted with the
queries' factors: no p-wide index is stored); each side's rows are index_training's (`IndexProjection.training`,
stored as float16) and its queries compute_test_factors' (`IndexProjection.queries`). Prints Pearson and recall@10
of the helpful and harmful top 10 against the uncompressed scores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.index_whitening import agreement, cached_run  # noqa: E402
from influence_core import examples  # noqa: E402
from influence_core.methods.scorer import Scorer  # noqa: E402
from influence_core.pipeline.store.loading import index_projection  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--sides", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    im, data, x, y, xq, yq = cached_run(args.cache)
    xq, yq = examples.take(xq, slice(0, args.queries)), yq[: args.queries]
    start = time.perf_counter()
    exact = im.influences(xq, yq, x, y).double().numpy()
    print(f"{data.n_train:,} training rows, {len(yq)} queries; uncompressed scores {time.perf_counter() - start:.1f} s", flush=True)
    for side in args.sides:
        projection = index_projection(im, data, {}, side)
        start = time.perf_counter()
        rows = Scorer(im, None, None).features(x, y, projection.training)[0].to(torch.float16).double()
        took = time.perf_counter() - start
        got = (projection.queries(im, xq, yq).double() @ rows.T).numpy()
        print(f"side {side}: dim {projection.dim:,}, {2 * projection.dim:,} B/row, index rows {took:.1f} s; against uncompressed: {agreement(got, exact)}", flush=True)


if __name__ == "__main__":
    main()
