"""The LDS benchmark's problems and their retrained subset models (benchmarks/lds.py).

Problems: scikit-learn digits (pixels / 16), shuffled with seed 0: the first 1,000 rows train, the next 100 are
the queries. Logistic regression, an MLP 64-32-10 and a CNN (two 3×3 convolutions of 4 channels, then a linear
layer), tanh, float64. Recipe: initialised from torch seed 0 (ensemble member m: seed m), 300 full-batch Adam steps
(lr 1e-2), then L-BFGS (strong Wolfe, ≤ 1,000 iterations; the CNN ≤ 300, its float64 convolutions being slow) on mean cross-entropy +
(wd/2)‖θ‖², wd = 1e-3. A subset model is trained by the same recipe from the same initialisation on its subset.
Subsets: 64 random halves (seeded), one Dask task each on a LocalCluster; each writes its query losses to
`{scratch}/{problem}-{hash}/subset-{k}.npy`, so a rerun (or a resumed one) retrains nothing it already has.
Workload directories (data.npz, model.pt, workload.json) are those of `benchmarks/peers/common.py`, so every side
scores the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
sys.path.insert(0, str(ROOT))

from common import build_model  # noqa: E402
from tests.problems import minimise, objective  # noqa: E402

SCRATCH = ROOT / "benchmarks" / ".scratch" / "lds"
N_TRAIN, N_QUERIES, WEIGHT_DECAY = 1000, 100, 1e-3
SUBSETS, FRACTION, SUBSET_SEED = 64, 0.5, 0
RECIPE = {"adam_steps": 300, "adam_lr": 1e-2, "lbfgs_steps": 1000, "weight_decay": WEIGHT_DECAY}
BASE = {"features": 64, "activation": "tanh", "classes": 10, "hidden": []}
PROBLEMS: dict[str, dict[str, Any]] = {
    "logistic regression": {**BASE, "name": "logistic"},
    "MLP 64-32-10": {**BASE, "name": "mlp", "hidden": [32]},
    "CNN 2×conv4 + linear": {**BASE, "name": "cnn", "conv": [4, 4], "image": [1, 8, 8], "lbfgs_steps": 300},
}


def digits() -> dict[str, np.ndarray]:
    """The split: 1,000 training rows and 100 queries of digits, shuffled with seed 0, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order] / 16.0, y[order].astype(np.int64)
    train, query = slice(0, N_TRAIN), slice(N_TRAIN, N_TRAIN + N_QUERIES)
    return {"x_train": x[train], "y_train": y[train], "x_test": x[query], "y_test": y[query]}


def train(spec: dict[str, Any], x: torch.Tensor, y: torch.Tensor, member: int = 0) -> torch.nn.Module:
    """The recipe above, in float64, from the initialisation of seed `member`."""
    torch.manual_seed(member)
    model = build_model(spec).double()
    opt = torch.optim.Adam(model.parameters(), lr=RECIPE["adam_lr"])
    for _ in range(RECIPE["adam_steps"]):
        opt.zero_grad()
        objective(model, "cross_entropy", x, y, RECIPE["weight_decay"]).backward()
        opt.step()
    minimise(model, "cross_entropy", x, y, RECIPE["weight_decay"], steps=spec.get("lbfgs_steps", RECIPE["lbfgs_steps"]))
    return model.eval()


def query_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """Each query's cross-entropy: the measurement whose rank LDS predicts."""
    with torch.no_grad():
        return F.cross_entropy(model(x), y, reduction="none").numpy()


def subset_masks() -> np.ndarray:
    """(SUBSETS, N_TRAIN) booleans: each row a seeded random subset of FRACTION of the training rows."""
    rng = np.random.default_rng(SUBSET_SEED)
    masks = np.zeros((SUBSETS, N_TRAIN), dtype=bool)
    for row in masks:
        row[rng.choice(N_TRAIN, int(FRACTION * N_TRAIN), replace=False)] = True
    return masks


def problem_dir(spec: dict[str, Any], member: int = 0) -> Path:
    """The workload directory of a problem (and ensemble member): named by a hash of everything that shapes it."""
    key = json.dumps({"spec": spec, "recipe": RECIPE, "n": [N_TRAIN, N_QUERIES], "member": member, "subsets": [FRACTION, SUBSET_SEED]}, sort_keys=True)
    return SCRATCH / f"{spec['name']}-m{member}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def prepare(spec: dict[str, Any], member: int = 0) -> Path:
    """Train the full-data model once and write its workload directory (workload.json last marks it complete)."""
    root = problem_dir(spec, member)
    if (root / "workload.json").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    arrays = digits()
    np.savez(root / "data.npz", **arrays)
    model = train(spec, torch.from_numpy(arrays["x_train"]), torch.from_numpy(arrays["y_train"]), member)
    torch.save(model.state_dict(), root / "model.pt")
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(arrays["x_test"])).argmax(1).numpy() == arrays["y_test"]).mean())
    info = {**spec, "n_train": N_TRAIN, "n_test": N_QUERIES, "member": member, "recipe": RECIPE, "query_accuracy": accuracy,
            "n_params": sum(p.numel() for p in model.parameters())}
    (root / "workload.json").write_text(json.dumps(info, indent=1))
    return root


def retrain_subset(spec: dict[str, Any], member: int, k: int) -> str:
    """One Dask task: train subset k's model and save its query losses (atomically), unless already saved."""
    out = problem_dir(spec, member) / f"subset-{k}.npy"
    if out.exists():
        return str(out)
    torch.set_num_threads(1)
    arrays, mask = digits(), subset_masks()[k]
    x, y = torch.from_numpy(arrays["x_train"][mask]), torch.from_numpy(arrays["y_train"][mask])
    losses = query_losses(train(spec, x, y, member), torch.from_numpy(arrays["x_test"]), torch.from_numpy(arrays["y_test"]))
    partial = out.with_suffix(".partial.npy")
    np.save(partial, losses)
    os.replace(partial, out)
    return str(out)


def retrain(client: Any, spec: dict[str, Any], member: int = 0) -> list[Any]:
    """Submit the subset models' retraining, one task per subset (a cached subset returns at once): the futures."""
    return client.map(retrain_subset, [spec] * SUBSETS, [member] * SUBSETS, range(SUBSETS), pure=False)


def measured_losses(client: Any, futures: list[Any]) -> np.ndarray:
    """(SUBSETS, N_QUERIES) query losses of the subset models, once their tasks are done."""
    return np.stack([np.load(path) for path in client.gather(futures)])
