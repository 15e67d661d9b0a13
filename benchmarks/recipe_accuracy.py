"""What magic_lds.py's recipes cost in accuracy: the digits MLP and CNN trained by each recipe (influence_core's own
`train`, as fit_model trains), 3 seeds each, on the 1,000 training rows of magic_lds.py's problems, and scored on the
digits source's whole held-out split: 360 rows (its 20% test split; magic_lds.py's 40 queries are its first 40).

    .venv/bin/python benchmarks/recipe_accuracy.py   (prints a markdown table; docs/methods.md quotes it)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.magic_lds import CELLS, RECIPES  # noqa: E402
from benchmarks.magic_recipes import digits  # noqa: E402
from influence_core.pipeline.model.models import evaluate, train  # noqa: E402
from influence_core.pipeline.specs import ModelSpec, TrainingSpec  # noqa: E402

SEEDS = (0, 1, 2)
SHAPES = {"MLP": ("mlp", (64,)), "CNN": ("cnn", (1, 8, 8))}


def accuracy(problem: str, recipe: str, epochs: int, seed: int) -> float:
    """Held-out accuracy of one model: the problem's architecture, the recipe's settings, this seed."""
    architecture, shape = SHAPES[problem]
    training, cnn = RECIPES[recipe]
    spec = ModelSpec(architecture=architecture, **(cnn if problem == "CNN" else {}))
    x, y, x_held, y_held = digits(shape)
    torch.manual_seed(seed)  # as fit_model draws the initial weights
    model = spec.build(64, 10, shape)
    train(model, spec, TrainingSpec(epochs=epochs, seed=seed, **training), x, y)
    return evaluate(model, spec.make_task(), x_held, y_held, "held_out")["held_out_accuracy"]


def main() -> None:
    torch.set_num_threads(1)
    print("| problem | epochs | " + " | ".join(RECIPES) + " |")
    print("|---|---|" + "---|" * len(RECIPES))
    for problem in SHAPES:
        for epochs in sorted({e for e, _ in CELLS}, reverse=True):
            means = [sum(accuracy(problem, recipe, epochs, seed) for seed in SEEDS) / len(SEEDS) for recipe in RECIPES]
            print(f"| {problem} | {epochs} | " + " | ".join(f"{m:.3f}" for m in means) + " |", flush=True)


if __name__ == "__main__":
    main()
