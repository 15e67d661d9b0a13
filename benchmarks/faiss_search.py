"""recall@10 and seconds of a question's FAISS search (`query --search faiss`) against the exact scan, over the
training index that benchmarks/index_scale.py builds (1,000,000 rows of 170 float32 numbers by default).

    .venv/bin/python benchmarks/faiss_search.py [--out DIR] [--reuse] [--rows 1000000] [--queries 100] [--nprobe 64 1000] [--hnsw]

The queries are index_scale.py's (seeded Gaussian inputs, random labels); their factors are solved once. The exact scan
(`query.scan_top_k`) is timed after one untimed pass, so both read the index from the page cache. Each FAISS index is
built by a first question (build seconds: reading the index, building, writing it beside the index) and then asked
again, once per nprobe (load seconds: reading the kept file; search seconds: both sides' FAISS searches and the exact
scoring of the candidates). recall@10 is the share of each query's exact top 10 that the FAISS answer holds, helpful
and harmful apart. HNSW is built on one thread (as knn_prefilter builds it), so it is measured only with --hnsw.
Writes DIR/faiss_search.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.index_scale import ROOT, build  # noqa: E402
from influence_core import examples  # noqa: E402
from influence_core.pipeline.score import query  # noqa: E402
from influence_core.pipeline.specs import SearchSpec, StorageSpec  # noqa: E402
from influence_core.pipeline.store.run_store import RunStore  # noqa: E402
from influence_core.work import Work  # noqa: E402

K = 10


def recall(exact: np.ndarray, found: np.ndarray) -> float:
    """Mean over queries of the share of the exact top-k that `found` holds."""
    return float(np.mean([len(set(e) & set(f)) / len(e) for e, f in zip(exact, found)]))


def timed_faiss(asked: query.Question, search: SearchSpec, options: dict) -> tuple[dict, dict, float]:
    """The FAISS answer's arrays, its recorded search, and the seconds spent searching and scoring (the whole call
    less building or loading the FAISS index)."""
    start = time.perf_counter()
    arrays, described = query.faiss_top_k(asked.index, asked.factors, K, search, options, Work())
    return arrays, described, time.perf_counter() - start - described["seconds"]


def row(name: str, described: dict, built: float, searched: float, arrays: dict, exact: dict) -> str:
    """One line of the table."""
    settings = ", ".join(f"{key} {described[key]}" for key in ("nlist", "nprobe", "neighbours", "ef_search") if key in described)
    recalls = [recall(exact[f"topk_{side}_indices"], arrays[f"topk_{side}_indices"]) for side in ("helpful", "harmful")]
    return f"| {name} | {settings or '—'} | {built:.2f} | {described['seconds']:.2f} | {searched:.3f} | {recalls[0]:.3f} | {recalls[1]:.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / ".scratch" / "index_scale")
    parser.add_argument("--reuse", action="store_true", help="ask the run already built under --out (by this script or index_scale.py)")
    parser.add_argument("--nprobe", type=int, nargs="*", default=[64, 1000], help="IVF probes to measure besides the default (1/16 of the lists)")
    parser.add_argument("--hnsw", action="store_true", help="also build and measure HNSW (one thread: minutes at 1,000,000 rows)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.reuse:
        build(args.out, args.rows)
    store = RunStore(output_url=str(args.out / "run"), storage=StorageSpec())
    rng = np.random.default_rng(1)  # index_scale.py's queries
    x, y = examples.read(rng.standard_normal((args.queries, 16)).astype(np.float32)), rng.integers(0, 10, args.queries)
    asked = query.solve(store, x, y, K)
    shutil.rmtree(Path(asked.index.url).parent / "faiss", ignore_errors=True)  # every build below is measured
    query.scan_top_k(asked.index, asked.factors, K, store.options, Work())
    start = time.perf_counter()
    exact = query.scan_top_k(asked.index, asked.factors, K, store.options, Work())
    scan = time.perf_counter() - start
    lines = []
    kinds = [("flat", [None]), ("ivf", [None, *args.nprobe])] + ([("hnsw", [None])] if args.hnsw else [])
    for kind, probes in kinds:
        _, first, _ = timed_faiss(asked, SearchSpec(kind="faiss", index=kind), store.options)
        for nprobe in probes:
            arrays, described, searched = timed_faiss(asked, SearchSpec(kind="faiss", index=kind, nprobe=nprobe), store.options)
            lines.append(row(kind, described, first["build_seconds"], searched, arrays, exact))
    rows, dim = asked.index.shape
    text = "\n".join([
        f"# FAISS search against the exact scan: {rows:,} rows of {dim} numbers, {args.queries} queries, top {K}", "",
        f"Exact scan (`query.scan_top_k`, page cache warm): {scan:.2f} s.", "",
        "| FAISS index | parameters | build s (once) | load s (per question) | search s | recall@10 helpful | recall@10 harmful |",
        "|---|---|---|---|---|---|---|", *lines,
    ]) + "\n"
    (args.out / "faiss_search.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
