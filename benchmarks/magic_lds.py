"""MAGIC beside Direct, EK-FAC and TRAK on the digits MLP and CNN: each method's LDS from the pipeline's own `validate`
stage (removed rows weighted 0 in the full run's batches, the counterfactual MAGIC linearises), at 90% and 50%
subsets after the default 60 epochs, and at 50% after 10 epochs; on three recipes: the default (Adam at a constant
1e-2, the CNN with max-pools), a smooth one (3e-3 decayed linearly to 0, the CNN with average pools) and a decayed
one (the default's 1e-2 decayed linearly to 0, the CNN with average pools).

    .venv/bin/python benchmarks/magic_lds.py [--subsets 64] [--recipes default smooth decayed] [--out DIR] [--results DIR]      (make quality)

Every cell is one `influence-pipeline run` (the CLI, a fresh ephemeral Prefect API, a local 2-worker cluster, one
torch thread per stage); the runs of one problem and recipe share a `storage.cache_url`, so every method is ranked
against the same retrained models (a finished run under --out is read, not run again). Writes magic_lds.md and
magic_lds.json to --results: LDS ± s.e., the slope and Pearson correlation of the actual query-loss changes on the
predicted ones, and MAGIC's seconds against fit_model's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CLI = str(Path(sys.executable).with_name("influence-pipeline"))
METHODS: dict[str, dict[str, Any]] = {
    "magic": {"name": "magic", "query_block": 20},
    "direct": {"name": "direct", "regularization": 1e-3},
    "ekfac": {"name": "ekfac", "regularization": 1e-3},
    "trak": {"name": "direct", "regularization": 1e-3, "projection": {"kind": "gaussian", "dim": 256}},
}
CELLS = [(60, 0.9), (60, 0.5), (10, 0.5)]  # (epochs, subset fraction)
RECIPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # (training settings beside epochs, the CNN's model settings)
    "default": ({}, {}),
    "smooth": ({"learning_rate": 3e-3, "lr_decay": "linear"}, {"pooling": "avg"}),
    "decayed": ({"lr_decay": "linear"}, {"pooling": "avg"}),
}


def digits_images(path: Path) -> None:
    """The digits source's own split (the MLP problem's rows: 1,000 training, 40 queries), as 1×8×8 images."""
    from influence_core.pipeline.sources.data import open_source
    from influence_core.pipeline.specs import DigitsDataset

    source = open_source(DigitsDataset(n_train=1000, n_test=40), {})
    (x_tr, y_tr), (x_te, y_te) = (next(split.blocks()) for split in (source.train, source.test))
    np.savez(path, x_train=x_tr.reshape(-1, 1, 8, 8), y_train=y_tr, x_test=x_te.reshape(-1, 1, 8, 8), y_test=y_te)


def problems(out: Path) -> dict[str, dict[str, Any]]:
    images = out / "digits_images.npz"
    if not images.exists():
        digits_images(images)
    return {
        "MLP": {"dataset": {"source": "digits", "n_train": 1000, "n_test": 40}, "model": {"architecture": "mlp"}},
        "CNN": {"dataset": {"source": "npz", "path": str(images)}, "model": {"architecture": "cnn"}},
    }


def cell(out: Path, problem: str, base: dict[str, Any], recipe: str, epochs: int, fraction: float, method: str, subsets: int) -> dict[str, Any]:
    """One run (or its finished summary): the validation and the seconds of fit_model and of the method's stages."""
    tag = "" if recipe == "default" else f"-{recipe}"
    name = f"{problem}{tag}-e{epochs}-f{fraction}-{method}"
    run = out / "runs" / name
    if not (run / "summary.json").exists():
        config = {
            **base, "method": METHODS[method], "training": {"epochs": epochs, **RECIPES[recipe][0]}, "output_url": str(run),
            "compute": {"cluster": "local", "n_workers": 2, "torch_threads": 1}, "aggregate": {"top_k": 5, "self_influence": "off"},
            "validation": {"subsets": subsets, "fraction": fraction, "queries": 40, "counterfactual": "weights"},
            "storage": {"cache_url": str(out / f"cache-{problem}{tag}-e{epochs}")},
        }
        if problem == "CNN":
            config["model"] = {**config["model"], **RECIPES[recipe][1]}
        path = out / "configs" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config))
        subprocess.run([CLI, "run", "-c", str(path)], check=True, capture_output=True)
    summary = json.loads((run / "summary.json").read_text())
    stages = summary["stages"]
    method_stages = ("fit_preconditioner", "index_training", "compute_test_factors", "compute_influences")
    return {
        "problem": problem, "recipe": recipe, "epochs": epochs, "fraction": fraction, "method": method, **{k: summary["validation"][k] for k in ("lds_mean", "lds_stderr", "slope", "pearson")},
        "fit_model_seconds": stages["fit_model"]["seconds"], "fit_model_outcome": stages["fit_model"]["outcome"],
        "method_seconds": sum(stages[k]["seconds"] for k in method_stages if k in stages and stages[k]["outcome"] == "computed"),
        "replayed_steps": stages["compute_influences"].get("work", {}).get("replayed_steps", 0),
        "commit": summary.get("commit"), "code_version": summary.get("code_version"), "finished_at": summary["finished_at"],
    }


def table(rows: list[dict[str, Any]], subsets: int) -> list[str]:
    lines = [f"| LDS (± s.e.), slope, Pearson ({subsets} subsets) | " + " | ".join(METHODS) + " |", "|---" * (len(METHODS) + 1) + "|"]
    for recipe in RECIPES:
        for problem in ("MLP", "CNN"):
            for epochs, fraction in CELLS:
                found = {r["method"]: r for r in rows if (r["problem"], r["recipe"], r["epochs"], r["fraction"]) == (problem, recipe, epochs, fraction)}
                if not found:
                    continue
                best = max(found.values(), key=lambda r: r["lds_mean"])["method"]
                cells = [("**{}**" if m == best else "{}").format(f"{r['lds_mean']:.3f} ± {r['lds_stderr']:.3f}") + f", {r['slope']:.2f}, {r['pearson']:.2f}" if (r := found.get(m)) else "" for m in METHODS]
                lines.append(f"| {problem}, {recipe}, {epochs} epochs, {fraction:.0%} | " + " | ".join(cells) + " |")
    lines.append("")
    for r in rows:
        if r["method"] == "magic" and r["fit_model_outcome"] == "computed":
            lines.append(f"- MAGIC, {r['problem']}, {r['recipe']} recipe, {r['epochs']} epochs: {r['method_seconds']:.1f} s ({r['replayed_steps']:,.0f} replayed steps) against fit_model's {r['fit_model_seconds']:.1f} s")
    return lines


def _settings(settings: dict[str, Any]) -> str:
    return ", ".join(f"{key}: {value}" for key, value in settings.items())


def _earlier_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of an earlier results file (those from before recipes were measured are the default recipe's)."""
    return [{"recipe": "default", **r} for r in json.loads(path.read_text())] if path.exists() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subsets", type=int, default=64)
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES), help="the recipes to run; the results file keeps its rows of the others")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / ".scratch" / "magic_lds")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in _earlier_rows(args.results / "magic_lds.json") if r["recipe"] not in args.recipes]
    for recipe in args.recipes:
        for problem, base in problems(args.out).items():
            for epochs, fraction in CELLS:
                for method in METHODS:
                    rows.append(cell(args.out, problem, base, recipe, epochs, fraction, method, args.subsets))
                    print(json.dumps(rows[-1]), flush=True)
    commits = sorted({f"{r['commit']}" + (f" (library source {r['code_version']})" if r.get("code_version") else "") for r in rows})
    times = sorted(r["finished_at"] for r in rows)
    lines = [
        "# MAGIC beside the influence methods (validate's LDS, counterfactual: weights)", "",
        f"`benchmarks/magic_lds.py` over {len(rows)} runs (their summaries' commits: {', '.join(commits)}; finished {times[0][:16]} to {times[-1][:16]} UTC).",
        "Recipes (60 or 10 epochs of batch 64, weight decay 1e-3): " + "; ".join(f"{name}: {_settings(training) or 'Adam at a constant 1e-2'}{f', the CNN with {_settings(cnn)}' if cnn else ''}" for name, (training, cnn) in RECIPES.items()) + ".", "",
        *table(rows, args.subsets),
    ]
    (args.results / "magic_lds.json").write_text(json.dumps(rows, indent=1))
    (args.results / "magic_lds.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
