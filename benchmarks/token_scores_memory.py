"""Peak RSS of per-token storage (issue 37 item 5): the aggregate step of `aggregate.token_scores` on the text demo's
model shape (byte-level causal transformer, d_model 128, 2 blocks, EK-FAC), at T = 128 and T = 512, each in its own
process: the sequence scores alone, then the same plus each query's top-k rows per token, their union captured once as
`influence_core/pipeline/score/token_scores.py` does. Usage: python -m benchmarks.token_scores_memory [--n-train 256]"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np
import torch

from influence_core import EkfacInfluence
from influence_core.methods.scorer import Scorer
from influence_core.pipeline.model.transformer import TokenTransformer
from influence_core.task import LanguageModelling


def measure(positions: int, n_train: int, n_test: int, k: int, tokens: bool) -> dict[str, float]:
    """One process's peak RSS (MiB) and seconds for sequence scores, then (`tokens`) the top-k per-token scores."""
    torch.manual_seed(0)
    model = TokenTransformer(256, positions, 128, 4, 2, 256, causal=True)
    x, q = torch.randint(0, 256, (n_train, positions)), torch.randint(0, 256, (n_test, positions))
    im = EkfacInfluence(model, LanguageModelling(), 1e-3, fisher="sampled", batch_size=32).fit((x, x))
    factors = im.influence_factors(q, q)
    scores = im.influences_from_factors(factors, x, x)
    started = time.perf_counter()
    if tokens:
        helpful, harmful = scores.topk(k, dim=1).indices.numpy(), scores.topk(k, dim=1, largest=False).indices.numpy()
        union, where = np.unique(np.concatenate([helpful, harmful], axis=1), return_inverse=True)
        queries = torch.arange(n_test).repeat_interleave(2 * k)
        Scorer(im, factors, None, per_token=True).entries(x[union], x[union], queries, torch.from_numpy(where.reshape(-1))).detach().numpy().reshape(n_test, 2, k, positions)
    return {"T": positions, "token_scores": tokens, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "token_seconds": round(time.perf_counter() - started, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-train", type=int, default=256)
    parser.add_argument("--n-test", type=int, default=32)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # T, tokens: a child process's single case
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.n_train, args.n_test, args.k, args.one[1] == "1")))
        return
    torch.set_num_threads(1)
    for positions in (128, 512):
        for tokens in (0, 1):
            child = [sys.executable, "-m", "benchmarks.token_scores_memory", "--n-train", str(args.n_train), "--n-test", str(args.n_test), "--k", str(args.k), "--one", str(positions), str(tokens)]
            print(subprocess.run(child, check=True, capture_output=True, text=True).stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
