"""Long sequences stay bounded: EK-FAC on a causal GPT at two sequence lengths and two batch sizes, peak RSS per stage.

    .venv/bin/python benchmarks/long_sequences.py          (part of `make bench`; writes benchmarks/results/long_sequences.md)

Each case runs in its own process (so one case's peak never hides another's): the pipeline's built-in causal
`TokenTransformer` (2 blocks, d_model 128, vocabulary 256, random weights: memory does not depend on training),
EK-FAC with the sampled Fisher over its nn.Linear layers fitted on 128 random token windows of length T (λ = 1e-3),
then the scores of 8 queries against n random windows, `batch` windows at a time. Peak RSS is sampled over the
process (benchmarks/memory.py) during each stage. If scoring held every example's per-position activations at
once its memory would grow like n × T × width; bounded by the batch, it grows with batch × T × width only,
whatever n.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [(128, 512, 16), (512, 512, 16), (512, 1024, 16), (512, 512, 4)]  # (positions T, scored windows n, batch)
D_MODEL, VOCAB, QUERIES, FIT_WINDOWS = 128, 256, 8, 128
MB = 2**20


def one_case(length: int, n: int, batch: int) -> dict:
    """Fit and score one case in this process; seconds and peak RSS (MB) of each stage."""
    import torch

    from benchmarks.memory import PeakRSS
    from influence_core import EkfacInfluence
    from influence_core.pipeline.model.transformer import TokenTransformer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = TokenTransformer(VOCAB, length, D_MODEL, 4, 2, VOCAB, True).eval()
    fit = torch.randint(VOCAB, (FIT_WINDOWS, length))
    x = torch.randint(VOCAB, (n, length))
    xq = torch.randint(VOCAB, (QUERIES, length))
    im = EkfacInfluence(model, "language_modelling", 1e-3, fisher="sampled", batch_size=batch)
    result: dict = {"length": length, "n_train": n, "batch": batch, "tokens": n * length}
    for stage, work in (("fit", lambda: im.fit((fit, fit))), ("scoring", lambda: im.influences(xq, xq, x, x))):
        start = time.perf_counter()
        with PeakRSS(interval=0.05) as peak:
            work()
        result[stage] = {"seconds": time.perf_counter() - start, "peak_rss_mb": peak.peak / MB}
    result["all_activations_mb"] = n * length * 4 * D_MODEL * 4 / MB  # one FFN layer's inputs for every window, float32
    return result


def table(results: list[dict]) -> str:
    lines = ["| T | n scored | batch | tokens scored | fit s (128 windows) | fit peak RSS MB | scoring s | scoring peak RSS MB | n×T×4d float32 MB (one layer, all windows) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['length']} | {r['n_train']} | {r['batch']} | {r['tokens']:,} | {r['fit']['seconds']:.1f} | {r['fit']['peak_rss_mb']:.0f} | "
                     f"{r['scoring']['seconds']:.1f} | {r['scoring']['peak_rss_mb']:.0f} | {r['all_activations_mb']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", type=int, nargs=3, metavar=("T", "N", "BATCH"), help="run one case in this process and print its JSON")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "long_sequences.md")
    a = p.parse_args()
    if a.case:
        print(json.dumps(one_case(*a.case)))
        return
    results = []
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--case", *map(str, case)], check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    text = (f"# Long sequences: scoring memory follows the batch, not the data\n\n{__doc__.split(chr(10) + chr(10), 1)[1].strip()}\n\n"
            f"Command: `.venv/bin/python benchmarks/long_sequences.py` (2-core CPU, torch {__import__('torch').__version__}).\n\n{table(results)}\n")
    a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
