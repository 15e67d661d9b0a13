"""Per-sample gradients: torch.func vmap over grad vs a per-example backward loop, side by side in one run.

    .venv/bin/python benchmarks/per_sample_grads.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from influence_core import Objective


def loop_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    rows = []
    for i in range(len(x)):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return torch.stack(rows)


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    print(f"{'hidden':>8} {'p':>9} {'n':>5} {'loop s':>9} {'vmap s':>9} {'speedup':>8}")
    for hidden in (32, 256, 1024):
        model = nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))
        x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
        objective = Objective(model, "cross_entropy")
        assert torch.allclose(objective.per_sample_grads(x, y), loop_grads(model, x, y), atol=1e-6)
        t_loop = best_of(lambda: loop_grads(model, x, y))
        t_vmap = best_of(lambda: objective.per_sample_grads(x, y))
        p = sum(q.numel() for q in model.parameters())
        print(f"{hidden:>8} {p:>9} {len(x):>5} {t_loop:>9.4f} {t_vmap:>9.4f} {t_loop / t_vmap:>7.1f}x")


if __name__ == "__main__":
    main()
