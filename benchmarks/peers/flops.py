"""The analytical flop model of the peer benchmark: the useful work of a stage, the same formula for every side.

Counts are the arithmetic an efficient implementation of the stage cannot avoid, from the workload's shapes alone
(p parameters, n training and m query examples, Linear layers l with i_l inputs + 1 for the bias and o_l
outputs); a side that does more work (e.g. forms per-example gradient matrices it could avoid) shows a lower
rate, one with a shortcut a higher one. Iteration counts come from what the side reports; where a side reports
none, the rate is not given. Iterative counts are upper bounds (every right-hand side is charged every iteration
up to the last one, though converged ones may drop out).
A language model (W4) has T = `features` positions per example: every per-example forward, backward and per-position
rotation is charged T times, and p counts the tracked (nn.Linear) parameters, the ones EK-FAC scores.
"""

from __future__ import annotations

from typing import Any

FORMULAS = [
    ("forward pass of an MLP, per example", "2p"),
    ("per-example loss gradient (forward + backward)", "6p"),
    ("Hessian- or GGN-vector product, per example and vector (≈ 4 forward passes)", "8p"),
    ("empirical-Fisher-vector product over the data, per pass", "6pn + 4pn·(vectors)  (gradients once, then two GEMMs)"),
    ("Direct fit: the explicit curvature and its Cholesky factor", "8np² + p³/3"),
    ("Direct query factors", "m·(6p + 2p²)  (gradients, two triangular solves)"),
    ("CG query factors", "6pm + iterations·(curvature products of m vectors over n examples)"),
    ("LiSSA query factors", "6pm + steps·(curvature products of m vectors over B examples)  (steps = depth·repeats, B per step)"),
    ("EK-FAC fit", "2·6pn + n·Σ_l[4(i_l² + o_l²) + 2·i_l·o_l] + Σ_l 9(i_l³ + o_l³)  (two passes; covariances; rank-one "
     "gradients rotated into the eigenbasis and squared; symmetric eigendecompositions ≈ 9d³)"),
    ("EK-FAC query factors", "m·(6p + Σ_l[2(i_l² + o_l²) + 2(o_l²·i_l + o_l·i_l²)])  (rotate a rank-one gradient in, "
     "scale, rotate the dense result back)"),
    ("pairwise scores", "6pn + 2·m·n·p  (training gradients, one GEMM with the query factors)"),
    ("scoring", "query factors + pairwise scores"),
]


def _layers(w: dict[str, Any]) -> list[tuple[int, int]]:
    """(inputs + bias, outputs) per Linear layer."""
    return [(i + 1, o) for i, o in w["layers"]]


def curvature_pass(w: dict[str, Any], matrix: str, vectors: float, examples: int | None = None) -> float:
    """One product of the curvature with `vectors` vectors over `examples` (default: all n) training examples."""
    p, n = w["n_params"], examples or w["n_train"]
    if matrix == "ef":
        return 6.0 * p * n + 4.0 * p * n * vectors
    return 8.0 * p * n * vectors


def stage_flops(stage: str, method: str, matrix: str, w: dict[str, Any], options: dict[str, Any], info: dict[str, Any]) -> float | None:
    """Flops of one stage of one side's run, or None when the side does not report what the model needs."""
    layers = _layers(w)
    t = w["features"] if w.get("model") == "gpt" else 1  # positions per example
    p = sum(i * o for i, o in layers) if t > 1 else w["n_params"]
    n, m = w["n_train"], w["n_test"]
    if stage == "scoring":
        parts = [stage_flops(s, method, matrix, w, options, info) for s in ("query_factors", "pairwise")]
        return None if None in parts else float(sum(parts))  # type: ignore[arg-type]
    if stage == "pairwise":
        return 6.0 * p * t * n + 2.0 * m * n * p
    if stage == "fit":
        if method == "direct":
            return 8.0 * n * p * p + p**3 / 3.0
        if method == "ekfac":
            passes = 12.0 * p * t * n + n * t * sum(4.0 * (i * i + o * o) + 2.0 * i * o for i, o in layers)
            return passes + sum(9.0 * (i**3 + o**3) for i, o in layers)
        return None  # matrix-free methods keep only the data: nothing to count
    if stage == "query_factors":
        grads = 6.0 * p * t * m
        if method == "direct":
            return grads + 2.0 * p * p * m
        if method == "cg":
            it = info.get("iterations")
            per_iteration = info.get("products", (it or 0) * m) / max(it or 1, 1)  # vectors per product pass
            return None if it is None else grads + it * curvature_pass(w, matrix, per_iteration)
        if method == "lissa":
            steps = info.get("lissa_steps")
            return None if steps is None else grads + steps * curvature_pass(w, matrix, m, info["lissa_batch"])
        if method == "ekfac":
            return grads + m * sum(2.0 * t * (i * i + o * o) + 2.0 * (o * o * i + o * i * i) for i, o in layers)
    return None
