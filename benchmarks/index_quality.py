"""The compressed training index against the exact one, on the LDS problems (logistic regression, MLP, CNN on digits):
how much of each query's exact top 10 helpful and harmful training examples a LoGra-compressed EK-FAC index keeps,
the Pearson correlation of all scores, and the LDS of both against the 64 retrained half-subset models, at three sides.
Then where compression bites, through the pipeline itself: the digits MLP 64-1024-1024-10 (issue 53) uncompressed, at
side 64, at index_side auto, and at auto with re-ranking, each run's own LDS over 32 retrained halves.

    .venv/bin/python benchmarks/index_quality.py [--sides 16 32 64] [--problem NAME ...] [--wide-only | --no-wide]

The models are the LDS problems' (benchmarks/datamodels.py: 1,000 training rows, 100 queries, float64, trained once
and cached under benchmarks/.scratch/lds, with the subset models' query losses, retrained on a 2-worker LocalCluster
on first use). EK-FAC at λ = 1e-3, scored exactly and through `IndexProjection` (whitened in its eigenbasis, as
index_training compresses it). The wide MLP's four runs share a stage cache under benchmarks/.scratch/index_quality
(its model, curvature and retrained halves are computed once), on a local 2-worker cluster. Writes
benchmarks/results/index_quality.md (the wide MLP's part: index_quality_wide.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zarr

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks", ROOT / "benchmarks" / "peers"):
    sys.path.insert(0, str(path))

import datamodels as dm  # noqa: E402
from common import load_workload  # noqa: E402

from influence_core import EkfacInfluence  # noqa: E402
from influence_core.contraction import gradient_batch  # noqa: E402
from influence_core.index_projection import IndexProjection  # noqa: E402
from influence_core.lds import linear_datamodeling_score  # noqa: E402

LAMBDA = dm.WEIGHT_DECAY


def recall(a: np.ndarray, b: np.ndarray, k: int = 10) -> float:
    """Mean share of each row's top k of `b` found in its top k of `a`."""
    top = lambda s: np.argsort(-s, axis=1, kind="stable")[:, :k]  # noqa: E731
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(top(a), top(b))]))


def compressed_scores(im: EkfacInfluence, x: torch.Tensor, y: torch.Tensor, xq: torch.Tensor, yq: torch.Tensor, side: int) -> tuple[np.ndarray, int]:
    """Scores through the compressed index: projected whitened factors against projected whitened training rows."""
    split = im.gradient_split(x, y)
    damped = {layer.name: im.solvers[layer.block].damped(im.objective.space.dtype) for layer in im.layers}
    projection = IndexProjection(split, im.row_order, side, seed=0, damped=damped)
    rows = torch.cat([projection.training(im.to_basis(gradient_batch(split, x[lo : lo + 250], y[lo : lo + 250], im.work))) for lo in range(0, len(y), 250)])
    factors = projection.factors(im.influence_factors(xq, yq))
    return (factors @ rows.T).numpy(), projection.dim


WIDE = {  # issue 53's digits problem: 1,000 rows, MLP 64-1024-1024-10, 30 epochs at lr 1e-3 decaying linearly, λ 1e-3
    "dataset": {"source": "digits", "n_train": 1000, "n_test": 100},
    "model": {"architecture": "mlp", "hidden": [1024, 1024]},
    "training": {"epochs": 30, "learning_rate": 1e-3, "lr_decay": "linear"},
    "method": {"name": "ekfac", "regularization": 1e-3},
    "aggregate": {"top_k": 10, "self_influence": "off"},
    "validation": {"subsets": 32, "queries": 100},
}
WIDE_SIDES = {  # label: compute and aggregate overrides
    "uncompressed": ({"index_budget_gb": 0}, {}),
    "side 64": ({"index_side": 64}, {"rerank": 0}),
    "auto": ({}, {"rerank": 0}),
    "auto + re-ranking (the defaults)": ({}, {}),
}


def wide_mlp() -> list[str]:
    """The wide digits MLP through the pipeline at each index setting: LDS (its validate stage, 32 halves), recall@10
    of the uncompressed run's top 10 and Pearson of the scores against it, the side and the index stage's seconds."""
    from flows.influence_run import influence_run
    from flows.parameters import RunParameters

    scratch = ROOT / "benchmarks" / ".scratch" / "index_quality"
    runs = {}
    for label, (compute, aggregate) in WIDE_SIDES.items():
        config = {**WIDE, "output_url": str(scratch / label.split(" ")[0].replace("+", "")), "overwrite": True, "storage": {"cache_url": str(scratch / "cache")},
                  "compute": {"cluster": "local", "n_workers": 2, **compute}, "aggregate": {**WIDE["aggregate"], **aggregate}}
        params = RunParameters.model_validate(config)
        summary = influence_run(**params.sections())
        group = zarr.open_group(params.store().influence_url, mode="r")
        runs[label] = (summary, {name: np.asarray(group[name][...]) for name in ("scores", "topk_helpful_indices", "topk_harmful_indices")})
        print(label, summary["validation"]["lds_mean"], flush=True)
    exact = runs["uncompressed"][1]
    lines = [
        "## Where compression bites: the digits MLP 64-1024-1024-10, through the pipeline", "",
        "`benchmarks/index_quality.py` (its wide part): digits, 1,000 training rows, 100 queries, MLP 64-1024-1024-10 (1.12 M parameters), 30",
        "epochs at lr 1e-3 decaying linearly, EK-FAC at λ 1e-3, top_k 10; each run's own LDS (validate: 32 retrained halves, all 100 queries),",
        "the four runs in one stage cache (the model, curvature and halves computed once). Recall@10: the share of the uncompressed run's top 10",
        "in the run's top 10; Pearson over all scores against the uncompressed run's. The exact index would need 4.5 GB (the budget is 1 GB).", "",
        "| index | side | probe recall@10 h / h, Pearson | recall@10 helpful | recall@10 harmful | Pearson | LDS (± s.e.) | LDS / uncompressed | index_training s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    truth = runs["uncompressed"][0]["validation"]["lds_mean"]
    for label, (summary, arrays) in runs.items():
        index = summary["stages"].get("index_training", {})
        probe = index.get("probe") or {}
        probed = f"{probe['recall_at_10']['helpful']:.2f} / {probe['recall_at_10']['harmful']:.2f}, {probe['pearson']:.3f}" if probe else "—"
        validation = summary["validation"]
        lines.append(
            f"| {label} | {index.get('side') or '—'} | {probed} | {recall_rows(arrays['topk_helpful_indices'], exact['topk_helpful_indices']):.2f} | {recall_rows(arrays['topk_harmful_indices'], exact['topk_harmful_indices']):.2f} "
            f"| {np.corrcoef(arrays['scores'].ravel(), exact['scores'].ravel())[0, 1]:.3f} | {validation['lds_mean']:.3f} ± {validation['lds_stderr']:.3f} | {validation['lds_mean'] / truth:.3f} "
            f"| {index.get('seconds', 0):.1f} |"
        )
    return lines


def recall_rows(got: np.ndarray, want: np.ndarray) -> float:
    """Mean share of each row of `want` (indices) in the same row of `got`."""
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(got, want)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", nargs="+", type=int, default=[16, 32, 64])
    parser.add_argument("--problem", action="append", choices=list(dm.PROBLEMS))
    parser.add_argument("--wide-only", action="store_true", help="only the wide MLP's pipeline runs")
    parser.add_argument("--no-wide", action="store_true", help="without the wide MLP's pipeline runs")
    args = parser.parse_args()
    if not args.no_wide:
        (ROOT / "benchmarks" / "results" / "index_quality_wide.md").write_text("\n".join(wide_mlp()) + "\n")
    if args.wide_only:
        return
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)
    lines = [
        "# Compressed training index: EK-FAC, LoGra per gradient matrix, whitened in the eigenbasis", "",
        "`benchmarks/index_quality.py`; digits, 1,000 training rows, 100 queries, float64, λ = 1e-3. Recall@10: the share of each query's exact",
        "top-10 helpful (harmful) examples in the compressed index's top 10; Pearson over all scores; LDS (± s.e.) against the",
        "64 retrained half-subset models of benchmarks/lds.py, the compressed index's and the exact EK-FAC's, and their ratio.", "",
        "| problem | exact dim | side | compressed dim | bytes/row (float16) | recall@10 helpful | recall@10 harmful | Pearson | LDS compressed | LDS exact | ratio | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    from distributed import Client, LocalCluster

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "peers"), str(ROOT), os.environ.get("PYTHONPATH", "")])  # the workers import datamodels
    names = args.problem or list(dm.PROBLEMS)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, Client(cluster) as client:
        retrained = {name: dm.retrain(client, dm.PROBLEMS[name]) for name in names}  # the workers retrain while this process scores
        for name in names:
            w = load_workload(dm.prepare(dm.PROBLEMS[name]), torch.float64)
            im = EkfacInfluence(w.model, "cross_entropy", LAMBDA).fit((w.x_train, w.y_train))
            exact = im.influences(w.x_test, w.y_test, w.x_train, w.y_train).numpy()
            sides = {side: (time.perf_counter(), *compressed_scores(im, w.x_train, w.y_train, w.x_test, w.y_test, side), time.perf_counter()) for side in args.sides}
            masks, measured = dm.subset_masks(), dm.measured_losses(client, retrained[name])
            truth = linear_datamodeling_score(exact, masks, measured)
            for side, (start, got, dim, stop) in sides.items():
                lds = linear_datamodeling_score(got, masks, measured)
                row = (f"| {name} | {im.factor_dim:,} | {side} | {dim:,} | {2 * dim:,} | {recall(got, exact):.2f} | {recall(-got, -exact):.2f} | {np.corrcoef(got.ravel(), exact.ravel())[0, 1]:.3f} "
                       f"| {lds.mean:.3f} ± {lds.stderr:.3f} | {truth.mean:.3f} ± {truth.stderr:.3f} | {lds.mean / truth.mean:.3f} | {stop - start:.1f} |")
                lines.append(row)
                print(row, flush=True)
    (ROOT / "benchmarks" / "results" / "index_quality.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
