"""EleutherAI's bergson 2.5.1 beside the pipeline's training index (issue 38 item 6), on the same model and rows.

    .venv/bin/python benchmarks/bergson_side_by_side.py [--rounds 2]   (writes benchmarks/results/bergson.md and .json)

The data: the text demo's corpus (byte windows of the standard library's docstrings, shuffled), N_TRAIN training
windows of WIDTH bytes and N_QUERIES held-out windows as 'prompt|completion' queries (the first PROMPT bytes are the
prompt; the measurement is -log p(completion | prompt), the labels -100 on the prompt), written as an .npz source.
The model: transformers' GPT-2 (`model.factory: tests.plugin_models:gpt2_lm`), trained ONCE by the pipeline's
fit_model; its weights are then the `model.checkpoint` of every run of ours, and the same weights go to bergson as a
Hugging Face model directory (with a byte-level tokenizer: token id = byte value) beside `save_to_disk` datasets.
Attributed on both sides: the weights and biases of GPT-2's eight Conv1D layers (bergson's default layers; the tied
lm_head is left out on both sides), each training row's loss summed over its tokens, each query's over its completion.

Sides, alternating within each round, one process each, one thread each (OMP_NUM_THREADS=1, compute.torch_threads 1,
cluster sequential):
- ours: `influence-pipeline run` (trains nothing: the checkpoint; builds the index and scores the queries), then
  `influence-pipeline query` against its index; methods `identity` (gradient dot product, no preconditioning: what
  bergson computes without a Hessian), the same compressed (LoGra, index_side 16), and `ekfac`;
- bergson: benchmarks/peers/bergson_runner.py in its venv (setup_bergson.sh): `bergson build`, queries through
  `Attributor.trace`, and `bergson build` of the queries + `bergson score`; --projection_dim 0 and 16.
Reported: seconds of each step (the minimum over rounds), index bytes per training row, and recall@10 of each side's
top-10 helpful rows against our uncompressed identity scores and against our EK-FAC scores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from influence_core.pipeline.sources import python_docs  # noqa: E402
from influence_core.pipeline.specs import StorageSpec  # noqa: E402
from influence_core.pipeline.store import storage  # noqa: E402
from influence_core.pipeline.store.loading import load_model  # noqa: E402
from influence_core.pipeline.store.publish import stored_refs  # noqa: E402
from influence_core.pipeline.store.run_store import RunStore  # noqa: E402
from influence_core.task.builtin import IGNORE_INDEX  # noqa: E402

WIDTH, N_TRAIN, N_QUERIES, PROMPT, TOP_K, SEED = 64, 1000, 20, 32, 10, 0
SCRATCH = ROOT / "benchmarks" / ".scratch" / "bergson"
RESULTS = ROOT / "benchmarks" / "results"
VENV_PYTHON = ROOT / "benchmarks" / ".venvs" / "bergson" / "bin" / "python"
CLI = Path(sys.executable).parent / "influence-pipeline"
CONTEXT = 1024  # n_positions: bergson's --token_batch_size may not exceed it (16 windows per batch)
MODEL = {"factory": "tests.plugin_models:gpt2_lm", "task": "language_modelling", "options": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": CONTEXT}}
CONV1D = [f"model.transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
TRAINING = {"epochs": 10, "batch_size": 32, "learning_rate": 0.002, "weight_decay": 0.0, "seed": SEED}
COMMON = {"compute": {"cluster": "sequential", "torch_threads": 1}, "aggregate": {"top_k": TOP_K, "report_queries": 2, "self_influence": "off"}}
OURS: dict[str, dict[str, Any]] = {
    "ours identity": {"method": {"name": "identity", "modules": CONV1D}},
    "ours identity, LoGra side 16": {"method": {"name": "identity", "modules": CONV1D}, "compute": {"index_budget_gb": 0.01, "index_side": 16}},
    "ours EK-FAC": {"method": {"name": "ekfac", "regularization": 0.001, "fisher": "sampled", "modules": CONV1D}},
}
BERGSON = {"bergson, no projection": 0, "bergson, projection_dim 16": 16}
ORDER = ["ours identity", "bergson, no projection", "ours EK-FAC", "bergson, projection_dim 16", "ours identity, LoGra side 16"]
SCORING = ("compute_test_factors", "compute_influences", "aggregate")  # our run's stages after the index: the full score matrix
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def windows(width: int = WIDTH, n_train: int = N_TRAIN, n_queries: int = N_QUERIES, prompt: int = PROMPT) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training windows (n_train, width), and the held-out queries' inputs and labels (the first `prompt` labels
    IGNORE_INDEX)."""
    rows = python_docs.windows(python_docs.corpus(), width)
    rows = rows[np.random.default_rng(SEED).permutation(len(rows))]
    x_test = rows[-n_queries:].copy()
    y_test = x_test.copy()
    y_test[:, :prompt] = IGNORE_INDEX
    return rows[:n_train].copy(), x_test, y_test


def run_config(name: str, out: Path, data: Path, checkpoint: Path | None) -> Path:
    """Write the YAML (JSON is YAML) of one run of ours and return its path; no checkpoint: the training run."""
    side = OURS.get(name, OURS["ours identity"])
    model = {**MODEL, **({"checkpoint": str(checkpoint)} if checkpoint else {})}
    config = {
        "output_url": str(out), "dataset": {"source": "npz", "path": str(data)}, "model": model, "training": TRAINING,
        "method": side["method"], "compute": {**COMMON["compute"], **side.get("compute", {})}, "aggregate": COMMON["aggregate"],
    }
    path = out.parent / f"{out.name}.yaml"
    path.write_text(json.dumps(config, indent=1))
    return path


def run(command: list[str], log: Path) -> tuple[float, str]:
    """Run a command (one thread, offline), its output to log; its wall seconds and stdout. Fails loudly."""
    start = time.perf_counter()
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    log.write_text(f"$ {' '.join(command)}\n{done.stdout}\n{done.stderr}")
    if done.returncode:
        raise SystemExit(f"{command[0]} failed ({done.returncode}); see {log}")
    return wall, done.stdout


def train(data: Path) -> Path:
    """Train the model once through the pipeline (identity run, no checkpoint); save its state_dict as the checkpoint."""
    checkpoint = SCRATCH / "model.pt"
    if checkpoint.exists():
        return checkpoint
    out = SCRATCH / "train"
    run([str(CLI), "run", "--config", str(run_config("ours identity", out, data, None)), "--overwrite"], SCRATCH / "train.log")
    store = RunStore(output_url=str(out), storage=StorageSpec())
    group = storage.open_group(store.influence_url, store.options, mode="r")
    model = load_model(stored_refs(store, group.attrs)["fit_model"], store.options)  # type: ignore[arg-type]
    torch.save(model.state_dict(), checkpoint)
    return checkpoint


def export_for_bergson(checkpoint: Path, x_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, dest: Path = SCRATCH, options: dict[str, Any] = MODEL["options"]) -> dict[str, Path]:
    """The GPT-2 of `checkpoint` (built with `options`) as a Hugging Face model directory with a byte-level tokenizer,
    and the rows as save_to_disk datasets under `dest` (text as latin-1, one char per byte; input_ids the bytes; the
    queries' labels mask the prompt)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from tests.plugin_models import gpt2_lm

    paths = {"model": dest / "hf_model", "train": dest / "hf_train", "queries": dest / "hf_queries"}
    wrapper = gpt2_lm(**options)
    wrapper.load_state_dict(torch.load(checkpoint, weights_only=True))
    wrapper.model.save_pretrained(paths["model"])
    vocab = {bytes([i]).decode("latin-1"): i for i in range(256)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[])), model_max_length=options["n_positions"])
    text = [bytes(row.astype(np.uint8)).decode("latin-1") for row in x_train]
    assert tokenizer(text[0])["input_ids"] == x_train[0].tolist(), "the tokenizer must give the byte values"
    tokenizer.save_pretrained(paths["model"])
    Dataset.from_dict({"text": text, "input_ids": x_train.tolist()}).save_to_disk(paths["train"])
    queries = [bytes(row.astype(np.uint8)).decode("latin-1") for row in x_test]
    Dataset.from_dict({"text": queries, "input_ids": x_test.tolist(), "labels": y_test.tolist()}).save_to_disk(paths["queries"])
    return paths


def ours(name: str, data: Path, queries: Path, checkpoint: Path, round_: int) -> dict[str, Any]:
    """One run of ours (index built, queries scored), then a query against its index: seconds, bytes per row, scores."""
    out = SCRATCH / f"{name.replace(' ', '_').replace(',', '')}-{round_}"
    shutil.rmtree(out, ignore_errors=True)  # a fresh store: every stage computed, none found from an earlier invocation
    config = run_config(name, out, data, checkpoint)
    first, _ = run([str(CLI), "run", "--config", str(config), "--overwrite"], out.parent / f"{out.name}.run.log")
    again, printed = run([str(CLI), "query", str(out), "--queries", str(queries), "--top", str(TOP_K)], out.parent / f"{out.name}.query.log")
    asked = re.search(r"queries in ([0-9.]+) s", printed)
    summary = json.loads((out / "summary.json").read_text())
    stages = {stage: s["seconds"] for stage, s in summary["stages"].items()}
    reused = [stage for stage, s in summary["stages"].items() if s["outcome"] != "computed"]
    if reused:
        raise SystemExit(f"{name}: stages {reused} were not computed in {out}; their seconds would be an earlier run's")
    store = RunStore(output_url=str(out), storage=StorageSpec())
    scores = np.asarray(storage.open_group(store.influence_url, store.options, mode="r")["scores"][:])
    index = summary["stages"]["index_training"]
    return {
        "seconds": {"build": stages.get("fit_preconditioner", 0.0) + stages["index_training"], "score": sum(stages.get(k, 0.0) for k in SCORING),
                    "run_wall": first, "query_wall": again, "query": float(asked.group(1)) if asked else float("nan"), "stages": stages},
        "bytes_per_row": index["bytes_per_row"], "index": index["compression"] + (f" side {index['side']}" if index.get("side") else ""), "scores": scores,
    }


def bergson(projection_dim: int, paths: dict[str, Path], round_: int) -> dict[str, Any]:
    """bergson's runner in its venv: build, Attributor queries, score; seconds, bytes per row, scores, top-k."""
    out = SCRATCH / f"bergson-{projection_dim}-{round_}"
    command = [str(VENV_PYTHON), "benchmarks/peers/bergson_runner.py", "--model", str(paths["model"]), "--train", str(paths["train"]),
               "--queries", str(paths["queries"]), "--out", str(out), "--projection-dim", str(projection_dim), "--top-k", str(TOP_K)]
    wall, printed = run(command, SCRATCH / f"bergson-{projection_dim}-{round_}.log")
    result = json.loads(printed.strip().splitlines()[-1])
    result["seconds"]["process_wall"] = wall
    return {**result, "scores": np.load(out / "scores.npy"), "topk": np.load(out / "topk.npy"), "command": " ".join(command)}


def top(scores: np.ndarray) -> np.ndarray:
    """Each query's TOP_K most helpful training rows (highest scores)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :TOP_K]


def recall(found: np.ndarray, reference: np.ndarray) -> float:
    """Mean over queries of |found ∩ reference| / TOP_K."""
    return float(np.mean([len(set(a) & set(b)) / TOP_K for a, b in zip(found, reference)]))


def fastest(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Each flat timing's minimum over the rounds."""
    keys = [k for k, v in rounds[0]["seconds"].items() if isinstance(v, float)]
    return {k: min(r["seconds"][k] for r in rounds) for k in keys}


def analyse(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per side: fastest seconds, bytes per row, recall@10 against ours identity and EK-FAC, Pearson with identity."""
    identity, ekfac = results["ours identity"][-1]["scores"], results["ours EK-FAC"][-1]["scores"]
    table = {}
    for name, rounds in results.items():
        last = rounds[-1]
        found = top(last["scores"])
        row = {"seconds": fastest(rounds), "bytes_per_row": last["bytes_per_row"], "recall_identity": recall(found, top(identity)), "recall_ekfac": recall(found, top(ekfac)),
               "pearson_identity": float(np.corrcoef(last["scores"].ravel(), identity.ravel())[0, 1])}
        if "topk" in last:
            row["query_recall_identity"] = recall(last["topk"], top(identity))
            row["commands"] = last["commands"]
        else:
            row["index"] = last["index"]
        table[name] = row
    return table


READING = "<!-- reading: kept when the script rewrites the table -->"


def markdown(table: dict[str, Any], rounds: int, command: str, reading: str) -> str:
    """The results page: the table, how each side was run, and the reading kept from the previous page."""
    lines = [
        "# bergson 2.5.1 side by side (issue 38 item 6)", "",
        f"`{command}` on this project's 2-core CPU (shared with other work: the seconds are loose), every process on ONE thread",
        f"(OMP_NUM_THREADS=1; ours `compute.torch_threads: 1`, `cluster: sequential`), sides alternating, {rounds} round(s), seconds the minimum.",
        f"{N_TRAIN} training windows of {WIDTH} bytes, {N_QUERIES} held-out queries (prompt {PROMPT} bytes, completion {WIDTH - PROMPT}), GPT-2 {MODEL['options']},",
        f"trained once by fit_model ({TRAINING}); attributed: the weights and biases of its eight Conv1D layers (99,456 numbers).", "",
        "| side | build s | query s (20 queries) | score s (full matrix) | index bytes / training row | recall@10 vs ours identity | recall@10 vs ours EK-FAC | Pearson with ours identity |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in table.items():
        s = row["seconds"]
        if name.startswith("bergson"):
            query, score = f"{s['query']:.2f} (Attributor; + {s['import']:.1f} import)", f"{s['score']:.2f}"
        else:
            query, score = f"{s['query']:.2f} (`query`: {s['query_wall']:.1f} wall)", f"{s['score']:.2f} (`run`: {s['run_wall']:.1f} wall)"
        lines.append(f"| {name} | {s['build']:.2f} | {query} | {score} | {row['bytes_per_row']:,} | {row['recall_identity']:.3f} | {row['recall_ekfac']:.3f} | {row['pearson_identity']:.4f} |")
    lines += ["", "Commands of the last round (paths under benchmarks/.scratch/bergson/; `S` below):", "", "```"]
    for name in ORDER:
        if name in BERGSON:
            lines += [c.replace(str(SCRATCH), "$S") for c in table[name]["commands"].values()]
        else:
            stem = f"$S/{name.replace(' ', '_').replace(',', '')}-{rounds - 1}"
            extra = "".join(f", compute.{k} {v}" for k, v in OURS[name].get("compute", {}).items())
            lines += [f"influence-pipeline run --config {stem}.yaml --overwrite   # method {OURS[name]['method']['name']}, {table[name]['index']} index{extra}",
                      f"influence-pipeline query {stem} --queries $S/queries.npz --top {TOP_K}"]
    lines += ["```", "", READING, reading]
    return "\n".join(lines) + "\n"


def previous_reading() -> str:
    """The hand-written reading below the marker of the existing results page, if any."""
    page = RESULTS / "bergson.md"
    text = page.read_text() if page.exists() else ""
    return text.split(READING, 1)[1].strip("\n") if READING in text else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    SCRATCH.mkdir(parents=True, exist_ok=True)
    x_train, x_test, y_test = windows()
    data, queries = SCRATCH / "data.npz", SCRATCH / "queries.npz"
    np.savez(data, x_train=x_train, y_train=x_train, x_test=x_test, y_test=y_test)
    np.savez(queries, x_test=x_test, y_test=y_test)
    checkpoint = train(data)
    paths = export_for_bergson(checkpoint, x_train, x_test, y_test)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in ORDER}
    for round_ in range(args.rounds):
        for name in ORDER:
            side = bergson(BERGSON[name], paths, round_) if name in BERGSON else ours(name, data, queries, checkpoint, round_)
            results[name].append(side)
            print(name, round_, {k: v for k, v in side.items() if k not in ("scores", "topk")}, flush=True)
    table = analyse(results)
    command = ".venv/bin/python benchmarks/bergson_side_by_side.py --rounds " + str(args.rounds)
    (RESULTS / "bergson.json").write_text(json.dumps({"command": command, "sides": table}, indent=1))
    (RESULTS / "bergson.md").write_text(markdown(table, args.rounds, command, previous_reading()))


if __name__ == "__main__":
    main()
