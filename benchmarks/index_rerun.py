"""Index once, query many, measured: a run without the index (today's full run), the first run that builds the index,
and a rerun that asks the next held-out queries of the same training rows (`dataset.query_offset`, a shared stage
cache), side by side in one process.

    .venv/bin/python benchmarks/index_rerun.py [--quick] [--workloads W3 W4] [--queries 20 500] [--out DIR]

W3: synthetic 100-feature classification, MLP 100-1024-1024-10 (ReLU), 5,000 rows, EK-FAC; W4: `make demo-text`'s byte
GPT on 2,000 docstring windows, EK-FAC (the workloads of benchmarks/peers). Every side runs the whole Prefect flow on
the ephemeral API and a local 2-worker cluster; the sides alternate (today, first, rerun), each with a fresh output.
Prints, and writes to DIR/index_rerun.md, each stage's seconds and gradient rows, and the rerun's share of the first
run's stage seconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.influence_run import influence_run  # noqa: E402
from flows.parameters import RunParameters  # noqa: E402

TRAINING_SIDE = ("fit_model", "fit_preconditioner", "index_training")


def workload(name: str, quick: bool, n_test: int) -> dict[str, Any]:
    """The run's parameters (less output and storage) of workload `name` asking `n_test` queries."""
    compute = {"cluster": "local", "n_workers": 2}
    if name == "W3":
        return {
            "dataset": {"source": "synthetic_classification", "n_features": 100, "n_classes": 10, "n_train": 300 if quick else 5000, "n_test": n_test, "seed": 0},
            "model": {"architecture": "mlp", "hidden": [128, 128] if quick else [1024, 1024], "activation": "relu"},
            "training": {"epochs": 5 if quick else 10, "batch_size": 128, "learning_rate": 1e-3, "weight_decay": 1e-3},
            "method": {"name": "ekfac", "regularization": 1e-3, "fisher": "sampled", "batch_size": 256}, "compute": compute,
            "aggregate": {"top_k": 5, "self_influence": "off"},
        }
    return {
        "dataset": {"source": "python_docs", "window": 64, "n_train": 200 if quick else 2000, "n_test": n_test},
        "model": {"architecture": "transformer", "task": "language_modelling", "d_model": 32 if quick else 128, "heads": 2 if quick else 4, "layers": 2},
        "training": {"epochs": 2 if quick else 8, "batch_size": 32, "learning_rate": 2e-3, "weight_decay": 0.0},
        "method": {"name": "ekfac", "regularization": 1e-3, "fisher": "sampled", "batch_size": 64}, "compute": compute,
        "aggregate": {"top_k": 5, "self_influence": "off"},
    }


def run(config: dict[str, Any], out: Path, cache: Path, index: bool) -> dict[str, Any]:
    """One whole flow; its wall seconds and per-stage outcome, seconds and gradient rows."""
    shutil.rmtree(out, ignore_errors=True)
    compute = {**config["compute"], **({} if index else {"index_budget_gb": 0})}
    params = RunParameters.model_validate({**config, "compute": compute, "output_url": str(out), "storage": {"cache_url": str(cache)}})
    start = time.perf_counter()
    summary = influence_run(**params.sections())
    wall = time.perf_counter() - start
    stages = {
        name: {"outcome": s["outcome"], "seconds": s["seconds"] if s["outcome"] == "computed" else s["wall_seconds"], "gradient_rows": s.get("work", {}).get("gradient_rows", 0), "index": {k: s[k] for k in ("compression", "bytes_per_row") if k in s}}
        for name, s in summary["stages"].items()
    }
    return {"wall": wall, "stages": stages}


def measure(name: str, quick: bool, n_test: int, out: Path) -> dict[str, Any]:
    """Today's run, the first indexed run and a rerun with the next n_test held-out queries (`dataset.query_offset`)."""
    shared = out / f"{name}-{n_test}-cache"
    shutil.rmtree(shared, ignore_errors=True)
    today = run(workload(name, quick, n_test), out / "today", out / f"{name}-{n_test}-today-cache", index=False)
    first = run(workload(name, quick, n_test), out / "first", shared, index=True)
    others = workload(name, quick, n_test)
    others["dataset"]["query_offset"] = n_test
    again = run(others, out / "rerun", shared, index=True)
    return {"today": today, "first": first, "rerun": again}


def stage_seconds(side: dict[str, Any]) -> float:
    return sum(s["seconds"] for s in side["stages"].values())


def table(name: str, n_test: int, sides: dict[str, Any]) -> list[str]:
    asked = int(sides["rerun"]["stages"]["compute_test_factors"]["gradient_rows"])
    lines = [f"### {name}, {n_test} queries (the rerun asks {asked:,} others)", "", "| stage | today: outcome, s, gradient rows | first: outcome, s, gradient rows | rerun: outcome, s, gradient rows |", "|---|---|---|---|"]
    names = list(sides["first"]["stages"])
    for stage in names:
        cells = []
        for side in ("today", "first", "rerun"):
            s = sides[side]["stages"].get(stage)
            cells.append("—" if s is None else f"{s['outcome']}, {s['seconds']:.2f}, {s['gradient_rows']:,}")
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    today, first, rerun = (stage_seconds(sides[k]) for k in ("today", "first", "rerun"))
    training = sum(s["gradient_rows"] for k, s in sides["rerun"]["stages"].items() if s["outcome"] == "computed" and k in TRAINING_SIDE)
    lines += [
        "", f"Stage seconds: today {today:.2f}, first {first:.2f} ({first / today:.2f}× today), rerun {rerun:.2f} ({100 * rerun / first:.1f}% of the first).",
        f"Flow wall: today {sides['today']['wall']:.1f} s, first {sides['first']['wall']:.1f} s, rerun {sides['rerun']['wall']:.1f} s. The rerun's training-side gradient rows: {training}.",
        f"Index: {sides['first']['stages'].get('index_training', {}).get('index', {})}", "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workloads", nargs="+", default=["W3", "W4"], choices=["W3", "W4"])
    parser.add_argument("--queries", nargs="+", type=int, default=[20, 500])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/.scratch/index_rerun"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results, lines = {}, [f"# Index once, query many ({'quick' if args.quick else 'full'} workloads)", ""]
    for name in args.workloads:
        for n_test in args.queries:
            results[f"{name}-{n_test}"] = sides = measure(name, args.quick, n_test, args.out)
            lines += table(name, n_test, sides)
            print("\n".join(table(name, n_test, sides)), flush=True)
    (args.out / "index_rerun.json").write_text(json.dumps(results, indent=1))
    (args.out / "index_rerun.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
