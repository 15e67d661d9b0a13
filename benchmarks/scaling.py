"""Scaling of the engine: wall time and memory from 1e3 to 1e6 training examples, 1 vs 2 workers, and pyDVL.

    make bench-scaling        (writes benchmarks/results/scaling.md and scaling.png)

1. Sweep: the whole flow (Prefect ephemeral API, local Dask cluster of 2 single-threaded workers, Zarr on local
   disk) on synthetic data (32 features, 2 classes), an MLP 32-32-2 trained for one epoch in the pipeline, and
   TRAK-style influence on projected gradients (Gaussian, 64 coordinates per layer; Direct solve in that space),
   100 queries, n_train = 1e3 ... 1e6. Reported: wall time per stage, the slope of log time against log n_train
   (fitted on the largest three sizes, where fixed start-up costs no longer dominate), and peak resident memory of
   the whole process tree (driver and workers).
2. Workers: the compute_influences stage at n_train = 1e6 with 1 and with 2 workers, same inputs.
3. pyDVL: the same exact influence (DirectInfluence, Hessian + λI of the mean loss, an MLP 20-16-2) computed by
   pyDVL 0.10's DaskInfluenceCalculator (in its own virtualenv, see benchmarks/pydvl/) and by this engine (fit,
   query factors, chunked scores on 2 workers), side by side in one run. Neither time includes starting the
   cluster or importing torch in the workers: pyDVL's runner warms its cluster up (see benchmarks/pydvl/README.md),
   and this engine is given an already started, warmed-up LocalCluster by address.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.memory import PeakRSS  # noqa: E402
from flows.influence_run import influence_run  # noqa: E402
from flows.parameters import RunParameters  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SIZES = [1_000, 10_000, 100_000, 300_000, 1_000_000]
REPO = Path(__file__).resolve().parents[1]


def sweep_params(out: str, n_train: int, workers: int = 2, cache: str | None = None) -> RunParameters:
    return RunParameters.model_validate(
        {
            "output_url": out,
            "dataset": {"source": "synthetic_classification", "n_train": n_train, "n_test": 100, "n_features": 32, "n_classes": 2, "chunk_rows": 65536},
            "model": {"hidden": [32]},
            "training": {"epochs": 1, "batch_size": 256, "learning_rate": 1e-2},
            "method": {"name": "direct", "regularization": 1e-3, "batch_size": 4096, "projection": {"kind": "gaussian", "dim": 64}},
            "compute": {"cluster": "local", "n_workers": workers},
            "storage": {"cache_url": cache},
        }
    )


def timed_run(params: RunParameters) -> tuple[float, int, dict]:
    with PeakRSS() as memory:
        start = time.perf_counter()
        summary = influence_run(**params.sections())
        wall = time.perf_counter() - start
    return wall, memory.peak, summary


def sweep(root: Path) -> tuple[list[dict], list[str]]:
    rows = []
    for n in SIZES:
        wall, peak, summary = timed_run(sweep_params(str(root / f"n{n}"), n))
        stages = {name: s["seconds"] for name, s in summary["stages"].items()}
        rows.append({"n": n, "wall": wall, "peak_gb": peak / 2**30, **stages})
        print(rows[-1], flush=True)
    big = rows[-3:]
    slope = float(np.polyfit(np.log([r["n"] for r in big]), np.log([r["wall"] for r in big]), 1)[0])
    influence_slope = float(np.polyfit(np.log([r["n"] for r in big]), np.log([r["compute_influences"] + r["fit_preconditioner"] for r in big]), 1)[0])
    lines = [
        "| n_train | wall s | prepare_data | fit_model | fit_preconditioner | compute_test_factors | compute_influences | aggregate | peak RSS GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']:,} | {r['wall']:.1f} | {r['prepare_data']:.1f} | {r['fit_model']:.1f} | {r['fit_preconditioner']:.1f} | {r['compute_test_factors']:.1f} | {r['compute_influences']:.1f} | {r['aggregate']:.1f} | {r['peak_gb']:.2f} |"
        )
    lines += ["", f"Slope of log wall time against log n_train over the three largest sizes (1e5..1e6): **{slope:.2f}** (target ≤ 1.05); influence stages alone (curvature fit + scores): **{influence_slope:.2f}**."]
    return rows, lines


def workers(root: Path) -> list[str]:
    cache = str(root / "shared-cache")
    times = {}
    for count in (1, 2):
        params = sweep_params(str(root / f"w{count}"), SIZES[-1], workers=count, cache=cache)
        _, _, summary = timed_run(params)
        times[count] = summary["stages"]["compute_influences"]["seconds"]
    return [f"compute_influences at n_train = {SIZES[-1]:,}: 1 worker {times[1]:.1f} s, 2 workers {times[2]:.1f} s, speedup **{times[1] / times[2]:.2f}x** (2 cores)."]


def _import_engine() -> None:
    import influence_core.methods  # noqa: F401  (torch and the engine, loaded once per worker)


def pydvl_ratio(root: Path) -> list[str]:
    """The same Direct influence by pyDVL's DaskInfluenceCalculator and by this engine."""
    setup = REPO / "benchmarks" / "pydvl" / "setup_env.sh"
    if not setup.exists():
        return ["pyDVL comparison: benchmarks/pydvl/setup_env.sh is missing."]
    python = subprocess.run(["bash", str(setup)], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    lines = ["| n_train | pyDVL fit + Dask influences s | this engine: fit + factors + scores s | ratio pyDVL / ours | same scores |", "|---|---|---|---|---|"]
    import torch

    from influence_core.pipeline.store import storage
    from influence_core.pipeline.store.loading import open_data
    from influence_core.pipeline.store.publish import stored_refs

    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True)
    with Client(cluster) as client:
        client.run(_import_engine)  # warm-up, as pyDVL's runner does
    for n in (10_000, 100_000):
        params = RunParameters.model_validate(
            {
                "output_url": str(root / f"pydvl{n}"),
                "dataset": {"source": "synthetic_classification", "n_train": n, "n_test": 100, "n_features": 20, "n_classes": 2},
                "model": {"hidden": [16]},
                "training": {"epochs": 1},
                "method": {"name": "direct", "regularization": 0.1, "second_order_mode": "hessian", "batch_size": 2048},
                "compute": {"cluster": "address", "address": cluster.scheduler_address, "train_chunk_rows": 10_000},
            }
        )
        summary = influence_run(**params.sections())
        ours = sum(summary["stages"][s]["seconds"] for s in ("fit_preconditioner", "compute_test_factors", "compute_influences"))
        group = storage.open_group(params.store().influence_url, {}, mode="r")
        refs = stored_refs(params.store(), group.attrs)
        data = open_data(refs["prepare_data"], {})
        arrays = {k: np.asarray(v[...]) for k, v in data.items()}
        npz, state = root / f"data{n}.npz", root / f"state{n}.pt"
        np.savez(npz, **arrays)
        model_ref = refs["fit_model"]
        ours_state = torch.load(model_ref.url, weights_only=True)  # Sequential(Flatten, Linear, Tanh, Linear): drop the Flatten index
        torch.save({f"{int(k.split('.', 1)[0]) - 1}.{k.split('.', 1)[1]}": v for k, v in ours_state.items()}, state)
        out = subprocess.run(
            [python, str(REPO / "benchmarks" / "pydvl" / "runner.py"), "--data", str(npz), "--state", str(state), "--hidden", "16", "--classes", "2",
             "--regularization", "0.1", "--workers", "2", "--train-chunk", "10000", "--test-chunk", "100"],
            capture_output=True, text=True,
        )
        if out.returncode != 0:
            raise RuntimeError(f"pyDVL runner failed: {out.stderr[-3000:]}")
        theirs = json.loads(out.stdout.strip().splitlines()[-1])
        scores = np.asarray(group["scores"][...], dtype=np.float64)
        agree = math.isclose(abs(theirs["scores_sum"]), abs(scores.sum()), rel_tol=1e-3) and np.allclose(np.abs(theirs["scores_first"]), np.abs(scores[0, :5]), rtol=1e-3)
        total = theirs["fit_seconds"] + theirs["influence_seconds"]
        lines.append(f"| {n:,} | {total:.1f} | {ours:.1f} | {total / ours:.1f}x | {'yes' if agree else 'NO'} |")
        print(lines[-1], flush=True)
    cluster.close()
    return lines


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ns = [r["n"] for r in rows]
    left.loglog(ns, [r["wall"] for r in rows], "o-", label="whole flow")
    left.loglog(ns, [r["compute_influences"] for r in rows], "s-", label="compute_influences")
    left.loglog(ns, [rows[-1]["wall"] * n / ns[-1] for n in ns], "k--", linewidth=0.7, label="linear")
    left.set_xlabel("n_train")
    left.set_ylabel("seconds")
    left.legend(fontsize=8)
    right.semilogx(ns, [r["peak_gb"] for r in rows], "o-")
    right.set_xlabel("n_train")
    right.set_ylabel("peak RSS of driver + workers (GB)")
    right.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(RESULTS / "scaling.png", dpi=110)


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="scaling-"))
    try:
        rows, sweep_lines = sweep(root)
        worker_lines = workers(root)
        pydvl_lines = pydvl_ratio(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    plot(rows)
    doc = (__doc__ or "").split("\n\n", 2)[2]
    text = "\n".join(["# Scaling", "", doc, "", "## Sweep", "", *sweep_lines, "", "## Workers", "", *worker_lines, "", "## Against pyDVL", "", *pydvl_lines, "", "![scaling](scaling.png)", ""])
    (RESULTS / "scaling.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
