"""What every side's runner shares: the workload on disk, the model, stage timers, peak RSS and the JSON line.

Runners execute in different virtualenvs (this project's, pyDVL's, Kronfluence's), so this module needs nothing
but the standard library, numpy and torch. A workload directory holds `data.npz` (x_train, y_train, x_test,
y_test), `model.pt` (a state_dict of `build_model(spec)`, read with weights_only=True) and `workload.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


def is_language_model(spec: dict[str, Any]) -> bool:
    """W4: a byte-level GPT on token windows, trained and attributed on the summed next-token cross-entropy."""
    return spec.get("model") == "gpt"


def _token_transformer() -> type[nn.Module]:
    """The pipeline's built-in `transformer` class, loaded from its file (it needs only torch), so the peers' venvs
    build the very module whose state_dict the pipeline loads as `model.checkpoint`."""
    path = Path(__file__).resolve().parents[2] / "influence_core" / "pipeline" / "model" / "transformer.py"
    loader = importlib.util.spec_from_file_location("benchmark_transformer", path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module.TokenTransformer


def build_model(spec: dict[str, Any]) -> nn.Module:
    """Sequential(Flatten, Linear, act, ..., Linear): the layout of the pipeline's `ModelSpec.build`, so one
    state_dict serves the library, the peers and the pipeline (`model.checkpoint`). With `conv` (channels per 3×3
    layer) and `image` ([C, H, W]) the flat input is first unflattened and convolved: a small CNN (benchmarks/lds.py).
    A language model (W4) is the pipeline's causal `TokenTransformer` over windows of `features` bytes."""
    if is_language_model(spec):
        return _token_transformer()(spec["vocab"], spec["features"], spec["d_model"], spec["heads"], spec["blocks"], spec["vocab"], True)
    layers: list[nn.Module] = [nn.Flatten()]
    width = spec["features"]
    if spec.get("conv"):
        channels, height, side = spec["image"]
        layers.append(nn.Unflatten(1, (channels, height, side)))
        for out in spec["conv"]:
            layers += [nn.Conv2d(channels, out, 3), ACTIVATIONS[spec["activation"]]()]
            channels, height, side = out, height - 2, side - 2
        layers.append(nn.Flatten())
        width = channels * height * side
    for h in spec["hidden"]:
        layers += [nn.Linear(width, h), ACTIVATIONS[spec["activation"]]()]
        width = h
    layers.append(nn.Linear(width, spec["classes"]))
    return nn.Sequential(*layers)


def example_losses(spec: dict[str, Any], logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each example's own training loss (B,): cross-entropy of its class, or (W4) the sum of its next-token
    cross-entropies, the logits at position t predicting token t + 1 of the window (labels = the window itself)."""
    if is_language_model(spec):
        return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), y[:, 1:], reduction="none").sum(1)
    return torch.nn.functional.cross_entropy(logits, y, reduction="none")


def sampled_labels(spec: dict[str, Any], logits: torch.Tensor) -> torch.Tensor:
    """Labels drawn from the model's own predictions (the true Fisher's targets), shaped like the training labels:
    one class per example, or (W4) one next token per position (the first position is no target and keeps 0)."""
    probs = torch.softmax(logits.detach().reshape(-1, logits.shape[-1]), dim=-1)
    drawn = torch.multinomial(probs, 1).reshape(logits.shape[:-1])
    return torch.nn.functional.pad(drawn[:, :-1], (1, 0)) if is_language_model(spec) else drawn


@dataclass(frozen=True)
class Workload:
    """A prepared workload: its spec, the arrays as tensors (features in the model's dtype, token ids and labels
    int64) and the trained model (eval mode)."""

    spec: dict[str, Any]
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    model: nn.Module

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def load_workload(directory: str | Path, dtype: torch.dtype = torch.float32) -> Workload:
    """Read a workload directory written by `workloads.prepare`."""
    root = Path(directory)
    spec = json.loads((root / "workload.json").read_text())
    with np.load(root / "data.npz") as data:
        arrays = {k: torch.from_numpy(np.ascontiguousarray(data[k])) for k in ("x_train", "y_train", "x_test", "y_test")}
    model = build_model(spec)
    model.load_state_dict(torch.load(root / "model.pt", map_location="cpu", weights_only=True))
    model = model.to(dtype).eval()
    xs = {k: v.long() if is_language_model(spec) else v.to(dtype) for k, v in arrays.items() if k.startswith("x")}
    return Workload(spec, xs["x_train"], arrays["y_train"].long(), xs["x_test"], arrays["y_test"].long(), model)


@dataclass
class Stages:
    """Wall seconds per named stage (perf_counter around each block), and the process's peak RSS when each ended
    (ru_maxrss only grows, so a stage's value is the peak up to its end)."""

    seconds: dict[str, float] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        self.peak_rss[name] = peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set of this process and of its waited-for children (Linux reports ru_maxrss in KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + children) * 1024


def runner_args(description: str) -> argparse.ArgumentParser:
    """The arguments every runner takes: workload, method, options (JSON), where the scores go, threads."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--workload", required=True, help="workload directory (data.npz, model.pt, workload.json)")
    p.add_argument("--method", required=True, help="the side's method name")
    p.add_argument("--options", default="{}", help="method options as JSON")
    p.add_argument("--scores", required=True, help="where to save the (n_test, n_train) scores (.npy)")
    p.add_argument("--regularization", type=float, required=True, help="λ, absolute, the same on every side")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0, help="torch seed (sampled labels, random sketches)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="dtype of the model and inputs")
    return p


def run_side(description: str, body: Callable[[argparse.Namespace, Workload, Stages], tuple[torch.Tensor, dict[str, Any]]]) -> None:
    """Parse the arguments, load the workload, run `body` (which returns scores and extra info), save the scores
    and print exactly one JSON line on stdout; everything the libraries print goes to stderr."""
    args = runner_args(description).parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    real_stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        workload = load_workload(args.workload, getattr(torch, args.dtype))
        stages = Stages()
        scores, info = body(args, workload, stages)
    scores = scores.detach().to(torch.float32).cpu().numpy()
    expected = (len(workload.y_test), len(workload.y_train))
    if scores.shape != expected:
        raise SystemExit(f"scores have shape {scores.shape}, expected {expected}")
    np.save(args.scores, scores)
    result = {
        "method": args.method,
        "options": json.loads(args.options),
        "stages": stages.seconds,
        "stage_peak_rss_bytes": stages.peak_rss,
        "peak_rss_bytes": peak_rss_bytes(),
        "n_params": workload.n_params,
        "threads": torch.get_num_threads(),
        "finite": bool(np.isfinite(scores).all()),
        "torch": torch.__version__,
        **info,
    }
    real_stdout.write(json.dumps(result) + "\n")
    real_stdout.flush()
