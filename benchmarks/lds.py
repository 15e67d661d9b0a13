"""Linear datamodeling score (LDS) of every method, ours and the peers', on the same trained weights and λ.

    make quality            (quality.py, then this: the LDS section of benchmarks/results/quality.md, lds.png, lds.json)
    .venv/bin/python benchmarks/lds.py --report-only      (rewrite the section and plot from lds.json)

LDS (Park et al., 2023): for each query, the Spearman correlation over the subsets S between the predicted loss
−Σ_{i∈S} score[q, i] and the query loss of the model retrained on S; the mean over queries, ± its standard error
(`influence_core.lds`). Problems, split, recipe and subsets: benchmarks/datamodels.py. Seconds: fit + scores of all
queries against all training rows, 2 torch threads per side (peers: their runners' stages, in their own venvs,
started by `benchmarks/peers/execute.py`). λ = weight decay = 1e-3 absolute on every side, float64 models and inputs (but pyDVL's EK-FAC, below;
Kronfluence keeps its default float32 covariances and scores).
Ours and Kronfluence use the Gauss-Newton matrix (Kronfluence: the true Fisher, which equals it for
cross-entropy); pyDVL's `gauss_newton` is the empirical Fisher, so pyDVL runs with the Hessian (at an optimum of
CE + (wd/2)‖θ‖², H + wd·I is positive definite).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
sys.path.insert(0, str(ROOT))

import datamodels as dm  # noqa: E402
import execute  # noqa: E402
from common import Workload, load_workload  # noqa: E402
from peers import measured_commit, venv_pythons  # noqa: E402
from quality import top_eigenvalue  # noqa: E402

from influence_core import (  # noqa: E402
    ArnoldiInfluence,
    CgInfluence,
    DataInfInfluence,
    DirectInfluence,
    EkfacInfluence,
    IdentityInfluence,
    InfluenceFunctionModel,
    KfacInfluence,
    LissaInfluence,
    NystroemSketchInfluence,
    Projection,
)
from influence_core.lds import linear_datamodeling_score  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
LAMBDA, THREADS = dm.WEIGHT_DECAY, 2
DAMPING_GRID = (1e-4, 1e-3, 1e-2, 1e-1)
ARNOLDI_RANKS = (10, 50, 200)
# The damping grid's methods: those whose fit is one pass or a few (Arnoldi's Lanczos is one pass per Krylov vector).
DAMPED = ("direct", "kfac", "ekfac", "nystroem (r=50)", "datainf (layer-wise)")
# TRAK's ensemble: scores averaged over MEMBERS models trained from seeds 0..MEMBERS-1 (datamodels.train).
MEMBERS, ENSEMBLED = 4, ("direct", "kfac", "ekfac")
GN = {"second_order_mode": "gauss_newton"}
Factory = Callable[[torch.nn.Module, float], InfluenceFunctionModel]


def ours(w: Workload) -> dict[str, Factory]:
    """Every method of the library, with the options `make quality` uses (LiSSA scaled above the top eigenvalue,
    found when LiSSA is built)."""
    return {
        "direct": lambda m, lam: DirectInfluence(m, "cross_entropy", lam, **GN),
        "cg": lambda m, lam: CgInfluence(m, "cross_entropy", lam, rtol=1e-6, **GN),
        "lissa (J=1000, B=100)": lambda m, lam: LissaInfluence(m, "cross_entropy", lam, depth=1000, lissa_batch_size=100, scale=1.2 * (top_eigenvalue(w.model, w.x_train, w.y_train) + lam), **GN),
        "arnoldi (r=50)": lambda m, lam: ArnoldiInfluence(m, "cross_entropy", lam, rank=50, krylov_dim=100, **GN),
        "arnoldi (r=50, complement)": lambda m, lam: ArnoldiInfluence(m, "cross_entropy", lam, rank=50, krylov_dim=100, complement=True, **GN),
        "nystroem (r=50)": lambda m, lam: NystroemSketchInfluence(m, "cross_entropy", lam, rank=50, **GN),
        "datainf (layer-wise)": lambda m, lam: DataInfInfluence(m, "cross_entropy", lam, block_structure="layer_wise"),
        "kfac": lambda m, lam: KfacInfluence(m, "cross_entropy", lam),
        "ekfac": lambda m, lam: EkfacInfluence(m, "cross_entropy", lam),
        "direct + projection (TRAK, 256 per layer)": lambda m, lam: DirectInfluence(m, "cross_entropy", lam, projection=Projection("gaussian", 256, 0)),
        "identity (gradient dot product)": lambda m, lam: IdentityInfluence(m, "cross_entropy"),
    }


# (side, method, options, dtype): the peers' runners (benchmarks/peers/*_runner.py). pyDVL 0.10's EK-FAC fails on a
# float64 model ("expected scalar type Double but found Float"), so it gets the same weights cast to float32.
PEERS = [
    ("kronfluence", "ekfac", {"batch_size": 250}, "float64"),
    ("kronfluence", "kfac", {"batch_size": 250}, "float64"),
    ("pydvl", "direct", {"batch_size": 250}, "float64"),
    ("pydvl", "cg", {"batch_size": 250, "rtol": 1e-6, "solve_simultaneously": True}, "float64"),
    ("pydvl", "ekfac", {"batch_size": 250}, "float32"),
]


def run_ours(factory: Factory, w: Workload, lam: float) -> tuple[np.ndarray, float]:
    """Scores (queries × train) and seconds for fit + scores."""
    start = time.perf_counter()
    scores = factory(w.model, lam).fit((w.x_train, w.y_train)).influences(w.x_test, w.y_test, w.x_train, w.y_train)
    return scores.numpy(), time.perf_counter() - start


def run_peer(python: str, side: str, method: str, options: dict[str, Any], dtype: str, root: Path) -> tuple[np.ndarray | None, dict[str, Any]]:
    """One peer run as a subprocess in its venv: its scores (None when it failed) and its JSON result."""
    runner = ROOT / "benchmarks" / "peers" / f"{side}_runner.py"
    with tempfile.TemporaryDirectory(prefix="lds-") as tmp:
        out = Path(tmp) / "scores.npy"
        cmd = [python, str(runner), "--workload", str(root), "--method", method, "--options", json.dumps(options), "--scores", str(out),
               "--regularization", str(LAMBDA), "--threads", str(THREADS), "--dtype", dtype]
        result = execute.run_json(cmd, 1800, dm.SCRATCH / "logs" / f"{root.name}-{side}-{method}.log")
        return (np.load(out) if execute.ok(result) else None), result


def row(problem: str, side: str, method: str, lam: float, scores: np.ndarray | None, seconds: float | None, masks: np.ndarray, measured: np.ndarray, note: str = "") -> dict[str, Any]:
    """A result row: LDS mean, standard error and per query (or why there is none)."""
    lds = linear_datamodeling_score(scores.astype(np.float64), masks, measured) if scores is not None else None
    found = {"lds": lds.mean, "stderr": lds.stderr, "per_query": lds.per_query.tolist()} if lds else {"lds": None, "stderr": None}
    print(problem, side, method, lam, found.get("lds"), seconds, note, flush=True)
    return {"problem": problem, "side": side, "method": method, "lam": lam, "seconds": seconds, "note": note, **found}


def arnoldi_ranks(w: Workload, lam: float, masks: np.ndarray, measured: np.ndarray) -> list[dict[str, Any]]:
    """The Arnoldi question, from the exact eigendecomposition of C (Direct's explicit matrix, not Lanczos): per
    rank r, the share of the query gradient and of the exact factor (C + λI)⁻¹g_q in the top-r eigenspace (mean over
    queries), and the LDS of the top-r inverse alone and with the rest at 1/(mean remaining eigenvalue + λ)."""
    direct = DirectInfluence(w.model, "cross_entropy", lam, **GN).fit((w.x_train, w.y_train))
    factor = direct.solvers["all"].factor
    values, vectors = torch.linalg.eigh(factor @ factor.T - lam * torch.eye(len(factor), dtype=factor.dtype))
    values, vectors = values.flip(0), vectors.flip(1)
    gradients = IdentityInfluence(w.model, "cross_entropy").fit((w.x_train, w.y_train))
    train, query = gradients.influence_factors(w.x_train, w.y_train), gradients.influence_factors(w.x_test, w.y_test)
    exact = ((query @ vectors) / (values + lam)) @ vectors.T
    out = []
    for r in ARNOLDI_RANKS:
        top = vectors[:, :r]
        inside = ((query @ top) / (values[:r] + lam)) @ top.T
        rest = (query - (query @ top) @ top.T) / (float(values[r:].mean()) + lam)
        out.append({"rank": r, "factor_share": float(((exact @ top).norm(dim=1) / exact.norm(dim=1)).mean()),
                    "gradient_share": float(((query @ top).norm(dim=1) / query.norm(dim=1)).mean()),
                    "eigenvalue_r": float(values[r - 1]), "mean_eigenvalue": float(values.mean()),
                    "lds_top": linear_datamodeling_score((inside @ train.T).numpy(), masks, measured).mean,
                    "lds_complement": linear_datamodeling_score(((inside + rest) @ train.T).numpy(), masks, measured).mean})
    print(out, flush=True)
    return out


def ensemble_rows(problem: str, members: list[Path], masks: np.ndarray, measured: np.ndarray) -> list[dict[str, Any]]:
    """Per method in ENSEMBLED: the LDS of the mean of its scores over the members' models, and the gain over member
    0 alone (mean ± standard error of the per-query differences). The measured losses are member 0's subsets'."""
    loaded = [load_workload(root, torch.float64) for root in members]
    out = []
    for name in ENSEMBLED:
        runs = [run_ours(ours(w)[name], w, LAMBDA) for w in loaded]
        mean = np.mean([scores for scores, _ in runs], axis=0)
        single, ensemble = (linear_datamodeling_score(s, masks, measured) for s in (runs[0][0], mean))
        gain = ensemble.per_query - single.per_query
        gain = gain[np.isfinite(gain)]
        out.append({**row(problem, "ours", f"{name}, ensemble of {len(members)}", LAMBDA, mean, sum(t for _, t in runs), masks, measured),
                    "single": single.mean, "gain": float(gain.mean()), "gain_stderr": float(gain.std(ddof=1) / np.sqrt(len(gain)))})
    return out


def evaluate(problem: str, members: list[Path], pythons: dict[str, str], client: Any, futures: list[Any]) -> dict[str, Any]:
    """Every row of one problem (its members' workload directories, member 0's first): all methods at λ, the peers,
    the damping grid, the Arnoldi ranks, the ensembles."""
    masks, measured = dm.subset_masks(), dm.measured_losses(client, futures)
    root = members[0]
    w = load_workload(root, torch.float64)
    factories = ours(w)
    rows = [row(problem, "ours", name, LAMBDA, *run_ours(f, w, LAMBDA), masks, measured) for name, f in factories.items()]
    for side, method, options, dtype in PEERS:
        scores, result = run_peer(pythons[side], side, method, options, dtype, root)
        seconds = sum(result["stages"].values()) if scores is not None else None
        rows.append(row(problem, side, method, LAMBDA, scores, seconds, masks, measured, "" if scores is not None else execute.outcome(result)))
    damping = [row(problem, "ours", name, lam, *run_ours(factories[name], w, lam), masks, measured) for lam in DAMPING_GRID if lam != LAMBDA for name in DAMPED]
    return {"problem": problem, "n_params": w.n_params, "query_accuracy": w.spec["query_accuracy"], "rows": rows + damping,
            "arnoldi_ranks": arnoldi_ranks(w, LAMBDA, masks, measured), "ensembles": ensemble_rows(problem, members, masks, measured)}


def find(results: list[dict[str, Any]], problem: str, side: str, method: str, lam: float = LAMBDA) -> dict[str, Any] | None:
    """The row of a problem, side, method and λ."""
    return next((r for p in results if p["problem"] == problem for r in p["rows"] if (r["side"], r["method"], r["lam"]) == (side, method, lam)), None)


def cell(r: dict[str, Any] | None) -> str:
    """'0.812 ± 0.011', or why there is no value."""
    if r is None:
        return "—"
    return f"{r['lds']:.3f} ± {r['stderr']:.3f}" if r["lds"] is not None else r["note"][:80]


def main_table(results: list[dict[str, Any]]) -> list[str]:
    """One row per (side, method) at λ, one column pair per problem."""
    problems = [p["problem"] for p in results]
    keys = [(r["side"], r["method"]) for r in results[0]["rows"] if r["lam"] == LAMBDA]
    lines = ["| side | method | " + " | ".join(f"{p} LDS | s" for p in problems) + " |", "|---|---|" + "---|---|" * len(problems)]
    for side, method in keys:
        cells = []
        for p in problems:
            r = find(results, p, side, method)
            cells += [cell(r), f"{r['seconds']:.2f}" if r and r["seconds"] is not None else "—"]
        lines.append(f"| {side} | {method} | " + " | ".join(cells) + " |")
    return lines


def targets(results: list[dict[str, Any]]) -> list[str]:
    """Issue 23's targets per problem: EK-FAC ≥ 0.95 × exact Direct, and ≥ Kronfluence's EK-FAC."""
    lines = ["| problem | ours EK-FAC | 0.95 × Direct | hit | Kronfluence EK-FAC | hit | ours EK-FAC, ensemble | hit (0.95 × Direct) |", "|---|---|---|---|---|---|---|---|"]
    for p in results:
        ek, direct, kron = (find(results, p["problem"], s, m) for s, m in (("ours", "ekfac"), ("ours", "direct"), ("kronfluence", "ekfac")))
        ensemble = next((e for e in p.get("ensembles", []) if e["method"].startswith("ekfac,")), None)
        bar = 0.95 * direct["lds"]
        beat = "—" if kron["lds"] is None else ("hit" if ek["lds"] >= kron["lds"] else "miss")
        grouped = ("—", "—") if ensemble is None else (cell(ensemble), "hit" if ensemble["lds"] >= bar else "miss")
        lines.append(f"| {p['problem']} | {cell(ek)} | {bar:.3f} | {'hit' if ek['lds'] >= bar else 'miss'} | {cell(kron)} | {beat} | {grouped[0]} | {grouped[1]} |")
    return lines


def damping_table(results: list[dict[str, Any]]) -> list[str]:
    """LDS across λ per method and problem; the mean eigenvalue trace(C)/p gives each λ's relative size."""
    lines = ["| problem | method | " + " | ".join(f"λ={lam:g}" for lam in DAMPING_GRID) + " |", "|---|---|" + "---|" * len(DAMPING_GRID)]
    for p in results:
        mean = p["arnoldi_ranks"][0]["mean_eigenvalue"]
        lines.append(f"| {p['problem']} | λ / (trace(C)/p) | " + " | ".join(f"{lam / mean:.2g}" for lam in DAMPING_GRID) + " |")
        for method in DAMPED:
            values = [find(results, p["problem"], "ours", method, lam) for lam in DAMPING_GRID]
            best = max(range(len(values)), key=lambda i: values[i]["lds"])
            lines.append(f"| {p['problem']} | {method} | " + " | ".join(f"**{v['lds']:.3f}**" if i == best else f"{v['lds']:.3f}" for i, v in enumerate(values)) + " |")
    return lines


def arnoldi_table(results: list[dict[str, Any]]) -> list[str]:
    """Per rank, from the exact eigendecomposition: where the query gradient and the exact factor lie, and the LDS of
    the top-r inverse alone and with the complement."""
    lines = ["| problem | p | r | μ_r / (trace(C)/p) | query gradient in the top-r eigenspace | exact factor there | LDS, top-r only | LDS, with the complement |",
             "|---|---|---|---|---|---|---|---|"]
    for p in results:
        for a in p["arnoldi_ranks"]:
            lines.append(f"| {p['problem']} | {p['n_params']} | {a['rank']} | {a['eigenvalue_r'] / a['mean_eigenvalue']:.3g} | {a['gradient_share']:.3f} | {a['factor_share']:.3f} | {a['lds_top']:.3f} | {a['lds_complement']:.3f} |")
    return lines


def ensemble_table(results: list[dict[str, Any]]) -> list[str]:
    """Per problem and method: one model's LDS, the ensemble's, and the gain with its standard error."""
    lines = ["| problem | method | 1 model | ensemble | gain (± s.e. over queries) | s (all members) |", "|---|---|---|---|---|---|"]
    for p in results:
        for e in p.get("ensembles", []):
            lines.append(f"| {p['problem']} | {e['method']} | {e['single']:.3f} | {cell(e)} | {e['gain']:+.3f} ± {e['gain_stderr']:.3f} | {e['seconds']:.2f} |")
    return lines


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """LDS (± standard error) against seconds, one panel per problem, every side's methods at λ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = {"ours": "o", "kronfluence": "s", "pydvl": "^"}
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 5.2))
    for ax, p in zip(np.atleast_1d(axes), results):
        for r in p["rows"]:
            if r["lam"] != LAMBDA or r["lds"] is None:
                continue
            ax.errorbar(max(r["seconds"], 1e-3), r["lds"], yerr=r["stderr"], fmt=markers[r["side"]], capsize=2, color="C0" if r["side"] == "ours" else "C3" if r["side"] == "kronfluence" else "C2")
            ax.annotate(f"{r['side'][:4]}: {r['method'].split(' (')[0]}{' + complement' if 'complement' in r['method'] else ''}", (max(r["seconds"], 1e-3), r["lds"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("seconds (fit + all scores, 2 threads)")
        ax.set_ylabel("LDS (mean over queries ± s.e.)")
        ax.set_title(f"{p['problem']} (p = {p['n_params']}), λ = {LAMBDA:g}", fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def section(data: dict[str, Any]) -> str:
    """The LDS section of quality.md, from lds.json."""
    results = data["problems"]
    recipe = (dm.__doc__ or "").split("\n\n")[1]
    header = (__doc__ or "").split("\n\n", 2)[2]
    return "\n".join([
        "## Linear datamodeling score (LDS)", "", header, "", recipe, "",
        f"Measured at commit {', '.join(sorted({p['commit'] for p in results}))}, on a 2-core machine shared with other work (seconds are indicative); "
        f"query accuracy of the full models: " + ", ".join(f"{p['problem']} {p['query_accuracy']:.2f}" for p in results) + ".",
        "Not measured yet (run `benchmarks/lds.py --problem NAME`): " + (", ".join(n for n in dm.PROBLEMS if n not in {p["problem"] for p in results}) or "none") + ".", "",
        *main_table(results), "", "![LDS against seconds](lds.png)", "",
        "### Targets (issue 23)", "", *targets(results), "",
        "### Damping: LDS across λ (ours; best per row in bold)", "", *damping_table(results), "",
        "### Arnoldi: what the top-r eigenbasis keeps, alone and with the complement (exact eigendecomposition)", "", *arnoldi_table(results), "",
        f"### Ensembles (TRAK): scores averaged over {MEMBERS} models trained from seeds 0..{MEMBERS - 1}", "",
        "The retrained subset models are member 0's (seed 0), so the ground truth is one seed's. Logistic regression has "
        "no rows: with weight decay its objective is strictly convex, so every seed trains to the same optimum.", "", *ensemble_table(results), "",
    ])


def write_section(text: str) -> None:
    """Replace (or append) the LDS section of quality.md, keeping what quality.py wrote above it."""
    path = RESULTS / "quality.md"
    kept = path.read_text().split("## Linear datamodeling score (LDS)")[0].rstrip() + "\n\n" if path.exists() else "# Influence quality\n\n"
    path.write_text(kept + text)


def save(result: dict[str, Any]) -> None:
    """Put one problem's result into lds.json, replacing its earlier one and keeping the others, in PROBLEMS order."""
    path = RESULTS / "lds.json"
    kept = {p["problem"]: p for p in (json.loads(path.read_text())["problems"] if path.exists() else [])}
    kept[result["problem"]] = result
    path.write_text(json.dumps({"problems": [kept[name] for name in dm.PROBLEMS if name in kept]}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="rewrite the section and plot from lds.json")
    parser.add_argument("--problem", action="append", choices=list(dm.PROBLEMS), help="measure only these (repeatable); the others' rows in lds.json are kept")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    torch.set_default_dtype(torch.float64)
    if not args.report_only:
        from distributed import Client, LocalCluster

        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "peers"), str(ROOT), os.environ.get("PYTHONPATH", "")])
        pythons = venv_pythons()
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, Client(cluster) as client:
            # all training is submitted first (full models, then subsets); the driver scores a problem while the
            # workers train the next
            names = args.problem or list(dm.PROBLEMS)
            prepared = {name: [client.submit(dm.prepare, dm.PROBLEMS[name], m, pure=False) for m in range(MEMBERS)] for name in names}
            futures = {name: dm.retrain(client, dm.PROBLEMS[name]) for name in names}
            for name in names:  # lds.json is updated problem by problem, so a failure keeps what was measured
                save({**evaluate(name, [f.result() for f in prepared[name]], pythons, client, futures[name]), "commit": measured_commit()})
    data = json.loads((RESULTS / "lds.json").read_text())
    write_section(section(data))
    plot(data["problems"], RESULTS / "lds.png")
    print(section(data))


if __name__ == "__main__":
    main()
