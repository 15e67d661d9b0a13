"""Per-token attribution proven on a planted fact (issue 37 item 4).

    .venv/bin/python benchmarks/planted_fact.py [--seeds 0 1 2]   (writes benchmarks/results/planted_fact.md)

The text demo's corpus (byte windows of the standard library's docstrings, shuffled as the python_docs source does)
with one rare sentence opening ONE training window, that window's own docstring text after it: written as an
.npz source (x_train = y_train = the windows; the query row from python_docs.query_rows). The real pipeline (Prefect
flow, EK-FAC, aggregate.token_scores) trains a model on it and scores the query "The zorblax constant equals| 7193".
The sentence opens its window as the query's prompt opens the query's row: these small byte-level models learn a fact
tied to the text before it, so a fact planted mid-window is learnt there but not from the bare prompt (see the
results file). Reported per model and seed: the completion's loss and greedy continuation (was the fact learnt?), the planted
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
WIDTH, N_TRAIN, TOP_K = 128, 300, 10
SCRATCH = Path(__file__).parent / ".scratch" / "planted_fact"
RESULTS = Path(__file__).parent / "results"
# Each model with a recipe under which it can learn the fact from the bare prompt (tried before, seed 0: GPT-2 with the
# transformer's recipe stays near 15 nats; dropout off, batches of 8 and 120 epochs bring it to about 4.5)
MODELS: dict[str, dict[str, Any]] = {
    "transformer (built-in, d_model 64, 2 blocks)": {
        "model": {"architecture": "transformer", "task": "language_modelling", "d_model": 64, "heads": 4, "layers": 2},
        "training": {"epochs": 60, "batch_size": 32, "learning_rate": 0.005, "weight_decay": 0.0},
    },
    "GPT-2 (transformers, model.factory, n_embd 64, 2 layers)": {
        "model": {"factory": "tests.plugin_models:gpt2_lm", "task": "language_modelling",
                  "options": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": WIDTH, "dropout": 0.0}},
        "training": {"epochs": 120, "batch_size": 8, "learning_rate": 0.005, "weight_decay": 0.0},
    },
}
SECTIONS: dict[str, Any] = {
    "method": {"name": "ekfac", "regularization": 0.001, "fisher": "sampled"},
    "aggregate": {"top_k": TOP_K, "report_queries": 1, "token_scores": True, "self_influence": "off"},
    "compute": {"cluster": "sequential", "torch_threads": 1},  # one thread: the 2-core machine runs other work beside it
}


def planted_corpus(seed: int) -> tuple[np.ndarray, int, slice]:
    """N_TRAIN shuffled windows (n, WIDTH) with SENTENCE opening one seeded window, that window's text shifted right
    and cut at WIDTH; returns the windows, the planted row and the sentence's byte span."""
    text = python_docs.corpus()
    assert b"zorblax" not in text, "the planted fact must be unique"
    rows = python_docs.windows(text, WIDTH)
    rows = rows[np.random.default_rng(seed).permutation(len(rows))][:N_TRAIN].copy()
    row = int(np.random.default_rng(seed + 1000).integers(N_TRAIN))
    original = bytes(rows[row].astype(np.uint8))
    rows[row] = np.frombuffer((SENTENCE + b" " + original)[:WIDTH], dtype=np.uint8)
    return rows, row, slice(0, len(SENTENCE))


def completion(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, str]:
    """-log p(completion | prompt) in nats for the query row, and the model's greedy continuation of its prompt: was
    the fact learnt? (The planted window opens with the query's text, so the loss inside it is the same number.)"""
    prompt, end = len(QUERY.split("|")[0]), len(QUERY) - 1
    task = LanguageModelling()
    with torch.no_grad():
        model.eval()
        loss = float(task.loss(model(torch.from_numpy(x)), torch.from_numpy(y))[0])
        out = torch.from_numpy(x).clone()
        for t in range(prompt, end):  # position t - 1's logits predict token t
            out[0, t] = model(out)[0, t - 1].argmax()
    return loss, bytes(out[0, prompt:end].numpy().astype(np.uint8)).decode("latin-1")


def run(name: str, setup: dict[str, Any], seed: int) -> dict[str, Any]:
    """One pipeline run on the planted corpus; the planted window's rank and in-sentence share of positive score."""
    rows, planted, span = planted_corpus(seed)
    x_test, y_test = python_docs.query_rows([QUERY], WIDTH)
    folder = SCRATCH / f"{'gpt2' if 'factory' in setup['model'] else 'transformer'}-{seed}"  # kept: a rerun reuses its stored stages
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "data.npz", x_train=rows, y_train=rows, x_test=x_test, y_test=y_test)
    params = RunParameters.model_validate({
        "output_url": str(folder / "out"), "dataset": {"source": "npz", "path": str(folder / "data.npz")},
        "model": setup["model"], **SECTIONS, "training": {**setup["training"], "seed": seed},
    })
    influence_run(**params.sections())
    summary = json.loads((folder / "out" / "summary.json").read_text())
    store = params.store()
    group = storage.open_group(store.influence_url, store.options, mode="r")
    scores = np.asarray(group["scores"][0])
    helpful, tokens = np.asarray(group["topk_helpful_indices"][0]), np.asarray(group["topk_helpful_token_scores"][0])
    trained = load_model(stored_refs(store, group.attrs)["fit_model"], store.options)  # type: ignore[arg-type]
    loss, greedy = completion(trained, x_test, y_test)
    result = {"model": name, "seed": seed, "loss": loss, "greedy": greedy, "learnt": greedy == QUERY.split("|")[1], "rank": 1 + int((scores > scores[planted]).sum()), "fraction": None,
              "seconds": summary["wall_seconds"], "reused": [name for name, stage in summary["stages"].items() if stage["outcome"] != "computed"]}
    if planted in helpful:
        positive = np.clip(tokens[list(helpful).index(planted)].astype(np.float64), 0, None)
        result["fraction"] = float(positive[span].sum() / positive.sum())
    return result


def markdown(results: list[dict[str, Any]], command: str) -> str:
    """The results table, a line over the seeds, the configuration and the command."""
    baseline = len(SENTENCE) / WIDTH
    shares = [r["fraction"] or 0.0 for r in results]
    learnt = [r for r in results if r["learnt"]]
    lines = [
        "# Per-token attribution on a planted fact (issue 37 item 4)", "",
        f"`{command}` (2-core CPU shared with other work: the seconds are loose).", "",
        f"The sentence `{SENTENCE.decode()}` ({len(SENTENCE)} bytes, in no docstring) opens one training window of the text",
        f"demo's corpus ({N_TRAIN} shuffled {WIDTH}-byte windows of the standard library's docstrings), that window's own text",
        "after it; the query is `" + QUERY + "` (measurement: -log p(completion | prompt)). Random digits would give",
        f"4·ln 10 = {4 * np.log(10):.2f} nats; *learnt*: the greedy continuation of the bare prompt is the planted digits.",
        "*Share in sentence*: the planted window's positive per-token score inside the sentence's bytes over its whole",
        f"positive per-token score (target ≥ 0.5; uniform over the window: {baseline:.2f}; a share is 0 where the window is not",
        "in the query's top-k). Rows: the runs this invocation finished (the file is rewritten after each).", "",
        "| model | seed | completion loss (nats) | greedy continuation | learnt | planted window's helpful rank | share in sentence | flow s (stages reused from an earlier invocation) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        share = "not in top-k" if r["fraction"] is None else f"{r['fraction']:.3f}"
        lines.append(f"| {r['model']} | {r['seed']} | {r['loss']:.2f} | `{r['greedy']!r}` | {'yes' if r['learnt'] else 'no'} | {r['rank']} of {N_TRAIN} | {share} | {r['seconds']:.0f} ({', '.join(r['reused']) or 'none'}) |")
    lines += ["", f"Over the {len(results)} runs: learnt in {sum(r['learnt'] for r in results)}, planted window ranked 1st in "
              f"{sum(r['rank'] == 1 for r in results)}, share in sentence min {min(shares):.3f}, mean {np.mean(shares):.3f}; of the {len(learnt)} "
              f"that learnt it, ranked 1st in {sum(r['rank'] == 1 for r in learnt)}"
              + (f", share min {min(r['fraction'] or 0.0 for r in learnt):.3f}." if learnt else "."), "",
              "An earlier version planted the sentence mid-window (1,000 windows, 20 epochs at learning rate 0.002): ranks 1 and 2",
              "and shares 0.944 and 0.913, but neither model learnt the fact from the bare prompt (completion losses 20.1 and 18.3",
              "nats): small byte-level models learn it tied to the text before it, hence the sentence now opens its window.", ""]
    lines += ["Configuration (each run; `dataset`: the .npz written by the script; `training.seed`: the seed):", "", "```"]
    lines += [f"{name}: model {setup['model']}, training {setup['training']}" for name, setup in MODELS.items()]
    lines += [f"{section}: {values}" for section, values in SECTIONS.items()] + ["```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        for name, setup in MODELS.items():
            results.append(run(name, setup, seed))
            print(results[-1], flush=True)
            (RESULTS / "planted_fact.md").write_text(markdown(results, ".venv/bin/python benchmarks/planted_fact.py --seeds " + " ".join(map(str, args.seeds))))


if __name__ == "__main__":
    main()
