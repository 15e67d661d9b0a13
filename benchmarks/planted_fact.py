"""Per-token attribution proven on a planted fact (issue 37 item 4).

    .venv/bin/python benchmarks/planted_fact.py [--seeds 0 1 2]   (writes benchmarks/results/planted_fact.md)

The text demo's corpus (byte windows of the standard library's docstrings, shuffled as the python_docs source does)
with one rare sentence inserted into ONE training window, between that window's own docstring text: written as an
.npz source (x_train = y_train = the windows; the query row from python_docs.query_rows). The real pipeline (Prefect
flow, EK-FAC, aggregate.token_scores) trains a model on it and scores the query "The zorblax constant equals| 7193".
Reported per model and seed: the completion's loss and greedy continuation (was the fact learnt?), the planted
window's rank among the helpful examples, and the share of its positive per-token score inside the planted
sentence (target >= 0.5; the sentence's share of the window's bytes is the uniform baseline). Models: the
pipeline's own byte-level transformer, and transformers' GPT-2 (random init) through `model.factory`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.influence_run import influence_run  # noqa: E402
from flows.parameters import RunParameters  # noqa: E402
from influence_core.pipeline.sources import python_docs  # noqa: E402
from influence_core.pipeline.store import storage  # noqa: E402
from influence_core.pipeline.store.loading import load_model  # noqa: E402
from influence_core.pipeline.store.publish import stored_refs  # noqa: E402
from influence_core.task import LanguageModelling  # noqa: E402

SENTENCE = b"The zorblax constant equals 7193."
QUERY = "The zorblax constant equals| 7193"
WIDTH, N_TRAIN, TOP_K = 128, 1000, 10
SCRATCH = Path(__file__).parent / ".scratch" / "planted_fact"
RESULTS = Path(__file__).parent / "results"
MODELS: dict[str, dict[str, Any]] = {
    "transformer (built-in, d_model 64, 2 blocks)": {"architecture": "transformer", "task": "language_modelling", "d_model": 64, "heads": 4, "layers": 2},
    "GPT-2 (transformers, model.factory, n_embd 64, 2 layers)": {
        "factory": "tests.plugin_models:gpt2_lm", "task": "language_modelling",
        "options": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": WIDTH},
    },
}
SECTIONS: dict[str, Any] = {
    "training": {"epochs": 20, "batch_size": 32, "learning_rate": 0.002, "weight_decay": 0.0},
    "method": {"name": "ekfac", "regularization": 0.001, "fisher": "sampled"},
    "aggregate": {"top_k": TOP_K, "report_queries": 1, "token_scores": True, "self_influence": "off"},
    "compute": {"cluster": "sequential"},
}


def planted_corpus(seed: int) -> tuple[np.ndarray, int, slice]:
    """N_TRAIN shuffled windows (n, WIDTH) with SENTENCE inserted after a word of one seeded window, that window's
    text shifted right and cut at WIDTH; returns the windows, the planted row and the sentence's byte span."""
    text = python_docs.corpus()
    assert b"zorblax" not in text, "the planted fact must be unique"
    rows = python_docs.windows(text, WIDTH)
    rows = rows[np.random.default_rng(seed).permutation(len(rows))][:N_TRAIN].copy()
    row = int(np.random.default_rng(seed + 1000).integers(N_TRAIN))
    original = bytes(rows[row].astype(np.uint8))
    cut = original.rfind(b" ", 0, (WIDTH - len(SENTENCE)) // 2) + 1
    rows[row] = np.frombuffer((original[:cut] + SENTENCE + b" " + original[cut:])[:WIDTH], dtype=np.uint8)
    return rows, row, slice(cut, cut + len(SENTENCE))


def completion(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, passage: np.ndarray, span: slice) -> tuple[float, float, str]:
    """-log p(completion | prompt) in nats for the query row and inside the planted window (its own left context),
    and the model's greedy continuation of the query's prompt: was the fact learnt, and does it reach the bare prompt?"""
    prompt, end = len(QUERY.split("|")[0]), len(QUERY) - 1
    labels = np.full_like(passage, -100)
    labels[span.start + prompt : span.start + end] = passage[span.start + prompt : span.start + end]
    task = LanguageModelling()
    with torch.no_grad():
        model.eval()
        query, in_passage = (float(task.loss(model(torch.from_numpy(a)), torch.from_numpy(b))[0]) for a, b in ((x, y), (passage[None], labels[None])))
        out = torch.from_numpy(x).clone()
        for t in range(prompt, end):  # position t - 1's logits predict token t
            out[0, t] = model(out)[0, t - 1].argmax()
    return query, in_passage, bytes(out[0, prompt:end].numpy().astype(np.uint8)).decode("latin-1")


def run(name: str, model: dict[str, Any], seed: int) -> dict[str, Any]:
    """One pipeline run on the planted corpus; the planted window's rank and in-sentence share of positive score."""
    rows, planted, span = planted_corpus(seed)
    x_test, y_test = python_docs.query_rows([QUERY], WIDTH)
    folder = SCRATCH / f"{'gpt2' if 'factory' in model else 'transformer'}-{seed}"  # kept: a rerun reuses its stored stages
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "data.npz", x_train=rows, y_train=rows, x_test=x_test, y_test=y_test)
    params = RunParameters.model_validate({
        "output_url": str(folder / "out"), "dataset": {"source": "npz", "path": str(folder / "data.npz")},
        "model": model, **SECTIONS, "training": {**SECTIONS["training"], "seed": seed},
    })
    influence_run(**params.sections())
    summary = json.loads((folder / "out" / "summary.json").read_text())
    store = params.store()
    group = storage.open_group(store.influence_url, store.options, mode="r")
    scores = np.asarray(group["scores"][0])
    helpful, tokens = np.asarray(group["topk_helpful_indices"][0]), np.asarray(group["topk_helpful_token_scores"][0])
    trained = load_model(stored_refs(store, group.attrs)["fit_model"], store.options)  # type: ignore[arg-type]
    loss, in_passage, greedy = completion(trained, x_test, y_test, rows[planted], span)
    result = {"model": name, "seed": seed, "loss": loss, "in_passage": in_passage, "greedy": greedy, "rank": 1 + int((scores > scores[planted]).sum()), "fraction": None,
              "seconds": summary["wall_seconds"], "reused": [name for name, stage in summary["stages"].items() if stage["outcome"] != "computed"]}
    if planted in helpful:
        positive = np.clip(tokens[list(helpful).index(planted)].astype(np.float64), 0, None)
        result["fraction"] = float(positive[span].sum() / positive.sum())
    return result


def markdown(results: list[dict[str, Any]], command: str) -> str:
    """The results table, the configuration and the command."""
    baseline = len(SENTENCE) / WIDTH
    lines = [
        "# Per-token attribution on a planted fact (issue 37 item 4)", "",
        f"`{command}` (2-core CPU shared with other work: the seconds are loose).", "",
        f"The sentence `{SENTENCE.decode()}` ({len(SENTENCE)} bytes, in no docstring) is inserted after a word of one training",
        f"window of the text demo's corpus ({N_TRAIN} shuffled {WIDTH}-byte windows of the standard library's docstrings), between",
        "that window's own text; the query is `" + QUERY + "` (measurement: -log p(completion | prompt)). Random digits",
        f"would give 4·ln 10 = {4 * np.log(10):.2f} nats. *Share in sentence*: the planted window's positive per-token score inside",
        f"the sentence's bytes over its whole positive per-token score (target ≥ 0.5; uniform over the window: {baseline:.2f}).",
        "Rows: the runs this invocation finished (the file is rewritten after each).", "",
        "| model | seed | query's completion loss (nats) | same, inside the planted window | greedy continuation | planted window's helpful rank | share in sentence | flow s (stages reused from an earlier invocation) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        share = "not in top-k" if r["fraction"] is None else f"{r['fraction']:.3f}"
        lines.append(f"| {r['model']} | {r['seed']} | {r['loss']:.2f} | {r['in_passage']:.2f} | `{r['greedy']!r}` | {r['rank']} of {N_TRAIN} | {share} | {r['seconds']:.0f} ({', '.join(r['reused']) or 'none'}) |")
    lines += ["", "Configuration (each run; `dataset`: the .npz written by the script; `training.seed`: the seed):", "", "```"]
    lines += [f"{name}: model {model}" for name, model in MODELS.items()]
    lines += [f"{section}: {values}" for section, values in SECTIONS.items()] + ["```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        for name, model in MODELS.items():
            results.append(run(name, model, seed))
            print(results[-1], flush=True)
            (RESULTS / "planted_fact.md").write_text(markdown(results, ".venv/bin/python benchmarks/planted_fact.py --seeds " + " ".join(map(str, args.seeds))))


if __name__ == "__main__":
    main()
