"""The machine's float32 GEMM rate: torch.mm on square matrices, best of several repetitions, per thread count.

    python benchmarks/peers/gemm.py --threads 1 2 --sizes 2048 4096 --repeats 5

Prints one JSON line: {"rates": {"1": {"2048": GFLOP/s, ...}, "2": {...}}, "best": {"1": GFLOP/s, "2": GFLOP/s}}.
One n×n by n×n product counts 2·n³ flops. This is the ceiling the stages' rates are compared against.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def gemm_rate(n: int, threads: int, repeats: int) -> float:
    """Best GFLOP/s of `repeats` timed torch.mm calls on n×n float32 matrices (one untimed warm-up)."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    rates = {str(t): {str(n): round(gemm_rate(n, t, a.repeats), 2) for n in a.sizes} for t in a.threads}
    print(json.dumps({"rates": rates, "best": {t: max(r.values()) for t, r in rates.items()}, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
