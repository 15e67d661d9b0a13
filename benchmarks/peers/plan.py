"""What the peer benchmark runs: per workload, the rows that compare sides, the end-to-end sweep and the exact
answers, with every side's settings written out (λ comes from the workload, the same number on every side).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

# The agreement with the converged answer at which the end-to-end comparison (W2) picks each side's fastest path.
E2E_PEARSON = 0.99


@dataclass(frozen=True)
class Config:
    """One side's method and options; `matrix` is the curvature it solves (hessian, ggn, ef, ekfac), which picks
    the exact answer it is compared with."""

    side: str
    method: str
    matrix: str
    label: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def key(self) -> str:
        """A file-name-safe identifier of this configuration (unique within a workload)."""
        digest = hashlib.sha256(json.dumps([self.side, self.method, self.options], sort_keys=True).encode()).hexdigest()[:8]
        return f"{self.side}-{self.method}-{digest}"


@dataclass(frozen=True)
class Row:
    """Configurations run side by side, alternating, `reps` times each (`None`: the harness's --reps)."""

    workload: str
    title: str
    configs: tuple[Config, ...]
    reps: int | None = None


@dataclass(frozen=True)
class Reference:
    """An exact answer (reference.py) on the first `queries` queries."""

    matrix: str
    solver: str
    queries: int
    arguments: tuple[str, ...] = ()  # more of reference.py's options (W4: its tolerance and device)


@dataclass(frozen=True)
class Pipeline:
    """The whole flow on a workload, beside the library row whose configuration it repeats."""

    workload: str
    title: str
    config: Config
    method: dict[str, Any]
    compute: dict[str, Any] = field(default_factory=dict)  # the flow's `compute` options beside the runner's own

    @property
    def scores_name(self) -> str:
        """Its scores' file name: one per configuration and `compute` options."""
        return "-".join(["pipeline", self.config.key, *(f"{k}-{v}" for k, v in self.compute.items())]) + ".npy"


@dataclass(frozen=True)
class Plan:
    rows: list[Row]
    sweep: list[Row]
    references: dict[str, list[Reference]]
    pipelines: list[Pipeline]
    skipped: list[str]


def _pydvl_rtol(rtol: float) -> float:
    """pyDVL 0.10's CG stops at ‖r‖ < rtol²·‖b‖: the rtol to pass for a relative residual of `rtol`."""
    return rtol**0.5


def build(quick: bool, workloads: list[str], ours_options: set[str], gpu: bool = False) -> Plan:
    """The plan for the chosen workloads; `ours_options` are the keyword options this version of ours accepts
    (optional features such as `query_rank` are planned only when present); `gpu`: a CUDA device is visible (W4's
    converged answer is computed only there)."""
    rows: list[Row] = []
    sweep: list[Row] = []
    references: dict[str, list[Reference]] = {}
    pipelines: list[Pipeline] = []
    skipped: list[str] = []

    if "W1" in workloads:
        cg_rtol = 1e-6
        rows += [
            Row("W1", "Direct, Hessian", (
                Config("ours", "direct", "hessian", "DirectInfluence(hessian)", {"second_order_mode": "hessian", "batch_size": 512}),
                Config("pydvl", "direct", "hessian", "DirectInfluence(HESSIAN)", {"second_order_mode": "hessian", "batch_size": 512}),
            )),
            Row("W1", "CG, Hessian", (
                Config("ours", "cg", "hessian", f"CgInfluence(hessian, rtol={cg_rtol:g})", {"second_order_mode": "hessian", "rtol": cg_rtol, "batch_size": 512}),
                Config("pydvl", "cg", "hessian", f"CgInfluence(HESSIAN, block, rtol={_pydvl_rtol(cg_rtol):g})",
                       {"second_order_mode": "hessian", "rtol": _pydvl_rtol(cg_rtol), "solve_simultaneously": True, "batch_size": 512}),
            )),
        ]
        skipped.append(
            "pyDVL's default per-vector CG (`solve_simultaneously=False`) is not a row: its stopping test compares each residual with rtol² "
            "times the norm of a *column* of the right-hand-side matrix (one parameter across the queries), floored at atol², so systems "
            "run towards maxiter = 10·p; in a smoke run on 300 digits (p = 2,410, 40 queries, rtol 1e-3) its query factors took 360 s "
            "against 12.7 s for its block CG. pyDVL's block CG is used throughout."
        )
        references["W1"] = [Reference("hessian", "direct", 10**9)]

    if "W2" in workloads:
        batch = 500
        rtol = 1e-3
        depth = 10 if quick else 100
        lissa = {"lissa_batch_size": 256, "scale": 2.0, "depth": depth, "rtol": 1e-12, "batch_size": batch}
        pydvl_lissa = {"batch_size": 256, "scale": 2.0, "maxiter": depth, "rtol": 1e-12}
        ggn = Config("ours", "cg", "ggn", f"CgInfluence(gauss_newton = GGN, rtol={rtol:g})", {"second_order_mode": "gauss_newton", "rtol": rtol, "batch_size": batch})
        rows += [
            Row("W2", "CG, Hessian", (
                Config("ours", "cg", "hessian", f"CgInfluence(hessian, rtol={rtol:g})", {"second_order_mode": "hessian", "rtol": rtol, "batch_size": batch}),
                Config("pydvl", "cg", "hessian", f"CgInfluence(HESSIAN, block, rtol={_pydvl_rtol(rtol):.3g})",
                       {"second_order_mode": "hessian", "rtol": _pydvl_rtol(rtol), "solve_simultaneously": True, "batch_size": batch}),
            )),
            Row("W2", "CG, Gauss-Newton", (
                ggn,
                Config("pydvl", "cg", "ef", f"CgInfluence(GAUSS_NEWTON = EF, block, rtol={_pydvl_rtol(rtol):.3g})",
                       {"second_order_mode": "gauss_newton", "rtol": _pydvl_rtol(rtol), "solve_simultaneously": True, "batch_size": batch}),
            )),
            Row("W2", f"LiSSA, Hessian ({depth} steps of 256)", (
                Config("ours", "lissa", "hessian", f"LissaInfluence(hessian, J={depth}, B=256, s=2)", {"second_order_mode": "hessian", **lissa}),
                Config("pydvl", "lissa", "hessian", f"LissaInfluence(HESSIAN, maxiter={depth}, B=256, s=2)", {"second_order_mode": "hessian", **pydvl_lissa}),
            )),
        ]
        # End to end: more settings, one run each; the rows above count too. Cheaper points only (looser CG
        # tolerances, EK-FAC): LiSSA's points are its rows above, each a full pass of its steps.
        sweep += [
            Row("W2", "end to end", (
                *(Config("ours", "cg", "ggn", f"CgInfluence(GGN, rtol={r:g})", {"second_order_mode": "gauss_newton", "rtol": r, "batch_size": batch}) for r in (1e-1, 1e-2)),
                Config("ours", "ekfac", "ggn", "EkfacInfluence(sampled Fisher)", {"fisher": "sampled", "batch_size": 256}),
                *(Config("pydvl", "cg", "ef", f"CgInfluence(EF, block, rtol={_pydvl_rtol(r):.3g})",
                         {"second_order_mode": "gauss_newton", "rtol": _pydvl_rtol(r), "solve_simultaneously": True, "batch_size": batch}) for r in (1e-1, 1e-2)),
                Config("pydvl", "ekfac", "ggn", "EkfacInfluence(update_diagonal=True)", {"update_diagonal": True, "batch_size": 256}),
            ), reps=1),
        ]
        queries = 10 if quick else 25
        references["W2"] = [Reference("ggn", "cg", queries), Reference("hessian", "cg", queries), Reference("ef", "woodbury", queries)]
        pipelines.append(Pipeline("W2", "CG, GGN", ggn, {"name": "cg", "second_order_mode": "gauss_newton", "rtol": rtol, "batch_size": batch}))

    if "W3" in workloads:
        ekfac = Config("ours", "ekfac", "ekfac", "EkfacInfluence(fisher=sampled)", {"fisher": "sampled", "batch_size": 256})
        rows.append(Row("W3", "EK-FAC", (ekfac, Config("kronfluence", "ekfac", "ekfac", "fit_all_factors(ekfac) + compute_pairwise_scores", {"batch_size": 256}))))
        rank = 16
        if "query_rank" in ours_options:
            rows.append(Row("W3", f"EK-FAC, query factors of rank {rank}", (
                Config("ours", "ekfac", "ekfac", f"EkfacInfluence(fisher=sampled, query_rank={rank})", {"fisher": "sampled", "batch_size": 256, "query_rank": rank}),
                Config("kronfluence", "ekfac", "ekfac", f"... query_gradient_low_rank={rank}", {"batch_size": 256, "query_rank": rank}),
            )))
        else:
            skipped.append(f"W3 low-rank query factors: this version of ours has no `query_rank` option, so neither side was run at rank {rank}.")
        pipelines += with_and_without_index("W3", ekfac, {"name": "ekfac", "fisher": "sampled", "batch_size": 256})

    if "W4" in workloads:
        # Both sides track the nn.Linear layers (attention projections, feed-forward, head); the embeddings and norms
        # are left out on both. Kronfluence: its sampled (true) Fisher, float32, a Task summing token cross-entropies.
        ekfac = Config("ours", "ekfac", "ekfac", "EkfacInfluence(language_modelling, fisher=sampled)", {"fisher": "sampled", "batch_size": 64})
        rows.append(Row("W4", "EK-FAC, GPT", (ekfac, Config("kronfluence", "ekfac", "ekfac", "fit_all_factors(ekfac) + compute_pairwise_scores", {"batch_size": 64}))))
        # The converged answer: block CG on the GGN of the tracked layers, float32 products, a rank-200 Nyström
        # preconditioner. The quick W4 takes 428 iterations (4 min on this CPU); the full W4 about 21 s per iteration
        # here, so it is planned only where a GPU is visible.
        solve = ("--preconditioner", "nystroem", "--product-dtype", "float32", "--rtol", "1e-6")
        if quick or gpu:
            references["W4"] = [Reference("ggn", "block-cg", 5, (*solve, *(("--device", "cuda", "--chunk", "100") if gpu else ())))]
        else:
            skipped.append("W4's converged CG answer (GGN of the tracked nn.Linear layers, λ = 1e-3) needs a GPU: on this 2-core CPU one block-CG "
                           "iteration over the 2,000 windows takes about 21 s (5 queries, float32 products), and the quick W4 needed 428 of them; "
                           "neither side's agreement with it is measured.")
        pipelines += with_and_without_index("W4", ekfac, {"name": "ekfac", "fisher": "sampled", "batch_size": 64})
    return Plan(rows, sweep, references, pipelines, skipped)


INDEX_SIDE = 64  # the flow's compute.index_side here (its default was 64 before index_side auto): W3's and W4's exact indexes exceed its 1 GB budget


def with_and_without_index(workload: str, config: Config, method: dict[str, Any]) -> list[Pipeline]:
    """The flow as a user runs it (the training index built, LoGra-compressed: both workloads are over its budget)
    beside the library building the same index (`ours_runner`'s `index_side`), and with no index
    (`compute.index_budget_gb: 0`) beside the library row, where compute_influences takes the training gradients as
    the library's pairwise does. Each pair is the same work, so its flow / library ratio is the orchestration's cost."""
    indexed = Config(config.side, config.method, config.matrix, f"{config.label} + LoGra index (side {INDEX_SIDE}, float16)", {**config.options, "index_side": INDEX_SIDE})
    return [Pipeline(workload, f"EK-FAC, with its index (side {INDEX_SIDE}, no re-ranking)", indexed, method, {"index_side": INDEX_SIDE}),
            Pipeline(workload, "EK-FAC, no index (the library's work)", config, method, {"index_budget_gb": 0})]
