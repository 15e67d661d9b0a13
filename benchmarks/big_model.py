"""EK-FAC with LoGra projection on a 10.5M-parameter MLP: 20,000 training x 500 query examples on this CPU.

    .venv/bin/python benchmarks/big_model.py        (writes benchmarks/results/big_model.md)

1. Agreement, on a model small enough for an exact answer (a narrower MLP of 37k parameters, 2,000 training
   examples), against exact Gauss-Newton influence by CG: EK-FAC (sampled labels or exact Fisher), EK-FAC on
   LoGra-projected layers, TRAK (projected Direct), and the gradient dot product as the floor.
2. Scale: the full pipeline (Prefect ephemeral API, local Dask cluster of 2 single-threaded workers, Zarr on local
   disk): synthetic 1,024-feature data, MLP 1024-2048-2048-2048-10 trained for one epoch in the pipeline, EK-FAC
   in full per-layer space (labels sampled from the model), gradients whitened in its eigenbasis and projected
   with LoGra (32x32 = 1,024 coordinates per layer), scores for all 20,000 x 500 pairs.
   Wall time per stage and peak resident memory of the whole process tree (driver and workers).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import pearsonr, spearmanr
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.memory import PeakRSS  # noqa: E402
from influence_core import CgInfluence, DirectInfluence, EkfacInfluence, IdentityInfluence, Projection  # noqa: E402

RESULTS = Path(__file__).parent / "results"
HIDDEN, FEATURES, N_TRAIN, N_TEST, DIM = [2048, 2048, 2048], 1024, 20_000, 500, 1024


def synthetic(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d, 10, generator=torch.Generator().manual_seed(99)) / d**0.5
    x = torch.randn(n, d, generator=gen)
    return x, torch.argmax(3 * x @ teacher + 0.1 * torch.randn(n, 10, generator=gen), dim=1)


def agreement() -> list[str]:
    """The small exact comparison, at two damping levels relative to the curvature's mean eigenvalue."""
    torch.manual_seed(0)
    x, y = synthetic(2000, 512, 0)
    xt, yt = synthetic(20, 512, 1)
    model = nn.Sequential(nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-2)
    for _ in range(10):
        for i in range(0, 2000, 100):
            opt.zero_grad()
            F.cross_entropy(model(x[i : i + 100]), y[i : i + 100]).backward()
            opt.step()
    p = sum(q.numel() for q in model.parameters())
    # trace(C)/p: EK-FAC's eigenvalues are the exact diagonal of each layer's Gauss-Newton block in its eigenbasis
    probe = EkfacInfluence(model, "cross_entropy", 1.0, fisher="exact").fit((x, y))
    mean_eigenvalue = float(sum(s.eigenvalues.sum() for s in probe.solvers.values()) / p)
    accuracy = float((model(xt).argmax(1) == yt).float().mean())
    rows = [
        f"Small model: MLP 512-64-64-10 (ReLU), p = {p:,}, 2,000 training examples (test accuracy {accuracy:.2f}), 20 queries, float32. "
        f"Reference: exact Gauss-Newton influence by CG (rtol 1e-6). trace(C)/p = {mean_eigenvalue:.2e}.",
        "",
        "| λ | method | Pearson vs exact | Spearman vs exact | fit s | score s |",
        "|---|---|---|---|---|---|",
    ]
    for factor in (0.1, 1.0):
        lam = factor * mean_eigenvalue
        results, timings = {}, {}
        for name, im in {
            "exact (CG)": CgInfluence(model, "cross_entropy", lam, second_order_mode="gauss_newton", rtol=1e-6, batch_size=2000),
            "CG, layer-wise blocks (EK-FAC's best case)": CgInfluence(model, "cross_entropy", lam, second_order_mode="gauss_newton", rtol=1e-6, batch_size=2000, block_structure="layer_wise"),
            "EK-FAC, sampled labels": EkfacInfluence(model, "cross_entropy", lam),
            "EK-FAC, exact Fisher": EkfacInfluence(model, "cross_entropy", lam, fisher="exact"),
            f"EK-FAC + LoGra ({DIM} per layer), sampled labels": EkfacInfluence(model, "cross_entropy", lam, projection=Projection("logra", DIM)),
            "EK-FAC + LoGra (4096 per layer), sampled labels": EkfacInfluence(model, "cross_entropy", lam, projection=Projection("logra", 4096)),
            f"EK-FAC + Gaussian ({DIM} per layer), sampled labels": EkfacInfluence(model, "cross_entropy", lam, projection=Projection("gaussian", DIM)),
            f"TRAK: Direct + Gaussian ({DIM} per layer)": DirectInfluence(model, "cross_entropy", lam, projection=Projection("gaussian", DIM)),
            "gradient dot product (identity)": IdentityInfluence(model, "cross_entropy"),
        }.items():
            start = time.perf_counter()
            im.fit((x, y))
            fitted = time.perf_counter()
            results[name] = im.influences(xt, yt, x, y).ravel().numpy()
            timings[name] = (fitted - start, time.perf_counter() - fitted)
        reference = results["exact (CG)"]
        for name, values in results.items():
            rows.append(f"| {factor:g}·trace/p | {name} | {pearsonr(values, reference)[0]:.3f} | {spearmanr(values, reference)[0]:.3f} | {timings[name][0]:.1f} | {timings[name][1]:.1f} |")
    return rows


def scale(out: str) -> list[str]:
    from flows.influence_run import influence_run
    from flows.parameters import RunParameters

    params = RunParameters.model_validate(
        {
            "output_url": out,
            "dataset": {"source": "synthetic_classification", "n_train": N_TRAIN, "n_test": N_TEST, "n_features": FEATURES, "n_classes": 10, "chunk_rows": 2048},
            "model": {"hidden": HIDDEN, "activation": "relu"},
            "training": {"epochs": 1, "batch_size": 128, "learning_rate": 1e-3},
            "method": {"name": "ekfac", "regularization": 1e-2, "batch_size": 256, "projection": {"kind": "logra", "dim": DIM}},
            "compute": {"cluster": "local", "n_workers": 2, "train_chunk_rows": 2500},
            "aggregate": {"top_k": 10},
        }
    )
    with PeakRSS() as memory:
        start = time.perf_counter()
        summary = influence_run(**params.sections())
        wall = time.perf_counter() - start
    p = sum(w * h + h for w, h in zip([FEATURES, *HIDDEN], [*HIDDEN, 10]))
    rows = [
        f"Pipeline run: MLP {FEATURES}-{'-'.join(map(str, HIDDEN))}-10, p = {p:,} parameters; n_train = {N_TRAIN:,}, n_test = {N_TEST}; "
        f"EK-FAC, whitened gradients projected with LoGra ({DIM} coordinates per layer); local Dask cluster, 2 single-threaded workers.",
        "",
        f"- wall time (flow, all stages): **{wall:.0f} s**",
        f"- peak resident memory of driver + workers: **{memory.peak / 2**30:.2f} GB** (target < 8 GB)",
        f"- per-sample gradients evaluated in scoring: {summary['stages']['compute_influences'].get('gradient_rows')} (= n_train)",
        "",
        "| stage | seconds |",
        "|---|---|",
    ]
    rows += [f"| {name} | {stage['seconds']:.1f} |" for name, stage in summary["stages"].items()]
    return rows


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    torch.set_num_threads(2)
    small = agreement()
    print("\n".join(small), flush=True)
    out = tempfile.mkdtemp(prefix="big-model-")
    try:
        big = scale(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print("\n".join(big))
    doc = (__doc__ or "").split("\n\n", 2)[2]
    (RESULTS / "big_model.md").write_text("# Influence for a 10M-parameter model on a 2-core CPU\n\n" + doc + "\n\n## Agreement with an exact run\n\n" + "\n".join(small) + "\n\n## Scale\n\n" + "\n".join(big) + "\n")


if __name__ == "__main__":
    main()
