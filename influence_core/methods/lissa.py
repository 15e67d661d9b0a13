"""LiSSA: a stochastic Neumann-series estimate of (C + λI)⁻¹ v (Agarwal et al., 2017; Koh & Liang; FastIF)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..batches import BatchSampler
from ..blocks import BlockCurvature
from ..errors import NumericalError
from ..reduction import pairwise_sum
from .influence_model import BlockSolver, InfluenceFunctionModel
from .options import CurvatureOptions, option


@dataclass(frozen=True, kw_only=True)
class LissaOptions(CurvatureOptions):
    depth: int = option(1000, "Recursion depth J", "Steps of the recursion per repeat.", ge=1)
    repeats: int = option(1, "Repeats T", "Independent recursions averaged.", ge=1)
    lissa_batch_size: int = option(64, "Batch size B", "Training examples per curvature sample.", ge=1)
    scale: float = option(10.0, "Scale", "Must exceed the largest eigenvalue of C + λI; raise it when LiSSA diverges.", gt=0)
    damping: float = option(0.0, "Damping", "Shrinks the recursion; adds damping·scale to λ.", ge=0, lt=1)
    rtol: float = option(1e-4, "Convergence tolerance", "Stop when every relative residual of the batch system falls below this.", gt=0)
    seed: int = option(0, "Seed", "Seed of the batch sampling.")


class LissaSolver(BlockSolver):
    """h ← v + (1 − d)·h − (C_B + λI)·h / s over `depth` random batches of size B, averaged over `repeats`; the
    estimate is h / s. Converges when s exceeds the largest eigenvalue of C + λI; damping d adds d·s to λ.
    """

    def __init__(self, curvature: BlockCurvature, lam: float, options: LissaOptions) -> None:
        super().__init__(curvature, lam)
        self.depth, self.repeats, self.batch_size = options.depth, options.repeats, options.lissa_batch_size
        self.scale, self.damping, self.rtol, self.seed = options.scale, options.damping, options.rtol, options.seed
        self.iterations: list[int] = []

    def _one_run(self, v: torch.Tensor, sampler: BatchSampler) -> torch.Tensor:
        h = v.clone()
        v_norm = v.norm(dim=1).clamp_min(1e-30)
        for step in range(1, self.depth + 1):
            x, y = sampler()
            residual = v - self.damping * h - (self.curvature.batch_matmat(x, y, h) + self.lam * h) / self.scale
            h = h + residual
            relative = residual.norm(dim=1) / v_norm
            if not bool(torch.isfinite(h).all()) or bool(relative.max() > 1e4):  # a converging recursion never grows its residual so far
                raise NumericalError(
                    f"LiSSA diverged after {step} steps: raise method.scale (now {self.scale}) above the largest "
                    f"eigenvalue of C + λI, or add method.damping"
                )
            if bool(relative.max() < self.rtol):  # the residual of (C_B + λI) x = v for x = h/s, as in CG
                self.iterations.append(step)
                return h
        self.iterations.append(self.depth)
        return h

    def repeat(self, features: torch.Tensor, index: int) -> torch.Tensor:
        """Repeat `index`'s term of the average, h / (T·s), from batches of its own seed: repeats are independent
        of each other and of where they run, so FastIF's parallel recipe (repeats spread over workers, added in the
        same pairwise tree) gives the same bits as this process."""
        h = self._one_run(features, BatchSampler(self.curvature.data, self.batch_size, repeat_seed(self.seed, index)))
        self.curvature.work.solves += len(features) if index == 0 else 0  # one solve per right-hand side, however many repeats
        self.curvature.work.solver_iterations += self.iterations[-1]
        return h / (self.repeats * self.scale)

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        return pairwise_sum((self.repeat(features, index) for index in range(self.repeats)), torch.add)


def repeat_seed(seed: int, index: int) -> int:
    """The batch seed of repeat `index`: `seed` itself for the first, independent streams for the others."""
    return seed if index == 0 else int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


class LissaInfluence(InfluenceFunctionModel):
    """Matrix-free and stochastic: each step uses one mini-batch, so memory is one batch, and the number of data
    passes is depth·B/n per repeat. Knobs as in FastIF: recursion depth J, repeats T, batch size B, scale, damping.
    Stops early when every relative residual |v − (C_B + λI)·h/s| / |v| falls below rtol (the exact residual
    when B covers the training set; a noisy estimate otherwise, which then runs to the full depth).
    """

    name = "lissa"
    title = "LiSSA"
    summary = "LiSSA: stochastic Neumann series (FastIF's J, T, B knobs)."
    Options = LissaOptions  # no projection: its stochastic steps need curvature products of single batches
    options: LissaOptions
    needs_positive_regularization = True  # along the curvature's null space the recursion grows without bound at λ = 0

    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        return LissaSolver(curvature, lam, self.options)

    @property
    def repeats(self) -> int:
        return self.options.repeats

    def repeat_factors(self, x: torch.Tensor, y: torch.Tensor, index: int) -> torch.Tensor:
        """Repeat `index`'s term of the dense query factors (n_test, p'); the terms of repeats 0..T-1, added in
        `pairwise_sum`'s tree, are the dense factors: one Dask task per repeat in the pipeline (FastIF's parallel s_test)."""
        features = self.gradient_features(x, y, measure=True)
        return self._per_block(features, self._feature_slices(), lambda solver, f: solver.repeat(f, index))
