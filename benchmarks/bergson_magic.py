"""MAGIC side by side with EleutherAI's bergson 2.5.1 `magic` (issue 36 item 4): the same GPT-2, initial weights, rows,
queries and recipe; each side trains, replays its training for per-query metagradients and checks them against its
own leave-subset-out retraining.

    .venv/bin/python benchmarks/bergson_magic.py   (writes benchmarks/results/bergson_magic.md and .json)

The problem: transformers' GPT-2 (`tests.plugin_models:gpt2_lm`, dropout 0), built with torch.manual_seed(SEED) as
fit_model builds it; those initial weights go to bergson as a Hugging Face model directory (byte-level tokenizer: token
id = byte value). Rows: N_TRAIN byte windows of the text demo's corpus; N_QUERIES held-out windows, each measured by
its whole window's loss. The recipe on both sides: EPOCHS epochs of batches of BATCH, Adam (β 0.9, 0.999, ε 1e-8; no
weight decay, so Adam and AdamW agree) at LR decayed linearly to 0, in float32.
- ours: `influence-pipeline run` with method magic (one query block) and validation.counterfactual weights;
- bergson: `bergson magic` with --aggregation none (one backward per query; bergson reduces queries to one gradient
  otherwise) and --noskip_validation (its LDS retrains with the removed documents' weights 0 in the same schedule).
Both validations: SUBSETS random subsets, each removing 10% of the training rows. The LDS of each side is the mean over
queries of the Spearman correlation between a subset's summed scores and its retrained query-loss change (bergson's
own statistic, recomputed from its validation.csv). Seconds: each side's process wall time, and ours by stage. The
sides differ where the libraries do: batch order (each side's seeded shuffle) and the training loss's normalisation
(ours: the mean over rows of each row's loss; bergson: the mean over the batch's tokens; windows have equal lengths).
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bergson_side_by_side import CLI, RESULTS, VENV_PYTHON, export_for_bergson, run, windows  # noqa: E402

WIDTH, N_TRAIN, N_QUERIES, EPOCHS, BATCH, SUBSETS, SEED = 32, 256, 8, 4, 16, 64, 0
REMOVED = 0.1  # share of the training rows each validation subset removes
OPTIONS = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": WIDTH, "dropout": 0.0}
SCRATCH = ROOT / "benchmarks" / ".scratch" / "bergson_magic"
BERGSON = VENV_PYTHON.with_name("bergson")


def initial_weights() -> Path:
    """The GPT-2's weights before training, as fit_model draws them (torch.manual_seed(seed), then the factory)."""
    from tests.plugin_models import gpt2_lm

    torch.manual_seed(SEED)
    path = SCRATCH / "init.pt"
    torch.save(gpt2_lm(**OPTIONS).state_dict(), path)
    return path


def ours(data: Path, lr: float, dtype: str) -> dict[str, Any]:
    """Our run: fit_model, MAGIC over the queries, validation; the LDS, slope and seconds from its summary."""
    out = SCRATCH / f"ours-{lr:g}-{dtype}"
    config = {
        "output_url": str(out), "dataset": {"source": "npz", "path": str(data)},
        "model": {"factory": "tests.plugin_models:gpt2_lm", "task": "language_modelling", "options": OPTIONS, "dtype": dtype},
        "training": {"epochs": EPOCHS, "batch_size": BATCH, "learning_rate": lr, "lr_decay": "linear", "weight_decay": 0.0, "seed": SEED},
        "method": {"name": "magic", "query_block": N_QUERIES},
        "validation": {"subsets": SUBSETS, "fraction": 1 - REMOVED, "queries": N_QUERIES, "counterfactual": "weights"},
        "compute": {"cluster": "sequential", "torch_threads": 1}, "aggregate": {"top_k": 5, "self_influence": "off"},
    }
    path = SCRATCH / f"{out.name}.yaml"
    path.write_text(json.dumps(config, indent=1))
    wall, _ = run([str(CLI), "run", "--config", str(path), "--overwrite"], SCRATCH / f"{out.name}.log")
    summary = json.loads((out / "summary.json").read_text())
    validation = summary["validation"]
    return {"command": f"influence-pipeline run --config {path.relative_to(ROOT)} --overwrite", "wall": wall,
            "lds": validation["lds_mean"], "lds_stderr": validation.get("lds_stderr"), "slope": validation.get("slope"),
            "stages": {name: stage["seconds"] for name, stage in summary["stages"].items()}, "replayed_steps": summary["stages"]["compute_influences"]["work"]["replayed_steps"]}


def bergson(paths: dict[str, Path], lr: float, dtype: str) -> dict[str, Any]:
    """bergson magic in its venv (training, per-query backward passes, its leave-subset-out validation)."""
    out = SCRATCH / f"bergson-{lr:g}-{dtype}"
    command = [str(BERGSON), "magic", str(out), "--model", str(paths["model"]), "--precision", {"float32": "fp32", "float64": "fp64"}[dtype],
               "--data.dataset", str(paths["train"]), "--query.dataset", str(paths["queries"]), "--aggregation", "none",
               "--batch_size", str(BATCH), "--num_epochs", str(EPOCHS), "--seed", str(SEED),
               "--lr", str(lr), "--lr_scheduler_type", "linear", "--warmup_steps", "0",
               "--adam_beta1", "0.9", "--adam_beta2", "0.999", "--adam_eps", "1e-8", "--weight_decay", "0",
               "--noskip_validation", "--method", "lds", "--count", str(SUBSETS), "--fraction", str(REMOVED),
               "--wandb_project", "", "--overwrite"]
    wall, _ = run(command, SCRATCH / f"{out.name}.log")
    lds = bergson_lds(out / "validation.csv")
    return {"command": shlex.join(command).replace(str(SCRATCH), "$S").replace(f"{ROOT}/", ""), "wall": wall, **lds}


def bergson_lds(path: Path) -> dict[str, float]:
    """From bergson's validation.csv: the mean over queries of Spearman(score sums, loss changes) across subsets (its
    own statistic), and the slope through 0 of the actual changes on the predicted ones (as influence_core.lds)."""
    rows = list(csv.DictReader(path.open()))
    queries = sorted({int(r["query"]) for r in rows})
    rhos = []
    for q in queries:
        mine = [r for r in rows if int(r["query"]) == q]
        rhos.append(spearmanr([float(r["score_sum"]) for r in mine], [float(r["diff"]) for r in mine]).statistic)
    predicted, actual = (np.array([float(r[k]) for r in rows]) for k in ("score_sum", "diff"))  # both negated: Δm = −diff, predicted −score_sum
    return {"lds": float(np.mean(rhos)), "lds_stderr": float(np.std(rhos, ddof=1) / np.sqrt(len(rhos))),
            "slope": float((predicted * actual).sum() / (predicted * predicted).sum()), "subsets": len(rows) // len(queries)}


def compare(ours_run: Path, bergson_run: Path) -> dict[str, dict[str, float]]:
    """Each side's largest |score| over its median (how far a few metagradients blow up), and the mean over queries
    of the Spearman correlation of the two sides' scores over the training rows (bergson's dm/dw negated: ours is
    −n·dm/dw)."""
    import zarr

    mine = np.asarray(zarr.open_group(str(ours_run / "influence.zarr"), mode="r")["scores"][:])
    theirs = np.stack([torch.load(bergson_run / "per_query" / f"q{q}.pt", weights_only=True).numpy() for q in range(len(mine))])
    together = float(np.mean([spearmanr(a, -b).statistic for a, b in zip(mine, theirs)]))
    return {side: {"agreement": together, "spread": float(np.abs(s).max() / np.median(np.abs(s)))} for side, s in (("ours", mine), ("bergson", theirs))}


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    """The results page: one line per (learning rate, side)."""
    lines = [
        "# MAGIC beside bergson 2.5.1's `magic` (issue 36)", "",
        f"`{command}` on this 2-core CPU, one thread a side; the problem and recipe are in the script's docstring",
        f"(GPT-2 {OPTIONS['n_layer']} layers × {OPTIONS['n_embd']}, {N_TRAIN} windows of {WIDTH} bytes, {N_QUERIES} queries, {EPOCHS} epochs of {BATCH}, Adam decayed linearly; {SUBSETS} subsets each removing {REMOVED:.0%}).", "",
        "| lr | dtype | side | LDS ± s.e. | slope | largest / median abs score | seconds (wall) | scores' Spearman with the other side |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['lr']:g} | {r['dtype']} | {r['side']} | {r['lds']:.3f} ± {r['lds_stderr']:.3f} | {r['slope']:.3g} | {r['spread']:,.0f} | {r['wall']:.1f} | {r['agreement']:.3f} |")
    lines += ["", "Our stages' seconds (fit_model is one training run):", ""]
    lines += [f"- lr {r['lr']:g}, {r['dtype']}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["stages"].items()) + f" ({r['replayed_steps']:.0f} steps replayed)" for r in rows if r["side"] == "ours"]
    lines += ["", "Commands (`$S` = benchmarks/.scratch/bergson_magic):", "", "```"] + [r["command"] for r in rows] + ["```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-3, 3e-3], help="one side-by-side per learning rate")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args()
    shutil.rmtree(SCRATCH, ignore_errors=True)
    SCRATCH.mkdir(parents=True)
    x_train, x_test, _ = windows(WIDTH, N_TRAIN, N_QUERIES, prompt=0)
    data = SCRATCH / "data.npz"
    np.savez(data, x_train=x_train, y_train=x_train, x_test=x_test, y_test=x_test)
    paths = export_for_bergson(initial_weights(), x_train, x_test, x_test, dest=SCRATCH, options=OPTIONS)
    rows = []
    for i, lr in enumerate(args.lr):
        pair = {}
        for side in (["ours", "bergson"] if i % 2 == 0 else ["bergson", "ours"]):  # alternating which side goes first
            pair[side] = ours(data, lr, args.dtype) if side == "ours" else bergson(paths, lr, args.dtype)
            print(side, lr, {k: v for k, v in pair[side].items() if k != "command"}, flush=True)
        both = compare(SCRATCH / f"ours-{lr:g}-{args.dtype}", SCRATCH / f"bergson-{lr:g}-{args.dtype}")
        rows += [{"lr": lr, "dtype": args.dtype, "side": side, **both[side], **pair[side]} for side in ("ours", "bergson")]
    command = ".venv/bin/python benchmarks/bergson_magic.py --lr " + " ".join(f"{lr:g}" for lr in args.lr) + f" --dtype {args.dtype}"
    problem = {"width": WIDTH, "n_train": N_TRAIN, "n_queries": N_QUERIES, "epochs": EPOCHS, "batch": BATCH, "subsets": SUBSETS, "removed": REMOVED, "model": OPTIONS}
    (RESULTS / "bergson_magic.json").write_text(json.dumps({"command": command, "problem": problem, "rows": rows}, indent=1))
    (RESULTS / "bergson_magic.md").write_text(markdown(rows, command))


if __name__ == "__main__":
    main()
