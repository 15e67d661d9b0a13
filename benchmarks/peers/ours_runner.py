"""This project's side of the peer benchmark: fit, query factors and pairwise scores through the public library API.

    .venv/bin/python benchmarks/peers/ours_runner.py --workload DIR --method cg --options '{"rtol": 1e-4}' --scores S.npy

`--method` is a class of `influence_core` (direct, cg, lissa, ekfac, ...); `--options` are passed to it as keyword
arguments, with `regularization` = `--regularization`. Prints one JSON line (see common.run_side).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from common import Stages, Workload, is_language_model, run_side

CLASSES = {"direct": "DirectInfluence", "cg": "CgInfluence", "lissa": "LissaInfluence", "ekfac": "EkfacInfluence", "kfac": "KfacInfluence"}


def solver_info(im: Any, options: dict[str, Any]) -> dict[str, Any]:
    """What the solvers report, in the flop model's terms: CG iterations and the vectors multiplied (of the last
    solve; block CG multiplies fewer than iterations × right-hand sides once directions deflate) and LiSSA steps (summed over repeats) with the examples per step."""
    info: dict[str, Any] = {}
    for solver in im.solvers.values():
        last = getattr(solver, "last_solve", None)
        if last is not None:
            info.update(iterations=last.iterations, products=last.products, max_relative_residual=last.max_relative_residual, unconverged=last.unconverged)
        steps = getattr(solver, "iterations", None)
        if isinstance(steps, list) and steps:
            info.update(lissa_steps=sum(steps), lissa_batch=options.get("lissa_batch_size", 64))
    return info


def body(args: argparse.Namespace, w: Workload, stages: Stages) -> tuple[torch.Tensor, dict[str, Any]]:
    import influence_core

    cls = getattr(influence_core, CLASSES[args.method])
    options = json.loads(args.options)
    task = "language_modelling" if is_language_model(w.spec) else "cross_entropy"
    im = cls(w.model, task, regularization=args.regularization, **options)
    with stages.time("fit"):
        im.fit((w.x_train, w.y_train))
    with stages.time("query_factors"):
        factors = im.influence_factors(w.x_test, w.y_test)
    info = solver_info(im, options)
    with stages.time("pairwise"):
        scores = im.influences_from_factors(factors, w.x_train, w.y_train)
    return scores, {"side": "ours", "library": f"influence-pipeline {influence_core.__version__}", **info}


if __name__ == "__main__":
    run_side(__doc__.splitlines()[0], body)
