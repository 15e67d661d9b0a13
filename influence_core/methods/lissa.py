"""LiSSA: a stochastic Neumann-series estimate of (C + λI)⁻¹ v (Agarwal et al., 2017; Koh & Liang; FastIF)."""

from __future__ import annotations

import torch

from ..batches import BatchSampler
from ..blocks import BlockCurvature
from ..errors import NumericalError
from .base import BlockSolver, InfluenceFunctionModel


class LissaSolver(BlockSolver):
    """h ← v + (1 − d)·h − (C_B + λI)·h / s over `depth` random batches of size B, averaged over `repeats`; the
    estimate is h / s. Converges when s exceeds the largest eigenvalue of C + λI; damping d adds d·s to λ.
    """

    def __init__(self, curvature: BlockCurvature, lam: float, depth: int, repeats: int, lissa_batch_size: int, scale: float, damping: float, rtol: float, seed: int) -> None:
        super().__init__(curvature, lam)
        self.depth, self.repeats, self.batch_size = depth, repeats, lissa_batch_size
        self.scale, self.damping, self.rtol, self.seed = scale, damping, rtol, seed
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

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        sampler = BatchSampler(self.curvature.data, self.batch_size, self.seed)
        total = torch.zeros_like(features)
        for _ in range(self.repeats):
            total += self._one_run(features, sampler)
        self.curvature.work.solves += len(features)
        self.curvature.work.solver_iterations += sum(self.iterations[-self.repeats :])
        return total / (self.repeats * self.scale)


class LissaInfluence(InfluenceFunctionModel):
    """Matrix-free and stochastic: each step uses one mini-batch, so memory is one batch, and the number of data
    passes is depth·B/n per repeat. Knobs as in FastIF: recursion depth J, repeats T, batch size B, scale, damping.
    Stops early when every relative residual |v − (C_B + λI)·h/s| / |v| falls below rtol (the exact residual
    when B covers the training set; a noisy estimate otherwise, which then runs to the full depth).
    """

    name = "lissa"
    supports_projection = False  # its stochastic steps need curvature products of single batches

    def __init__(
        self,
        *args,
        depth: int = 1000,
        repeats: int = 1,
        lissa_batch_size: int = 64,
        scale: float = 10.0,
        damping: float = 0.0,
        rtol: float = 1e-4,
        seed: int = 0,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.options = (depth, repeats, lissa_batch_size, scale, damping, rtol, seed)

    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        return LissaSolver(curvature, lam, *self.options)
