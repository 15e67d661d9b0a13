"""Re-ranking over a compressed index (issue 53), measured: what it costs (gradient rows and seconds, against the
index's full pass) and what it buys (recall@10 of the uncompressed method's top 10).

    .venv/bin/python benchmarks/index_rerank.py w3 [--queries 20 500] [--out DIR]
    .venv/bin/python benchmarks/index_rerank.py scale [--rows 1000000] [--queries 100] [--out DIR]

w3: W3 of benchmarks/index_rerun.py (MLP 100-1024-1024-10, 1.16 M parameters, 5,000 rows, EK-FAC) with top_k 10 and
every index default (index_side auto, the probe, re-ranking at 8 × top_k a side), one run per query count in a shared
stage cache, on a local 2-worker cluster. The uncompressed scores come from the library (`influences`, the captures
contracted with the queries' exact factors, in blocks of queries): recall@10 of the run's re-ranked top 10 and of
the compressed scores' own top 10 against them. scale: a 1,000,000-row training index (synthetic 16-feature
classification, a linear model, EK-FAC, index_budget_gb 0.1, so auto compresses it), built by one run; then one
question of 100 new queries in this process, with re-ranking and without: the candidates' gradient rows and
seconds against the index pass's. Writes benchmarks/results/index_rerank_{w3,scale}.md (runs and caches under DIR).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import TypeAdapter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.index_rerun import workload  # noqa: E402
from flows.influence_run import influence_run  # noqa: E402
from flows.parameters import RunParameters  # noqa: E402
from influence_core import examples  # noqa: E402
from influence_core.pipeline.score.query import answer  # noqa: E402
from influence_core.pipeline.specs import MethodSpec  # noqa: E402
from influence_core.pipeline.store import storage  # noqa: E402
from influence_core.pipeline.store.loading import load_influence_model, open_data  # noqa: E402
from influence_core.pipeline.store.publish import stored_refs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
QUERY_BLOCK = 50  # queries whose exact factors are held at once (W3: 50 × 1.16 M floats)


def recall(got: np.ndarray, want: np.ndarray) -> float:
    """Mean share of each row of `want` (indices) found in the same row of `got`."""
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(got, want)]))


def exact_scores(params: RunParameters) -> np.ndarray:
    """The uncompressed method's scores (n_test, n_train) of a finished run's queries, from the library."""
    store = params.store()
    refs = stored_refs(store, storage.open_group(store.influence_url, store.options, mode="r").attrs)
    method = TypeAdapter(MethodSpec).validate_python(params.method.model_dump(mode="json"))
    im = load_influence_model(method, refs["fit_model"], refs["prepare_data"], refs["fit_preconditioner"], store.options)  # type: ignore[arg-type]
    arrays = open_data(refs["prepare_data"], store.options)  # type: ignore[arg-type]
    x, y = examples.read(arrays["x_train"]), examples.read(arrays["y_train"])
    xq, yq = examples.read(arrays["x_test"]), examples.read(arrays["y_test"])
    blocks = [im.influences(examples.take(xq, slice(lo, lo + QUERY_BLOCK)), yq[lo : lo + QUERY_BLOCK], x, y).double().numpy() for lo in range(0, len(yq), QUERY_BLOCK)]
    return np.concatenate(blocks)


def run_w3(n_test: int, out: Path, cache: Path) -> dict[str, Any]:
    """One W3 run at the defaults (top 10): its summary, and recall@10 of its top 10 against the uncompressed ones."""
    config = workload("W3", False, n_test)
    config["aggregate"]["top_k"] = 10
    shutil.rmtree(out, ignore_errors=True)
    params = RunParameters.model_validate({**config, "output_url": str(out), "storage": {"cache_url": str(cache)}})
    start = time.perf_counter()
    summary = influence_run(**params.sections())
    wall = time.perf_counter() - start
    group = storage.open_group(params.store().influence_url, {}, mode="r")
    exact = exact_scores(params)
    top = lambda s, sign: np.argsort(-sign * s, axis=1, kind="stable")[:, :10]  # noqa: E731
    compressed = np.asarray(group["scores"][...])
    found = {
        "reranked": {kind: recall(np.asarray(group[f"topk_{kind}_indices"][...]), top(exact, sign)) for kind, sign in (("helpful", 1), ("harmful", -1))},
        "compressed": {kind: recall(top(compressed, sign), top(exact, sign)) for kind, sign in (("helpful", 1), ("harmful", -1))},
    }
    return {"n_test": n_test, "wall": wall, "summary": summary, "recall": found}


def w3_report(results: list[dict[str, Any]]) -> str:
    lines = [
        "# Re-ranking over W3's compressed index", "",
        "`benchmarks/index_rerank.py w3`: W3 (MLP 100-1024-1024-10, 1.16 M parameters, 5,000 rows, EK-FAC), top_k 10, every index default",
        "(index_side auto, the probe, 8 × top_k = 80 candidates a side), local 2-worker cluster, one stage cache. Recall@10: the share of",
        "each query's uncompressed top 10 (the library's exact EK-FAC scores) in the run's top 10.", "",
        "| queries | side | probe recall@10 h / h, Pearson (cost) | recall@10 compressed h / h | recall@10 re-ranked h / h | re-rank gradient rows (of 5,000) | re-rank s | exact factors s | index pass s (gradient rows) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        stages = r["summary"]["stages"]
        index, rerank = stages["index_training"], stages["rerank"]
        probe = index.get("probe") or {}
        cost = f"{probe.get('seconds', 0):.1f} s, {probe.get('share') or 0:.0%}" if probe else ""
        probe_cell = f"{probe['recall_at_10']['helpful']:.2f} / {probe['recall_at_10']['harmful']:.2f}, {probe['pearson']:.3f} ({cost})" if probe else "—"
        seconds = lambda stage: stage["seconds"] if stage["outcome"] == "computed" else stage["wall_seconds"]  # noqa: E731
        lines.append(
            f"| {r['n_test']} | {index.get('side')} | {probe_cell} | {r['recall']['compressed']['helpful']:.3f} / {r['recall']['compressed']['harmful']:.3f} "
            f"| {r['recall']['reranked']['helpful']:.3f} / {r['recall']['reranked']['harmful']:.3f} | {rerank['gradient_rows']:,} | {seconds(rerank):.1f} "
            f"| {seconds(stages['compute_test_factors (exact)']):.1f} | {index['seconds']:.1f} ({index['gradient_rows']:,}, {index['outcome']}) |"
        )
    return "\n".join(lines) + "\n"


def build_scale(out: Path, rows: int) -> dict[str, Any]:
    """The run that writes the 1,000,000-row compressed index; its summary."""
    config = {
        "output_url": str(out / "run"), "dataset": {"source": "synthetic_classification", "n_features": 16, "n_classes": 10, "n_train": rows, "n_test": 10, "chunk_rows": 65536},
        "model": {"architecture": "linear"}, "training": {"epochs": 1, "batch_size": 1024},
        "method": {"name": "ekfac", "regularization": 1e-3, "fisher": "sampled", "batch_size": 4096}, "compute": {"cluster": "local", "n_workers": 2, "index_budget_gb": 0.1},
        "aggregate": {"top_k": 5, "self_influence": "off"}, "overwrite": True,
    }
    return influence_run(**RunParameters.model_validate(config).sections())


def ask_scale(out: Path, queries: int, rerank: int | None) -> dict[str, Any]:
    """One question of `queries` new queries against the built run, in this process: seconds and work."""
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((queries, 16)).astype(np.float32), rng.integers(0, 10, queries)
    store = RunParameters.model_validate({"output_url": str(out / "run")}).store()
    start = time.perf_counter()
    found = answer(store, torch.from_numpy(x), y, 5, rerank=rerank)
    return {"seconds": time.perf_counter() - start, "gradient_rows": found.work.gradient_rows, "rerank": found.search.get("rerank")}


def scale_report(summary: dict[str, Any], rows: int, with_rerank: dict[str, Any], without: dict[str, Any]) -> str:
    index, stages = summary["stages"]["index_training"], summary["stages"]
    extra_rows = with_rerank["gradient_rows"] - without["gradient_rows"]
    extra_seconds = with_rerank["seconds"] - without["seconds"]
    rerank = stages.get("rerank", {})
    return "\n".join([
        f"# Re-ranking over a {rows:,}-row compressed index", "",
        "`benchmarks/index_rerank.py scale`: synthetic 16-feature classification, a linear model (170 parameters), EK-FAC, index_budget_gb 0.1:",
        f"index_side auto took side {index.get('side')} ({index.get('dim')} of {index.get('exact_dim')} numbers a row). The index pass (the full pass: {index['gradient_rows']:,} gradient rows) took {index['seconds']:.1f} s;",
        f"its probe: {json.dumps({k: index['probe'].get(k) for k in ('recall_at_10', 'pearson', 'seconds', 'share')})}.", "",
        "| | seconds | gradient rows | share of the full pass (rows / seconds) |", "|---|---|---|---|",
        f"| the build run's rerank stage ({summary['n_test']} queries) | {rerank.get('seconds', 0):.2f} | {rerank.get('gradient_rows', 0):,} | {rerank.get('gradient_rows', 0) / index['gradient_rows']:.3%} / {rerank.get('seconds', 0) / index['seconds']:.2%} |",
        f"| question, 100 queries, --rerank 0 | {without['seconds']:.2f} | {without['gradient_rows']:,} | |",
        f"| question, 100 queries, re-ranked ({with_rerank['rerank']['per_side']} a side, {with_rerank['rerank']['rows']:,} candidate rows) | {with_rerank['seconds']:.2f} | {with_rerank['gradient_rows']:,} | {extra_rows / index['gradient_rows']:.3%} / {extra_seconds / index['seconds']:.2%} (the difference) |",
    ]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("w3", "scale"))
    parser.add_argument("--queries", nargs="+", type=int)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / ".scratch" / "index_rerank")
    parser.add_argument("--reuse", action="store_true", help="scale: ask the run already built under --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "w3":
        cache = args.out / "W3-cache"
        results = []
        for n in args.queries or [20, 500]:
            results.append(run_w3(n, args.out / f"W3-{n}", cache))
            text = w3_report(results)
            print(text, flush=True)
            (RESULTS / "index_rerank_w3.md").write_text(text)
        return
    summary = json.loads((args.out / "run" / "summary.json").read_text()) if args.reuse else build_scale(args.out, args.rows)
    queries = (args.queries or [100])[0]
    without = ask_scale(args.out, queries, 0)
    with_rerank = ask_scale(args.out, queries, None)
    text = scale_report(summary, args.rows, with_rerank, without)
    print(text, flush=True)
    (RESULTS / "index_rerank_scale.md").write_text(text)


if __name__ == "__main__":
    main()
