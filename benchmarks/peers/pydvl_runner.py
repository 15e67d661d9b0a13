"""pyDVL 0.10's side of the peer benchmark: fit, influence factors and "up" influences, run in pyDVL's own venv.

    benchmarks/.venvs/pydvl/bin/python benchmarks/peers/pydvl_runner.py --workload DIR --method cg \
        --options '{"second_order_mode": "gauss_newton", "rtol": 1e-3, "solve_simultaneously": true}' --scores S.npy

`--method` is direct, cg, lissa or ekfac (pyDVL's DirectInfluence, CgInfluence, LissaInfluence, EkfacInfluence);
`--options` go to the class as keyword arguments (`second_order_mode` as "hessian" / "gauss_newton"), except
`batch_size`, the DataLoader batch for fit and curvature products (LiSSA: its sample size B), and `train_chunk`,
the training rows per `influences_from_factors` call. λ is `--regularization` (EK-FAC: `hessian_regularization`).

What pyDVL 0.10 computes (read in pydvl/influence/torch/*.py of the installed 0.10.0):
- the loss is the batch MEAN (torch.nn.functional.cross_entropy); curvature operators average batches weighted by
  size (`PointAveraging`), so H is the Hessian of the mean training loss, the same scale as ours;
- `SecondOrderMode.GAUSS_NEWTON` is the empirical Fisher (1/n) Σ ∇ℓ_i ∇ℓ_iᵀ with the true labels
  (`GaussNewtonBatchOperation._rank_one_mvp`), not the generalised Gauss-Newton JᵀH_ℓJ that ours solves;
- "up" influence = +∇ℓ_testᵀ (H + λI)⁻¹ ∇ℓ_train, the sign of ours;
- CG stops a right-hand side when ‖r‖ < max(rtol²·‖b‖, atol²) (block CG: b = that right-hand side; non-block CG:
  the norm of a *column* of the right-hand-side matrix), starting from x₀ = b;
- LiSSA draws one shuffled batch of `batch_size` per step and stops when max|Δh/h| < rtol or after maxiter steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from common import Stages, Workload, run_side


class SolverLog(logging.Handler):
    """Collects pyDVL's debug messages on termination ("Terminated cg after k iterations", "... block cg ...",
    "Terminated Lissa after k iterations"), the only place pyDVL 0.10 reports its iteration counts."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: dict[str, list[int]] = {"cg": [], "block cg": [], "Lissa": []}

    def emit(self, record: logging.LogRecord) -> None:
        found = re.match(r"Terminated (cg|block cg|Lissa) after (\d+) iterations", record.getMessage())
        if found:
            self.counts[found.group(1)].append(int(found.group(2)))

    def info(self, method: str, options: dict[str, Any], n_rhs: int, batch_size: int) -> dict[str, Any]:
        """Iterations in the flop model's terms (curvature products of all right-hand sides), counting the
        initial residual product; a solve that logged nothing ran to maxiter."""
        if method == "cg":
            cap = options.get("maxiter")
            if options.get("solve_simultaneously"):
                done = self.counts["block cg"]
                its = done[0] + 1 if done else cap
                return {} if its is None else {"iterations": its + 1, "converged": bool(done)}
            done = self.counts["cg"]
            if len(done) < n_rhs and cap is None:
                return {"converged_rhs": len(done)}
            products = sum(k + 1 for k in done) + (n_rhs - len(done)) * ((cap or 0) + 1)
            return {"iterations": products / n_rhs, "converged_rhs": len(done)}
        if method == "lissa":
            done = self.counts["Lissa"]
            return {"lissa_steps": done[0] + 1 if done else options.get("maxiter", 1000), "lissa_batch": batch_size, "converged": bool(done)}
        return {}


def body(args: argparse.Namespace, w: Workload, stages: Stages) -> tuple[torch.Tensor, dict[str, Any]]:
    import warnings

    import pydvl
    from pydvl.influence import InfluenceMode
    from pydvl.influence.torch import CgInfluence, DirectInfluence, EkfacInfluence, LissaInfluence
    from pydvl.influence.torch.util import SecondOrderMode

    warnings.filterwarnings("ignore", category=FutureWarning)
    log = SolverLog()
    operator_log = logging.getLogger("pydvl.influence.torch.operator")
    operator_log.addHandler(log)
    operator_log.setLevel(logging.DEBUG)
    options = json.loads(args.options)
    batch_size = int(options.pop("batch_size", 512))
    train_chunk = int(options.pop("train_chunk", 1024))
    if "second_order_mode" in options:
        options["second_order_mode"] = SecondOrderMode(options["second_order_mode"])
    if args.method == "ekfac":
        im = EkfacInfluence(w.model, hessian_regularization=args.regularization, **options)
    else:
        cls = {"direct": DirectInfluence, "cg": CgInfluence, "lissa": LissaInfluence}[args.method]
        im = cls(w.model, torch.nn.functional.cross_entropy, regularization=args.regularization, **options)
    loader = DataLoader(TensorDataset(w.x_train, w.y_train), batch_size=batch_size, shuffle=False)
    with stages.time("fit"):
        im = im.fit(loader)
    with stages.time("query_factors"):
        factors = im.influence_factors(w.x_test, w.y_test)
    info = log.info(args.method, json.loads(args.options), len(w.y_test), batch_size)
    with stages.time("pairwise"):
        parts = [
            im.influences_from_factors(factors, w.x_train[lo : lo + train_chunk], w.y_train[lo : lo + train_chunk], mode=InfluenceMode.Up)
            for lo in range(0, len(w.y_train), train_chunk)
        ]
        scores = torch.cat(parts, dim=1)
    return scores, {"side": "pydvl", "library": f"pydvl {pydvl.__version__}", "batch_size": batch_size, **info}


if __name__ == "__main__":
    run_side(__doc__.splitlines()[0], body)
