"""Which training recipes MAGIC linearises, in minutes: a library-level sweep (no pipeline) over step sizes, decays and
the CNN's pooling, each recipe's MAGIC LDS (subsets keeping 90%, the removed rows weighted 0 in the same schedule)
beside the trained model's held-out accuracy. A screen before magic_lds.py's 64-subset pipeline runs.

    .venv/bin/python benchmarks/magic_recipes.py mlp 1e-2,constant,max 3e-3,linear,max ...   (prints a markdown table)
    .venv/bin/python benchmarks/magic_recipes.py cnn 1e-2,linear,avg,channels=16x32,weight_decay=1e-2 ...

Data as magic_lds.py's problems: digits, 1,000 training rows, its 40 queries (the first 40 of the source's 360 held-out
rows); accuracy on the other 320. Each recipe is `learning_rate,lr_decay,pooling` on the default TrainingSpec (60 epochs, batch 64,
weight decay 1e-3, seed 0), with any other field of TrainingSpec or ModelSpec set after them; the MAGIC scores come from `influence_core.magic.metagradients`, the retrainings from
`influence_core.training.train` with per-row loss weights, the LDS from `influence_core.lds`.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from influence_core.lds import linear_datamodeling_score  # noqa: E402
from influence_core.magic import metagradients  # noqa: E402
from influence_core.pipeline.sources.data import open_source  # noqa: E402
from influence_core.pipeline.specs import DigitsDataset, ModelSpec, TrainingSpec  # noqa: E402
from influence_core.training import train  # noqa: E402

N_TRAIN, N_QUERIES, KEPT, SEED = 1000, 40, 0.9, 0
SHAPES = {"mlp": (64,), "cnn": (1, 8, 8)}


@functools.cache
def digits(shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The training rows and the source's whole held-out split (its first N_QUERIES are the queries), features shaped
    for the model; read once per shape."""
    source = open_source(DigitsDataset(n_train=N_TRAIN), {})  # n_test empty: the whole held-out split
    (x, y), (x_held, y_held) = (next(split.blocks()) for split in (source.train, source.test))
    x, x_held = (torch.as_tensor(a, dtype=torch.float32).reshape(-1, *shape) for a in (x, x_held))
    return x, torch.as_tensor(y), x_held, torch.as_tensor(y_held)


def screen(architecture: str, recipe: str, subsets: int) -> dict[str, float]:
    """One recipe's MAGIC LDS (± s.e.) over `subsets` retrainings, and its held-out accuracy. A recipe is
    `learning_rate,lr_decay,pooling`, then any `field=value` of TrainingSpec or ModelSpec (`channels=16x32`)."""
    learning_rate, decay, pooling, *more = recipe.split(",")
    fields = dict(item.split("=", 1) for item in more)
    model_fields = {k: [int(c) for c in v.split("x")] if k in ("channels", "hidden") else v for k, v in fields.items() if k in ModelSpec.model_fields}
    shape = SHAPES[architecture]
    spec = ModelSpec(architecture=architecture, pooling=pooling, **model_fields)
    training = TrainingSpec(learning_rate=float(learning_rate), lr_decay=decay, seed=SEED, **{k: v for k, v in fields.items() if k not in model_fields}).recipe()
    task = spec.make_task()
    x, y, x_held, y_held = digits(shape)
    xq, yq, xh, yh = x_held[:N_QUERIES], y_held[:N_QUERIES], x_held[N_QUERIES:], y_held[N_QUERIES:]

    def trained(weights: torch.Tensor | None = None) -> torch.nn.Module:
        torch.manual_seed(SEED)  # fit_model's initial weights
        model = spec.build(64, 10, shape)
        train(model, task, training, x, y, weights)
        return model

    torch.manual_seed(SEED)
    scores = metagradients(spec.build(64, 10, shape), task, training, x, y, xq, yq).scores.numpy()
    full = trained()
    masks = np.ones((subsets, N_TRAIN), dtype=bool)
    rng = np.random.default_rng(SEED)
    measured = []
    for mask in masks:
        mask[rng.choice(N_TRAIN, round((1 - KEPT) * N_TRAIN), replace=False)] = False
        model = trained(torch.as_tensor(mask, dtype=torch.float32))
        with torch.no_grad():
            measured.append(task.loss(model(xq), yq).numpy())
    lds = linear_datamodeling_score(scores, masks, np.array(measured))
    with torch.no_grad():
        accuracy = float((full(xh).argmax(1) == yh).float().mean())
    return {"lds": lds.mean, "stderr": lds.stderr, "accuracy": accuracy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("architecture", choices=list(SHAPES))
    parser.add_argument("recipes", nargs="+", help="learning_rate,lr_decay,pooling[,field=value...], e.g. 3e-3,linear,avg or 1e-2,linear,avg,channels=16x32,weight_decay=1e-2")
    parser.add_argument("--subsets", type=int, default=32)
    args = parser.parse_args()
    print(f"| {args.architecture}: lr, decay, pooling | MAGIC LDS ± s.e. ({args.subsets} subsets at {KEPT:.0%}) | held-out accuracy |")
    print("|---|---|---|")
    for recipe in args.recipes:
        row = screen(args.architecture, recipe, args.subsets)
        print(f"| {recipe} | {row['lds']:.3f} ± {row['stderr']:.3f} | {row['accuracy']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
