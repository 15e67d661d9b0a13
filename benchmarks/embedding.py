"""Scoring a byte-level language model with its token embedding contracted (sparse, per distinct token) vs taken by
vmap per-example gradients (the path before issue 26), alternating in one process on the same model, factors and data.

    PYTHONPATH=. .venv/bin/python benchmarks/embedding.py --vocab 256 4096 --repeats 3 [--profile] [--linear-and-tokens] [--tied]

The vmap side is the same model scored with a split built while `nn.Embedding` counts as not contractible: exactly
the split every run took before. Both sides give the same scores (checked, float32 tolerance). All parameters are
attributed by default, so the position embedding and the layer norms keep a vmap pass on both sides;
`--linear-and-tokens` attributes the token embedding and the Linear layers only (method.modules), where the contracted
side needs no vmap pass at all. `--tied` ties the head to the token embedding as GPT-2 does (no head bias, its weight
the embedding's); the vmap side is then the split before tied weights were contracted (the tied weight vmapped, any
untied embedding still contracted).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from influence_core import IdentityInfluence, contraction, layers
from influence_core.contraction import GradientSplit
from influence_core.methods.scorer import Scorer
from influence_core.pipeline.model.transformer import TokenTransformer

CONTEXT, WIDTH, HEADS, BLOCKS = 63, 128, 4, 2


@contextmanager
def embeddings_vmapped() -> Iterator[None]:
    """While open, a GradientSplit treats every nn.Embedding as not contractible (the split before issue 26)."""
    original = contraction.contractible
    contraction.contractible = lambda module: not isinstance(module, nn.Embedding) and layers.contractible(module)
    try:
        yield
    finally:
        contraction.contractible = original


@contextmanager
def ties_vmapped() -> Iterator[None]:
    """While open, a GradientSplit finds no tied embeddings, so a tied weight stays on vmap (the split before)."""
    original = contraction.tied_embeddings
    contraction.tied_embeddings = lambda model: []
    try:
        yield
    finally:
        contraction.tied_embeddings = original


def tokens(n: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Token ids (n, CONTEXT) drawn from a Zipf-like law over the vocabulary, so tokens repeat as in text."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, n * CONTEXT, replacement=True, generator=generator).reshape(n, CONTEXT)


def run(vocab: int, n_train: int, n_queries: int, batch: int, repeats: int, profiled: bool, linear_and_tokens: bool, tied: bool) -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = TokenTransformer(vocab, CONTEXT, WIDTH, HEADS, BLOCKS, vocab, causal=True)
    if tied:  # as GPT-2's lm_head
        model.head = nn.Linear(WIDTH, vocab, bias=False)
        model.head.weight = model.tokens.weight
    x, q = tokens(n_train, vocab, generator), tokens(n_queries, vocab, generator)
    # a tied head's weight is the token embedding's, attributed under "tokens"
    modules = [n for n, m in model.named_modules() if (isinstance(m, nn.Linear) and m.weight is not model.tokens.weight) or n == "tokens"] if linear_and_tokens else None
    after = IdentityInfluence(model, "language_modelling", batch_size=batch, modules=modules).fit((x, x))
    before = IdentityInfluence(model, "language_modelling", batch_size=batch, modules=modules).fit((x, x))
    with ties_vmapped() if tied else embeddings_vmapped():
        before._split = GradientSplit(before.objective, (x[:8], x[:8]))
    factors = after.influence_factors(q, q)
    sides = {"vmap": before, "contracted": after}
    for name, im in sides.items():
        captured = {cut.name for cut in im.gradient_split(x, x).cuts}
        print(f"{name}: tokens {'captured' if 'tokens' in captured else 'vmapped'}, vmapped {im.attributed_parameters()['vmapped']['elements']} elements")
    scores = {name: Scorer(im, factors, None)(x, x)[0] for name, im in sides.items()}
    torch.testing.assert_close(scores["contracted"], scores["vmap"], rtol=1e-3, atol=1e-3 * float(scores["vmap"].abs().max()))
    if profiled:
        for name, im in sides.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                Scorer(im, factors, None)(x, x)
            print(f"--- profile, {name}, vocab {vocab}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    wall: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}  # this process's CPU seconds: less moved by other load
    for _ in range(repeats):
        for name, im in sides.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            Scorer(im, factors, None)(x, x)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    attributed = ("token embedding and Linear layers" if linear_and_tokens else "all parameters") + (", head tied to the token embedding" if tied else "")
    print(f"vocab {vocab}, {attributed}: n_train {n_train}, queries {n_queries}, batch {batch}")
    for label, times in (("wall", wall), ("cpu", cpu)):
        medians = {name: statistics.median(t) for name, t in times.items()}
        runs = "; ".join(f"{name} " + ", ".join(f"{t:.2f}" for t in ts) for name, ts in times.items())
        print(f"  {label}: median vmap {medians['vmap']:.2f} s, contracted {medians['contracted']:.2f} s, ratio {medians['vmap'] / medians['contracted']:.2f}x ({runs})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--n-train", type=int, default=256)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--linear-and-tokens", action="store_true", help="attribute the token embedding and the Linear layers only")
    parser.add_argument("--tied", action="store_true", help="tie the head's weight to the token embedding (GPT-2's lm_head, no bias)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for vocab in args.vocab:
        run(vocab, args.n_train, args.queries, args.batch, args.repeats, args.profile, args.linear_and_tokens, args.tied)


if __name__ == "__main__":
    main()
