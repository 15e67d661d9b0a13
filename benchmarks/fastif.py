"""FastIF on our pipeline: how many of the truly most influential training examples the kNN prefilter keeps, how much
faster candidate scoring is than the full computation, and how well fast s_test agrees with exact factors.

    make bench-fastif      (.venv/bin/python benchmarks/fastif.py; writes benchmarks/results/fastif.md and fastif.png)

Two workloads, each through the flow (Prefect test-harness API, a local Dask cluster of 2 single-threaded workers,
one stage cache per workload so data, model and curvature are computed once):
- digits, MLP 64-32-10 (tanh), 1,437 training examples, 100 queries;
- synthetic_classification, 20 features, 4 classes, MLP 20-32-4, 20,000 training examples, 100 queries.
Exact influence is Direct on the Gauss-Newton matrix, λ = 1e-2, self-influence off. Per workload:
1. the full run (all scores) is the reference: the true top-m of each query by score (most helpful);
2. recall R@m(k) = share of the true top-m among the query's k nearest training examples in the penultimate
   layer's feature space (exact kNN), averaged over queries, for a grid of k; k/n is what random candidates give;
3. candidate runs for k ∈ {1e2, 1e3, 1e4} (k < n_train): compute_influences seconds against the full run's;
4. FastIF's Table 3: the candidate run at k = 100 again with fast s_test (LiSSA with small batches, T repeats spread
   over the workers; settings per workload below) against the exact candidate scores: Pearson, Spearman, Kendall
   per query (mean).
Timings are single runs on a shared 2-core machine: read them as ratios of a few, not to the percent.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import kendalltau, pearsonr, spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).parent / "results"
M_VALUES = (1, 10, 100)
EXACT = {"name": "direct", "regularization": 1e-2, "second_order_mode": "gauss_newton"}
LISSA = {"name": "lissa", "regularization": 1e-2, "second_order_mode": "gauss_newton", "rtol": 1e-12}
WORKLOADS: dict[str, dict[str, Any]] = {  # fast: FastIF's s_test settings (J, T, B, scale); scale above the largest single-example curvature
    "digits (MLP 64-32-10)": {
        "base": {"dataset": {"source": "digits", "n_test": 100}, "model": {"hidden": [32]}, "training": {"epochs": 60}},
        "fast": {**LISSA, "depth": 500, "repeats": 8, "lissa_batch_size": 1, "scale": 20.0},
    },
    "synthetic (MLP 20-32-4)": {
        "base": {
            "dataset": {"source": "synthetic_classification", "n_train": 20000, "n_test": 100, "n_features": 20, "n_classes": 4, "chunk_rows": 4096},
            "model": {"hidden": [32]},
            "training": {"epochs": 3, "batch_size": 512},
        },
        "fast": {**LISSA, "depth": 300, "repeats": 4, "lissa_batch_size": 8, "scale": 200.0},
    },
}
K_SPEED = (100, 1000, 10000)


def run(base: dict[str, Any], root: Path, name: str, method: dict[str, Any], knn_k: int | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One flow run; its summary and its arrays."""
    from flows.influence_run import influence_run
    from flows.parameters import RunParameters
    from influence_core.pipeline.store import storage

    config = {
        **base,
        "output_url": str(root / name),
        "method": method,
        "compute": {"cluster": "local", "n_workers": 2},
        "aggregate": {"top_k": 10, "self_influence": "off", "report_queries": 3},
        "candidates": {"knn_k": knn_k},
        "storage": {"cache_url": str(root / "cache")},
    }
    params = RunParameters.model_validate(config)
    summary = influence_run(**params.sections())
    group = storage.open_group(params.store().influence_url, {}, mode="r")
    return summary, {key: np.asarray(group[key][...]) for key in group.array_keys()}


def stored(root: Path, name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The run's trained model and its four data arrays."""
    from influence_core.pipeline.store import storage
    from influence_core.pipeline.store.loading import load_model, open_data
    from influence_core.pipeline.store.publish import stored_refs
    from influence_core.pipeline.store.run_store import RunStore

    store = RunStore(output_url=str(root / name))
    refs = stored_refs(store, storage.open_group(store.influence_url, {}, mode="r").attrs)
    model = load_model(refs["fit_model"], {})  # type: ignore[arg-type]
    arrays = open_data(refs["prepare_data"], {})  # type: ignore[arg-type]
    return model, {key: torch.from_numpy(np.asarray(array[...])) for key, array in arrays.items()}


def best_of(repeats: int, work: Any) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def library_speed(model: torch.nn.Module, data: dict[str, torch.Tensor], ks: list[int]) -> list[dict[str, Any]]:
    """In one process, no cluster and no stage overheads (FastIF's setting: a few queries at a time): seconds of
    the full scores of n_q queries against candidate_influences (features, kNN, candidates' gradients), best of 3."""
    from influence_core import DirectInfluence
    from influence_core.pipeline.score.knn_prefilter import candidate_influences

    x, y = data["x_train"], data["y_train"]
    im = DirectInfluence(model, "cross_entropy", EXACT["regularization"], second_order_mode="gauss_newton").fit((x, y))
    rows = []
    for n_q in (1, 10):
        q = data["x_test"][:n_q], data["y_test"][:n_q]
        full = best_of(3, lambda: im.influences(*q, x, y))
        for k in ks:
            fast = best_of(3, lambda: candidate_influences(im, *q, x, y, k))
            rows.append({"queries": n_q, "k": k, "full_seconds": full, "seconds": fast, "speedup": full / fast})
    return rows


def recall(scores: np.ndarray, knn: np.ndarray, ks: list[int]) -> dict[int, list[float]]:
    """R@m(k) for each m: the share of each query's true top-m (highest scores) among its k nearest, averaged."""
    order = np.argsort(-scores, axis=1)
    out = {}
    for m in M_VALUES:
        top = order[:, :m]
        out[m] = [float(np.mean([np.isin(top[q], knn[q, :k]).mean() for q in range(len(scores))])) for k in ks]
    return out


def agreement(fast: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    """FastIF's Table 3: correlations of fast and exact scores on each query's candidates, averaged over queries."""
    rows = list(zip(fast, exact))
    return {
        "pearson": float(np.mean([pearsonr(a, b)[0] for a, b in rows])),
        "spearman": float(np.mean([spearmanr(a, b)[0] for a, b in rows])),
        "kendall": float(np.mean([kendalltau(a, b)[0] for a, b in rows])),
    }


def stage_seconds(summary: dict[str, Any], stage: str) -> float:
    return float(summary["stages"][stage]["seconds"])


def measure(label: str, base: dict[str, Any], fast_method: dict[str, Any], root: Path) -> dict[str, Any]:
    started = time.perf_counter()
    full_summary, full = run(base, root, "full", EXACT, None)
    scores = full["scores"]
    n_test, n_train = scores.shape
    ks = sorted({k for k in (1, 3, 10, 30, 100, 300, 1000, 3000, 10000) if k < n_train} | {n_train})
    from influence_core.pipeline.score.knn_prefilter import knn_candidates

    model, data = stored(root, "full")
    knn = knn_candidates(model, data["x_train"], data["x_test"], n_train, index="flat")  # exact, nearest first: every k is a prefix
    result: dict[str, Any] = {"label": label, "n_train": n_train, "n_test": n_test, "ks": ks, "recall": recall(scores, knn, ks)}
    result["recall_harmful"] = recall(-scores, knn, ks)
    full_seconds = stage_seconds(full_summary, "compute_influences")
    result["full"] = {"seconds": full_seconds, "factors_seconds": stage_seconds(full_summary, "compute_test_factors"), "gradient_rows": full_summary["stages"]["compute_influences"]["gradient_rows"]}
    speed = []
    exact_at: dict[int, dict[str, np.ndarray]] = {}
    for k in (k for k in K_SPEED if k < n_train):
        summary, arrays = run(base, root, f"k{k}", EXACT, k)
        exact_at[k] = arrays
        stage = summary["stages"]["compute_influences"]
        gathered = np.take_along_axis(scores, arrays["candidate_indices"], 1)
        speed.append(
            {
                "k": k, "seconds": stage["seconds"], "speedup": full_seconds / stage["seconds"], "scored_rows": stage["candidates"]["scored_rows"],
                "feature_seconds": stage["candidates"]["feature_seconds"], "index_seconds": stage["candidates"]["index_seconds"],
                "max_rel_diff_vs_full": float(np.abs(arrays["candidate_scores"] - gathered).max() / np.abs(gathered).max()),
                "topk_recall": float(np.mean([np.isin(arrays["topk_helpful_indices"][q], np.argsort(-scores[q])[:10]).mean() for q in range(n_test)])),
            }
        )
    result["speed"] = speed
    result["library_speed"] = library_speed(model, data, [k for k in K_SPEED if k < n_train])
    from influence_core.errors import NumericalError

    result["table3"] = {"settings": fast_method, "exact_factors_seconds": result["full"]["factors_seconds"]}
    try:
        fast_summary, fast = run(base, root, "fast-k100", fast_method, 100)
    except NumericalError as exc:  # LiSSA diverged: reported, not hidden
        result["table3"]["failed"] = str(exc)
    else:
        exact = exact_at[100]
        assert np.array_equal(fast["candidate_indices"], exact["candidate_indices"])  # same model, same features: the same candidates
        result["table3"].update(
            agreement(fast["candidate_scores"], exact["candidate_scores"]),
            fast_factors_seconds=stage_seconds(fast_summary, "compute_test_factors"),
            scatter=(exact["candidate_scores"].ravel(), fast["candidate_scores"].ravel()),
        )
    result["seconds"] = time.perf_counter() - started
    return result


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colours = {1: "tab:blue", 10: "tab:orange", 100: "tab:green"}
    for r, style in zip(results, ("-", "--")):
        for m in M_VALUES:
            if m <= r["n_train"]:
                axes[0].plot(r["ks"], r["recall"][m], style, marker="o", ms=3, color=colours[m], label=f"{r['label']}: R@{m}")
        axes[0].plot(r["ks"], np.array(r["ks"]) / r["n_train"], style, color="grey", lw=0.8, label=f"{r['label']}: random (k/n)")
        axes[1].plot([s["k"] for s in r["speed"]], [s["speedup"] for s in r["speed"]], style, marker="s", label=f"{r['label']}: pipeline, 100 queries")
        one = [s for s in r["library_speed"] if s["queries"] == 1]
        axes[1].plot([s["k"] for s in one], [s["speedup"] for s in one], style, marker="^", label=f"{r['label']}: library, 1 query")
    axes[0].set(xscale="log", xlabel="k (candidates per query)", ylabel="recall of the true top-m (most helpful)", title="kNN recall R@m against k")
    axes[0].legend(fontsize=6.5)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set(xscale="log", yscale="log", xlabel="k", ylabel="full seconds / candidate seconds", title="speedup of candidate scoring")
    axes[1].legend(fontsize=8)
    for r in results:
        if "scatter" in r["table3"]:
            exact, fast = r["table3"]["scatter"]
            axes[2].scatter(exact, fast, s=3, alpha=0.4, label=f"{r['label']}: Pearson {r['table3']['pearson']:.3f}")
    axes[2].set(xlabel="exact candidate score (Direct)", ylabel="fast s_test candidate score (LiSSA)", title="fast s_test against exact, on the candidates (k = 100)")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(results: list[dict[str, Any]], seconds: float) -> str:
    lines = [
        "# FastIF: kNN candidates and fast s_test, against the full computation",
        "",
        f"`make bench-fastif` (`benchmarks/fastif.py`), measured {time.strftime('%Y-%m-%d')} on the shared 2-core machine in {seconds / 60:.1f} minutes. "
        "Local Dask cluster of 2 single-threaded workers; exact influence = Direct on the Gauss-Newton matrix, λ = 1e-2; features = the penultimate "
        "layer (the tanh activations feeding the last Linear), exact kNN (flat index). Plot: `fastif.png`.",
        "",
    ]
    for r in results:
        lines += [f"## {r['label']}: {r['n_train']:,} training examples, {r['n_test']} queries", "", "### Recall of the true top-m among the k nearest (R@m, mean over queries)", ""]
        header = "| k | " + " | ".join(f"R@{m} helpful" for m in M_VALUES) + " | " + " | ".join(f"R@{m} harmful" for m in M_VALUES) + " | random k/n |"
        lines += [header, "|" + "---|" * (2 + 2 * len(M_VALUES))]
        for i, k in enumerate(r["ks"]):
            cells = [f"{r['recall'][m][i]:.3f}" for m in M_VALUES] + [f"{r['recall_harmful'][m][i]:.3f}" for m in M_VALUES]
            lines.append(f"| {k:,} | " + " | ".join(cells) + f" | {k / r['n_train']:.3f} |")
        full = r["full"]
        lines += [
            "", "### Speed of candidate scoring (compute_influences stage, seconds)", "",
            f"Full computation: {full['seconds']:.2f} s ({full['gradient_rows']:,} per-example gradients). The query factors are computed once either way "
            f"({full['factors_seconds']:.2f} s with Direct).", "",
            "| k | seconds | speedup | training rows scored (gradients) | feature pass s | index + search s | candidates = full scores (max rel. diff) | top-10 helpful = full top-10 (share) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for s in r["speed"]:
            lines.append(
                f"| {s['k']:,} | {s['seconds']:.2f} | {s['speedup']:.2f}× | {s['scored_rows']:,} ({s['scored_rows'] / r['n_train']:.0%}) | {s['feature_seconds']:.2f} | "
                f"{s['index_seconds']:.3f} | {s['max_rel_diff_vs_full']:.1e} | {s['topk_recall']:.3f} |"
            )
        lines += [
            "", "In one process (library, no cluster or stage overheads; Direct factors; features + exact kNN + the candidates' gradients against the full scores; best of 3):", "",
            "| queries | k | full s | candidates s | speedup |", "|---|---|---|---|---|",
            *(f"| {s['queries']} | {s['k']:,} | {s['full_seconds']:.3f} | {s['seconds']:.3f} | {s['speedup']:.1f}× |" for s in r["library_speed"]),
        ]
        t = r["table3"]
        f = t["settings"]
        settings = f"LiSSA B={f['lissa_batch_size']}, J={f['depth']}, T={f['repeats']} over 2 workers, scale {f['scale']:g}"
        lines += ["", "### Fast s_test on the candidates (FastIF's Table 3), k = 100", "", "| fast vs exact (Direct) | Pearson | Spearman | Kendall | query factors s |", "|---|---|---|---|---|"]
        if "failed" in t:
            lines.append(f"| {settings} | diverged: {t['failed']} | | | |")
        else:
            lines.append(f"| {settings} | {t['pearson']:.4f} | {t['spearman']:.4f} | {t['kendall']:.4f} | {t['fast_factors_seconds']:.2f} (Direct: {t['exact_factors_seconds']:.2f}) |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    started = time.perf_counter()
    results = []
    with prefect_test_harness(server_startup_timeout=120), tempfile.TemporaryDirectory(prefix="fastif-") as tmp:
        for i, (label, workload) in enumerate(WORKLOADS.items()):
            results.append(measure(label, workload["base"], workload["fast"], Path(tmp) / str(i)))
            print(f"{label}: {results[-1]['seconds']:.0f} s", flush=True)
            RESULTS.mkdir(exist_ok=True)  # written after each workload: an interrupted run keeps what it measured
            plot(results, RESULTS / "fastif.png")
            (RESULTS / "fastif.md").write_text(report(results, time.perf_counter() - started))
    print((RESULTS / "fastif.md").read_text())


if __name__ == "__main__":
    main()
