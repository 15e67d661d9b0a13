"""Kronfluence 1.0.1's side of the peer benchmark: EK-FAC (or K-FAC) factors and pairwise scores, in its venv.

    benchmarks/.venvs/kronfluence/bin/python benchmarks/peers/kronfluence_runner.py --workload DIR --method ekfac \
        --options '{"batch_size": 256}' --scores S.npy

Options: `batch_size` (factor and training batches), `query_rank` (Kronfluence's `query_gradient_low_rank`, with
its default randomised SVD). λ (`--regularization`) is passed as an absolute `damping_factor`.

How Kronfluence 1.0.1 scales and damps (read in kronfluence/factor/config.py, covariance.py, eigen.py,
module/linear.py of the release):
- the task's loss is summed over the batch (`reduction="sum"`), so per-sample gradients are those of each
  example's own loss, and pairwise scores are ∇ℓ_testᵀ (F + λI)⁻¹ ∇ℓ_train with positive = helpful, the
  convention and scale of ours (whose mean-loss curvature is the same per-example average);
- F is EK-FAC of the true Fisher (labels sampled from the model, `use_empirical_fisher=False`), a bias column
  appended to the layer inputs, covariances and eigenvalue corrections divided by the number of examples;
- damping: `Ekfac.prepare` adds `damping_factor` to the corrected eigenvalues (Lambda / n) as an absolute value
  (the mean-eigenvalue heuristic applies only when it is None; the default is 1e-8), exactly ours' (Λ + λ).
Query factors and pairwise products happen inside one call (`compute_pairwise_scores`), timed as `scoring`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

import torch
from torch.utils.data import TensorDataset

from common import Stages, Workload, example_losses, run_side, sampled_labels


def body(args: argparse.Namespace, w: Workload, stages: Stages) -> tuple[torch.Tensor, dict[str, Any]]:
    import warnings

    import kronfluence
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    warnings.filterwarnings("ignore", category=FutureWarning)

    class Losses(Task):
        """Summed over the batch, each example's own loss (W4: its summed next-token cross-entropy)."""

        def compute_train_loss(self, batch: Any, model: torch.nn.Module, sample: bool = False) -> torch.Tensor:
            x, y = batch
            logits = model(x)
            if sample:
                with torch.no_grad():
                    y = sampled_labels(w.spec, logits)
            return example_losses(w.spec, logits, y).sum()

        def compute_measurement(self, batch: Any, model: torch.nn.Module) -> torch.Tensor:
            x, y = batch
            return example_losses(w.spec, model(x), y).sum()

    options = json.loads(args.options)
    if args.method not in ("ekfac", "kfac"):
        raise SystemExit(f"kronfluence runner: method {args.method!r} is not benchmarked (ekfac or kfac)")
    batch_size = int(options.get("batch_size", 256))
    task = Losses()
    model = prepare_model(w.model, task)
    train, query = TensorDataset(w.x_train, w.y_train), TensorDataset(w.x_test, w.y_test)
    score_args = ScoreArguments(damping_factor=float(args.regularization), query_gradient_low_rank=options.get("query_rank"))
    with tempfile.TemporaryDirectory(prefix="kronfluence-") as out:
        analyzer = Analyzer("peers", model, task, cpu=True, output_dir=out, disable_tqdm=True)
        with stages.time("fit"):
            analyzer.fit_all_factors(args.method, train, per_device_batch_size=batch_size, factor_args=FactorArguments(strategy=args.method))
        with stages.time("scoring"):
            analyzer.compute_pairwise_scores(
                "scores", args.method, query, train,
                per_device_query_batch_size=len(query), per_device_train_batch_size=batch_size, score_args=score_args,
            )
        scores = analyzer.load_pairwise_scores("scores")["all_modules"]
    return scores, {"side": "kronfluence", "library": f"kronfluence {kronfluence.__version__}", "batch_size": batch_size}


if __name__ == "__main__":
    run_side(__doc__.splitlines()[0], body)
