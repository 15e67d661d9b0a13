"""This project's side of the peer benchmark: fit, query factors and pairwise scores through the public library API.

    .venv/bin/python benchmarks/peers/ours_runner.py --workload DIR --method cg --options '{"rtol": 1e-4}' --scores S.npy

`--method` is a class of `influence_core` (direct, cg, lissa, ekfac, ...); `--options` are passed to it as keyword
arguments, with `regularization` = `--regularization`, except `index_side`: with it, the library builds the flow's
compressed training index (`IndexProjection.for_model`, LoGra rows of that side stored as float16) in a stage
`index`, projects the queries alike and multiplies the two, the same work as the flow with its index. Prints one
JSON line (see common.run_side).
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
    side = options.pop("index_side", None)
    task = "language_modelling" if is_language_model(w.spec) else "cross_entropy"
    im = cls(w.model, task, regularization=args.regularization, **options)
    with stages.time("fit"):
        im.fit((w.x_train, w.y_train))
    if side is not None:
        return indexed_scores(im, w, stages, side), {"side": "ours", "library": f"influence-pipeline {influence_core.__version__}", "index_side": side}
    with stages.time("query_factors"):
        factors = im.influence_factors(w.x_test, w.y_test)
    info = solver_info(im, options)
    with stages.time("pairwise"):
        scores = im.influences_from_factors(factors, w.x_train, w.y_train)
    return scores, {"side": "ours", "library": f"influence-pipeline {influence_core.__version__}", **info}


def indexed_scores(im: Any, w: Workload, stages: Stages, side: int) -> torch.Tensor:
    """Scores through the flow's compressed index, built by the library: every training row's LoGra features (float16,
    as the flow stores them), the queries projected alike, and their products."""
    from influence_core.index_projection import IndexProjection
    from influence_core.methods.scorer import Scorer

    with stages.time("index"):
        projection = IndexProjection.for_model(im, w.x_train[:8], w.y_train[:8], side)
        rows = Scorer(im, None, None).features(w.x_train, w.y_train, projection.training)[0].to(torch.float16)
    with stages.time("query_factors"):
        queries = projection.queries(im, w.x_test, w.y_test)
    with stages.time("pairwise"):
        return queries @ rows.to(queries.dtype).T


if __name__ == "__main__":
    run_side(__doc__.splitlines()[0], body)
