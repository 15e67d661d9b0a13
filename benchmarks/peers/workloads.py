"""The benchmark's workloads: seeded data and a trained MLP, prepared once and read by every side.

A workload is a small spec (`WORKLOADS`, or its `--quick` variant); `prepare` writes `data.npz`, `model.pt` (a
state_dict of `common.build_model`) and `workload.json` under `{scratch}/{name}-{hash of the data and model
fields}`, and reuses that directory when it is already complete, so reruns score exactly the same model and
data. λ (`regularization`) is not part of the directory: runners take it on the command line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from common import build_model, example_losses, is_language_model

# λ is absolute and the same on every side (pyDVL `regularization`, Kronfluence `damping_factor`, ours
# `regularization`). Training uses Adam with weight decay; the curvature is that of the mean cross-entropy alone.
WORKLOADS: dict[str, dict[str, Any]] = {
    "W1": {"source": "digits", "features": 64, "hidden": [32], "activation": "tanh", "classes": 10, "test_fraction": 0.2,
           "regularization": 5e-2, "epochs": 60, "batch": 64, "lr": 1e-2, "weight_decay": 1e-3, "seed": 0},
    "W2": {"source": "synthetic", "features": 100, "hidden": [256, 256], "activation": "tanh", "classes": 10, "n_train": 4000, "n_test": 500,
           "regularization": 1e-1, "epochs": 20, "batch": 128, "lr": 1e-3, "weight_decay": 1e-3, "seed": 0},
    "W3": {"source": "synthetic", "features": 100, "hidden": [1024, 1024], "activation": "relu", "classes": 10, "n_train": 5000, "n_test": 100,
           "regularization": 1e-3, "epochs": 10, "batch": 128, "lr": 1e-3, "weight_decay": 1e-3, "seed": 0},
    # `make demo-text`'s GPT: 2 pre-norm blocks, d_model 128, on 64-byte windows of the standard library's docstrings
    "W4": {"source": "python_docs", "model": "gpt", "features": 64, "vocab": 256, "d_model": 128, "heads": 4, "blocks": 2, "n_train": 2000, "n_test": 20,
           "regularization": 1e-3, "epochs": 8, "batch": 32, "lr": 2e-3, "weight_decay": 0.0, "seed": 0},
}
# --quick: the same kinds of problem, small enough for a smoke run of a few minutes.
QUICK: dict[str, dict[str, Any]] = {
    "W1": {"hidden": [16], "n_train": 300, "n_test": 40, "epochs": 20},
    "W2": {"hidden": [64, 64], "n_train": 400, "n_test": 50, "epochs": 10, "regularization": 0.5},  # its Hessian has eigenvalues near -0.23
    "W3": {"hidden": [128, 128], "n_train": 300, "n_test": 20, "epochs": 5},
    "W4": {"d_model": 32, "heads": 2, "n_train": 200, "n_test": 5, "epochs": 2},
}


def workload_spec(name: str, quick: bool) -> dict[str, Any]:
    """The spec of a workload, with the quick overrides applied."""
    spec = {"name": name, **WORKLOADS[name], **(QUICK[name] if quick else {})}
    spec["quick"] = quick
    return spec


def _digits(spec: dict[str, Any]) -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(spec["seed"]).permutation(len(y))
    n_test = int(round(spec["test_fraction"] * len(y)))
    test, train = order[:n_test], order[n_test:]
    train = train[: spec.get("n_train", len(train))]
    test = test[: spec.get("n_test", len(test))]
    return {"x_train": x[train], "y_train": y[train].astype(np.int64), "x_test": x[test], "y_test": y[test].astype(np.int64)}


def _synthetic(spec: dict[str, Any]) -> dict[str, np.ndarray]:
    """Gaussian inputs labelled by a random linear teacher plus noise: learnable, not separable."""
    rng = np.random.default_rng(spec["seed"])
    d, c = spec["features"], spec["classes"]
    teacher = rng.standard_normal((d, c)) / np.sqrt(d)
    n = spec["n_train"] + spec["n_test"]
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = np.argmax(3.0 * x @ teacher + 0.5 * rng.standard_normal((n, c)), axis=1).astype(np.int64)
    cut = spec["n_train"]
    return {"x_train": x[:cut], "y_train": y[:cut], "x_test": x[cut:], "y_test": y[cut:]}


def _python_docs(spec: dict[str, Any]) -> dict[str, np.ndarray]:
    """Windows of `features` bytes of the docstrings (influence_core.pipeline.sources.python_docs, as `make demo-text`),
    shuffled with the seed: the first n_test are the queries, the next n_train the training set; labels = inputs."""
    from influence_core.pipeline.sources import python_docs

    rows = python_docs.windows(python_docs.corpus(), spec["features"])
    rows = rows[np.random.default_rng(spec["seed"]).permutation(len(rows))]
    test, train = rows[: spec["n_test"]], rows[spec["n_test"] : spec["n_test"] + spec["n_train"]]
    return {"x_train": train, "y_train": train, "x_test": test, "y_test": test}


def _mean_loss(spec: dict[str, Any], logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training objective: mean cross-entropy (as W1-W3 always trained), or the mean of W4's summed token losses."""
    return example_losses(spec, logits, y).mean() if is_language_model(spec) else F.cross_entropy(logits, y)


def _accuracy(spec: dict[str, Any], logits: torch.Tensor, y: torch.Tensor) -> float:
    """Share of correct classes, or (W4) of correctly predicted next tokens."""
    if is_language_model(spec):
        return float((logits[:, :-1].argmax(-1) == y[:, 1:]).float().mean())
    return float((logits.argmax(1) == y).float().mean())


def _train(spec: dict[str, Any], arrays: dict[str, np.ndarray]) -> tuple[torch.nn.Module, dict[str, float]]:
    torch.manual_seed(spec["seed"])
    model = build_model(spec)
    x, y = torch.from_numpy(arrays["x_train"]), torch.from_numpy(arrays["y_train"])
    opt = torch.optim.Adam(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
    gen = torch.Generator().manual_seed(spec["seed"])
    for _ in range(spec["epochs"]):
        order = torch.randperm(len(y), generator=gen)
        for lo in range(0, len(y), spec["batch"]):
            idx = order[lo : lo + spec["batch"]]
            opt.zero_grad()
            _mean_loss(spec, model(x[idx]), y[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        xt, yt = torch.from_numpy(arrays["x_test"]), torch.from_numpy(arrays["y_test"])
        logits = model(x)
        stats = {
            "train_loss": float(_mean_loss(spec, logits, y)),
            "train_accuracy": _accuracy(spec, logits, y),
            "test_accuracy": _accuracy(spec, model(xt), yt),
        }
    return model, stats


def prepare(spec: dict[str, Any], scratch: Path) -> Path:
    """Write (or find) the workload directory for `spec`; deterministic given the spec."""
    data_and_model = {k: v for k, v in spec.items() if k != "regularization"}
    key = hashlib.sha256(json.dumps(data_and_model, sort_keys=True).encode()).hexdigest()[:12]
    root = scratch / f"{spec['name']}{'-quick' if spec['quick'] else ''}-{key}"
    if (root / "workload.json").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        torch.set_num_threads(2)
        arrays = {"digits": _digits, "synthetic": _synthetic, "python_docs": _python_docs}[spec["source"]](spec)
        np.savez(root / "data.npz", **arrays)
        model, stats = _train(spec, arrays)
    torch.save(model.state_dict(), root / "model.pt")
    info = {
        **spec,
        "n_train": len(arrays["y_train"]),
        "n_test": len(arrays["y_test"]),
        "n_params": sum(p.numel() for p in model.parameters()),
        "layers": [[m.in_features, m.out_features] for m in model.modules() if isinstance(m, torch.nn.Linear)],
        **stats,
    }
    (root / "workload.json").write_text(json.dumps(info, indent=1))  # written last: marks the directory complete
    return root
