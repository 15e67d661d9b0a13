"""bergson 2.5.1's side of benchmarks/bergson_side_by_side.py, run in its venv (setup_bergson.sh).

    benchmarks/.venvs/bergson/bin/python benchmarks/peers/bergson_runner.py --model HF_DIR --train DS --queries DS \
        --out DIR [--projection-dim 16] [--top-k 10]

Three timed steps, each bergson's own entry point, in this one process (its CLI runs in-process on a CPU-only machine:
one rank, no spawned workers), so the ~6 s import is paid once and reported apart:
- `build`: `bergson build` of the training rows' gradient index (`gradients.bin`, one row per example);
- `query`: the index loaded into a `bergson.Attributor` (index once, query many), then each query's gradient traced
  with `Attributor.trace` and its top-k read off the index. The query's loss is ours: the sum of the next-token
  cross-entropies of its completion only (the labels are -100 on the prompt), which `bergson query` cannot ask (its
  interactive prompt scores the whole text);
- `score`: `bergson build` of the queries' index (their `labels` mask the prompt), then `bergson score`, which
  recomputes the training rows' gradients against it and writes every (training row, query) score.
Preconditioning: none (no `--hessian_path`, `--unit_normalize` off, `Attributor(unit_norm=False)`): scores are plain
dot products of per-example loss gradients (`--loss_reduction sum`, bergson's default), positive = helpful, over the
weights and biases (`--include_bias`) of GPT-2's eight Conv1D layers (bergson tracks Linear and Conv1D layers of the
base model; the tied lm_head is outside it). `--projection_dim` is per module and two-sided (dim² numbers per module).
Prints one JSON line (seconds per step, index bytes per row, the commands); saves scores.npy (n_queries, n_train) and
topk.npy (n_queries, k) under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

START = time.perf_counter()

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bergson  # noqa: E402
from bergson import Attributor  # noqa: E402
from bergson.__main__ import main as bergson_main  # noqa: E402
from bergson.data import load_gradients, load_scores  # noqa: E402
from datasets import load_from_disk  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

IMPORT_SECONDS = time.perf_counter() - START


@contextlib.contextmanager
def timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall seconds to seconds[name]."""
    start = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start


def bergson_cli(args: list[str]) -> None:
    """Run `bergson ARGS` in this process, exactly as its console script parses them."""
    argv = sys.argv
    sys.argv = ["bergson", *args]
    try:
        bergson_main()
    finally:
        sys.argv = argv


def common_options(model: str, projection_dim: int) -> list[str]:
    """The gradient options every build and score shares (the same model, modules, projection and token budget; the
    model loads in fp32, bergson's default `--precision`, a flag `score` cannot take as it has its own)."""
    return ["--model", model, "--token_batch_size", "1024", "--include_bias", "--projection_dim", str(projection_dim)]


def completion_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ_t CE(logits_t, labels_{t+1}) over the labelled (completion) tokens: the pipeline's query measurement."""
    logits = model(ids[None]).logits[0, :-1]
    return torch.nn.functional.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum")


def query_topk(index: Path, model_dir: str, queries: Any, k: int) -> tuple[np.ndarray, float]:
    """Each query's k most helpful training rows by Attributor.trace over the built index; the index load's seconds."""
    start = time.perf_counter()
    attributor = Attributor(index, device="cpu", unit_norm=False)
    load = time.perf_counter() - start
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for ids, labels in zip(queries["input_ids"], queries["labels"]):
        with attributor.trace(model.base_model, k) as result:
            completion_loss(model, torch.tensor(ids), torch.tensor(labels)).backward()
        model.zero_grad()
        rows.append(result.indices.reshape(-1).numpy())
    return np.stack(rows), load


def bytes_per_row(index: Path) -> int:
    """The index file's bytes over its rows (gradients.bin holds nothing else)."""
    return (index / "gradients.bin").stat().st_size // len(load_gradients(index))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory (with its tokenizer)")
    parser.add_argument("--train", required=True, help="save_to_disk dataset of the training rows (text, input_ids)")
    parser.add_argument("--queries", required=True, help="save_to_disk dataset of the queries (text, input_ids, labels)")
    parser.add_argument("--out", required=True, type=Path, help="a folder for the indexes and scores (emptied first)")
    parser.add_argument("--projection-dim", type=int, default=0, help="bergson's --projection_dim (0: no projection)")
    parser.add_argument("--top-k", type=int, default=10)
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    options = common_options(args.model, args.projection_dim)
    commands = {
        "build": ["build", str(args.out / "index"), "--dataset", args.train, *options],
        "query_index": ["build", str(args.out / "query_index"), "--dataset", args.queries, *options],
        "score": ["score", str(args.out / "scores"), "--query_path", str(args.out / "query_index"), "--dataset", args.train, *options],
    }
    seconds: dict[str, float] = {"import": IMPORT_SECONDS}
    real_stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        with timed(seconds, "build"):
            bergson_cli(commands["build"])
        with timed(seconds, "query"):
            topk, seconds["query_index_load"] = query_topk(args.out / "index", args.model, load_from_disk(args.queries), args.top_k)
        with timed(seconds, "score"):
            bergson_cli(commands["query_index"])
            bergson_cli(commands["score"])
    scores = load_scores(args.out / "scores")[:].T.astype(np.float32)  # stored (n_train, n_queries)
    np.save(args.out / "scores.npy", scores)
    np.save(args.out / "topk.npy", topk)
    index = load_gradients(args.out / "index")
    result = {
        "library": f"bergson {bergson.__version__}", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "projection_dim": args.projection_dim, "seconds": seconds, "bytes_per_row": bytes_per_row(args.out / "index"),
        "index_shape": list(index.shape), "index_dtype": str(index.dtype), "scores_shape": list(scores.shape),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "commands": {name: "bergson " + " ".join(c) for name, c in commands.items()},
    }
    real_stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
