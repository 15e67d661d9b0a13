"""Seconds per example of a whitened index's two projection paths (issue 38), on one torch thread, by matrix shape,
positions T and whitening rank R: what `index_projection.FORMED_COST` weighs.

    .venv/bin/python benchmarks/projection_paths.py

- factored: Σ_{r,t} (Φ_out diag(u_r) g_t)(Φ_in diag(v_r) a_t)ᵀ from the captures (`factored_projection`);
- formed: G = Σ_t g_t a_tᵀ formed per example, whitened (∘ W), then Φ_out G Φ_inᵀ.

Prints each path's ms per example and multiply-add rate, which path `factored_is_cheaper` picks and which was faster;
then the seconds of `whitening_factors` on a 1024 × 4096 D like EK-FAC's (two decaying spectra, 30% noise: full rank)
at T = 64 (a language model's window), capped at `break_even_rank` and uncapped (2 torch threads).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from influence_core.index_projection import break_even_rank, factored_is_cheaper, factored_projection, orthogonal_rows, whitening_factors  # noqa: E402

CASES = [  # (out, in, T, R, examples)
    (1024, 101, 1, 101, 256), (1024, 1025, 1, 47, 256), (1024, 1025, 1, 400, 256), (1024, 1025, 1, 1024, 64),
    (128, 128, 64, 128, 64), (512, 128, 64, 128, 64), (128, 128, 64, 16, 64), (50, 41, 3, 41, 16),
]


def formed(a: torch.Tensor, g: torch.Tensor, phi: tuple[torch.Tensor, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    return (phi[0] @ (torch.einsum("bto,bti->boi", g, a) * w) @ phi[1].T).reshape(len(a), -1)


def seconds(fn: Callable[..., torch.Tensor], *args: object) -> float:
    """The faster of two timed calls after a warm-up."""
    fn(*args)
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for out, inp, positions, rank, n in CASES:
        a, g = torch.randn(n, positions, inp), torch.randn(n, positions, out)
        k_out, k_in = min(64, out), min(64, inp)
        phi = (orthogonal_rows(k_out, out, [0, 0, 0]).float(), orthogonal_rows(k_in, inp, [0, 0, 1]).float())
        factored_s = seconds(factored_projection, a, g, phi, (torch.randn(rank, out), torch.randn(rank, inp)))
        formed_s = seconds(formed, a, g, phi, torch.rand(out, inp) + 0.1)
        factored_madds = rank * positions * (k_out * out + k_in * inp + k_out * k_in)
        formed_madds = out * inp * (positions + 1 + k_out) + k_out * k_in * inp
        picked = "factored" if factored_is_cheaper(rank, (out, inp), (k_out, k_in), positions) else "formed"
        faster = "factored" if factored_s < formed_s else "formed"
        print(f"{out} x {inp}, T = {positions}, R = {rank}: factored {1e3 * factored_s / n:.3f} ms/example ({factored_madds * n / factored_s / 1e9:.1f} G madds/s), "
              f"formed {1e3 * formed_s / n:.3f} ({formed_madds * n / formed_s / 1e9:.1f}); picked {picked}, faster {faster}{'' if picked == faster else '  <- MISMATCH'}")


def whitening_seconds() -> None:
    """The capped rank search against the full SVD's, on one full-rank D."""
    torch.set_num_threads(2)
    out, inp = 1024, 4096
    noise = torch.rand(out, inp, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    damped = torch.outer(torch.logspace(-4, 0, out, dtype=torch.float64), torch.logspace(-4, 0, inp, dtype=torch.float64)) * (1 + 0.3 * noise) + 1e-3
    cap = break_even_rank((out, inp), (64, 64), 64)
    for label, max_rank in ((f"capped at {cap}", cap), ("uncapped", None)):
        start = time.perf_counter()
        left, _ = whitening_factors(damped, 1e-3, max_rank)
        print(f"whitening {out} x {inp}, T = 64, {label}: {time.perf_counter() - start:.2f} s, rank {len(left)}")


if __name__ == "__main__":
    main()
    whitening_seconds()
