"""MAGIC on a fine-tune, with a warm-up from 0 and without: for several batch orders (training seeds), the largest
|score| over the median |score| (what the pipeline's summary reports as `spread`) and the scores' LDS against
retrainings with the removed rows weighted 0 (the counterfactual MAGIC linearises). A library-level sweep, minutes
on a CPU; it reports, it asserts nothing.

    .venv/bin/python benchmarks/finetune_magic.py [--seeds 6] [--subsets 16]   (prints a markdown table)

Problems (float64): `mlp`, the digits MLP 64-32-10 pretrained 20 epochs on training rows 0-499, then fine-tuned 3
epochs (batch 32) on rows 500-699, its 20 queries the first held-out rows; `lora`, the built-in byte transformer
(d_model 32, 1 block) pretrained 4 epochs on 256 docstring windows of 32 bytes, then LoRA adapters (rank 4 on query,
value) fine-tuned 3 epochs (batch 16) on the next 96 windows, its 8 queries held-out windows. Each fine-tune runs at
learning rate 1e-2 (linear decay), warm-up 0 or 0.1 of the steps.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from influence_core.lds import linear_datamodeling_score  # noqa: E402
from influence_core.magic import metagradients  # noqa: E402
from influence_core.magic.replay import Replay  # noqa: E402
from influence_core.pipeline.model.models import with_lora  # noqa: E402
from influence_core.pipeline.sources.data import open_source  # noqa: E402
from influence_core.pipeline.specs import DigitsDataset, LoraSpec, ModelSpec, PythonDocsDataset  # noqa: E402
from influence_core.task import Task  # noqa: E402
from influence_core.training import AdamRecipe, train  # noqa: E402

KEPT = 0.9  # each subset keeps 90% of the fine-tuning rows


def rows(spec: DigitsDataset | PythonDocsDataset) -> tuple[torch.Tensor, ...]:
    source = open_source(spec, {})
    (x, y), (xq, yq) = (next(split.blocks()) for split in (source.train, source.test))
    return tuple(torch.as_tensor(a) for a in (x, y, xq, yq))


def problem(name: str) -> tuple[Callable[[], torch.nn.Module], Task, tuple[torch.Tensor, ...], int]:
    """The pretrained model's builder (a fresh copy per call), the task, the fine-tuning rows and queries, and the
    fine-tune's batch size."""
    if name == "mlp":
        spec = ModelSpec(hidden=[32], dtype="float64")
        x, y, xq, yq = rows(DigitsDataset(n_train=700, n_test=20))
        x, xq = x.double(), xq.double()
        torch.manual_seed(0)
        base = spec.build(64, 10, (64,)).double()
        train(base, spec.make_task(), AdamRecipe(20, 64, 1e-2, 1e-3, 0), x[:500], y[:500])
        state = base.state_dict()
        return lambda: _loaded(spec.build(64, 10, (64,)).double(), state), spec.make_task(), (x[500:], y[500:], xq, yq), 32
    spec = ModelSpec(architecture="transformer", task="language_modelling", d_model=32, heads=2, layers=1, dtype="float64")
    x, y, xq, yq = rows(PythonDocsDataset(window=32, n_train=352, n_test=8))
    torch.manual_seed(0)
    base = spec.build(32, 256, (32,)).double()
    train(base, spec.make_task(), AdamRecipe(4, 32, 3e-3, 0.0, 0), x[:256], y[:256])
    state = base.state_dict()

    def adapted() -> torch.nn.Module:
        torch.manual_seed(1)
        return with_lora(_loaded(spec.build(32, 256, (32,)).double(), state), LoraSpec(rank=4, target_modules=["query", "value"]))

    return adapted, spec.make_task(), (x[256:], y[256:], xq, yq), 16


def _loaded(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model.load_state_dict(state)
    return model


def measure(build: Callable[[], torch.nn.Module], task: Task, recipe: AdamRecipe, data: tuple[torch.Tensor, ...], subsets: int) -> dict[str, float]:
    """MAGIC's spread and its LDS over `subsets` retrainings (removed rows weighted 0, the queries' measurements)."""
    x, y, xq, yq = data
    scores = metagradients(build(), task, recipe, x, y, xq, yq).scores.double()
    magnitudes = scores.abs()
    masks = np.stack([np.random.default_rng([7, s]).permutation(len(y)) < round(KEPT * len(y)) for s in range(subsets)])
    measured = []
    for mask in masks:
        replay = Replay(build(), task, recipe, x, y)
        final = replay.checkpoints(torch.from_numpy(mask).double())[1].params
        with torch.no_grad():
            measured.append(task.measurement(replay.objective.outputs(final, xq), yq).reshape(len(yq), -1).sum(1).numpy())
    lds = linear_datamodeling_score(scores.numpy(), masks, np.stack(measured))
    return {"spread": float(magnitudes.max() / magnitudes.median()), "lds": float(lds.mean), "lds_se": float(lds.stderr), "steps": recipe.steps(len(y))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--subsets", type=int, default=16)
    parser.add_argument("--problems", default="mlp,lora")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| problem | seed | steps | warm-up | max/median \\|score\\| | LDS (± s.e.) |\n|---|---|---|---|---|---|")
    for name in args.problems.split(","):
        build, task, data, batch = problem(name)
        for seed in range(args.seeds):
            for warmup in (0.0, 0.1):
                recipe = AdamRecipe(epochs=3, batch_size=batch, learning_rate=1e-2, weight_decay=0.0, seed=seed, decay="linear", warmup=warmup)
                got = measure(build, task, recipe, data, args.subsets)
                print(f"| {name} | {seed} | {got['steps']} | {warmup:g} | {got['spread']:,.0f} | {got['lds']:.2f} ± {got['lds_se']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
