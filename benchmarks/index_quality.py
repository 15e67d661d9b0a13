"""The compressed training index against the exact one, on the LDS problems (logistic regression, MLP, CNN on digits):
how much of each query's exact top 10 helpful and harmful training examples a LoGra-compressed EK-FAC index keeps,
and the Pearson correlation of all scores, at three sides.

    .venv/bin/python benchmarks/index_quality.py [--sides 16 32 64] [--problem NAME ...]

The models are the LDS problems' (benchmarks/datamodels.py: 1,000 training rows, 100 queries, float64, trained once
and cached under benchmarks/.scratch/lds). EK-FAC at λ = 1e-3, scored exactly and through `IndexProjection` (whitened
in its eigenbasis, as index_training compresses it). Writes benchmarks/results/index_quality.md.
"""

from __future__ import annotations

import argparse
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
        "top-10 helpful (harmful) examples in the compressed index's top 10; Pearson over all scores. LDS of the compressed index is not measured yet.", "",
        "| problem | exact dim | side | compressed dim | bytes/row (float16) | recall@10 helpful | recall@10 harmful | Pearson | seconds |", "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.problem or list(dm.PROBLEMS):
        w = load_workload(dm.prepare(dm.PROBLEMS[name]), torch.float64)
        im = EkfacInfluence(w.model, "cross_entropy", LAMBDA).fit((w.x_train, w.y_train))
        exact = im.influences(w.x_test, w.y_test, w.x_train, w.y_train).numpy()
        for side in args.sides:
            start = time.perf_counter()
            got, dim = compressed_scores(im, w.x_train, w.y_train, w.x_test, w.y_test, side)
            seconds = time.perf_counter() - start
            row = f"| {name} | {im.factor_dim:,} | {side} | {dim:,} | {2 * dim:,} | {recall(got, exact):.2f} | {recall(-got, -exact):.2f} | {np.corrcoef(got.ravel(), exact.ravel())[0, 1]:.3f} | {seconds:.1f} |"
            lines.append(row)
            print(row, flush=True)
    (ROOT / "benchmarks" / "results" / "index_quality.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
