"""The compressed training index against the exact one, on the LDS problems (logistic regression, MLP, CNN on digits):
how much of each query's exact top 10 helpful and harmful training examples a LoGra-compressed EK-FAC index keeps,
the Pearson correlation of all scores, and the LDS of both against the 64 retrained half-subset models, at three sides.

    .venv/bin/python benchmarks/index_quality.py [--sides 16 32 64] [--problem NAME ...]

The models are the LDS problems' (benchmarks/datamodels.py: 1,000 training rows, 100 queries, float64, trained once
and cached under benchmarks/.scratch/lds, with the subset models' query losses, retrained on a 2-worker LocalCluster
on first use). EK-FAC at λ = 1e-3, scored exactly and through `IndexProjection` (whitened in its eigenbasis, as
index_training compresses it). Writes benchmarks/results/index_quality.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", nargs="+", type=int, default=[16, 32, 64])
    parser.add_argument("--problem", action="append", choices=list(dm.PROBLEMS))
    args = parser.parse_args()
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
