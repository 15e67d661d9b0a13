"""A compressed training index: LoGra's Kronecker projection per gradient matrix, applied to both sides of a score.

A method whose features are the gradient itself (or its rotation into a curvature eigenbasis) scores
⟨F_q, G_i⟩ summed over layers, F_q the query's factor and G_i the training example's gradient matrix. Projecting
both with Φ_out (k × out) and Φ_in (k × in), random orthonormal rows scaled by √(n/k), gives ⟨Φ_out F Φ_inᵀ, Φ_out G Φ_inᵀ⟩, an unbiased
estimate of each layer's term in k² numbers per example instead of out·in. The training side is projected from the
captures (Σ_t (Φ_out g_t)(Φ_in a_t)ᵀ), never forming a per-example gradient; a cut whose captures are not one float
input (an embedding, a tied weight), or that is whitened first, is projected from its gradient matrices. The
parameters outside the cuts (the vmapped rest: biases of normalisations and the like, few) are kept as they are.
"""

from __future__ import annotations

import torch

from .contraction import Batch, GradientSplit, LayerCut, RowOrder, cut_gradients
from .layers import outer_gradients
from .projection import draw


def orthogonal_rows(k: int, n: int, key: list[int]) -> torch.Tensor:
    """Φ (k × n): k orthonormal rows of a seeded random rotation, scaled by √(n/k), so E[ΦᵀΦ] = I as for a Gaussian Φ,
    with less variance (none at k = n): a side near a matrix's size keeps it nearly exactly."""
    q, r = torch.linalg.qr(draw("gaussian", k, n, key, torch.float64, torch.device("cpu")).T)
    return (q * torch.sign(torch.diagonal(r))).T * (n / k) ** 0.5


class IndexProjection:
    """Φ_out ⊗ Φ_in of side at most `side` for every cut of a gradient split, seeded by (seed, cut number); the rest
    columns kept. `training` maps a captured batch and `factors` flat query factors to the same `dim` coordinates.

    With `damped` (a curvature diagonal in the captures' basis per cut, K-FAC/EK-FAC's Λ + λ in its eigenbasis) both
    sides are whitened before projecting: G D^(-1/2) for training rows, F D^(1/2) for the factors F = G_q D⁻¹, so the
    projected inner product estimates ⟨G_q D^(-1/2), G_i D^(-1/2)⟩, the same score, from two vectors of like size;
    projecting F and G themselves loses the score when D spans orders of magnitude."""

    def __init__(self, split: GradientSplit, order: RowOrder, side: int, seed: int, damped: dict[str, torch.Tensor] | None = None) -> None:
        self.split, self.order, self.side, self.seed, self.damped = split, order, side, seed, damped or {}
        self._phi: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def sides(self, cut: LayerCut) -> tuple[int, int]:
        """k_out, k_in: `side`, or the matrix's own size when smaller (such a side is kept exactly, Φ = I)."""
        return min(self.side, cut.shape[0]), min(self.side, cut.shape[1])

    @property
    def dim(self) -> int:
        rest = 0 if self.split.rest_columns is None else len(self.split.rest_columns)
        return sum(k_out * k_in for k_out, k_in in map(self.sides, self.split.cuts)) + rest

    def _factors(self, index: int, cut: LayerCut, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self._phi:
            (k_out, k_in), (out, inp) = self.sides(cut), cut.shape
            self._phi[index] = tuple(  # type: ignore[assignment]
                torch.eye(n, dtype=like.dtype, device=like.device) if k == n else orthogonal_rows(k, n, [self.seed, index, j]).to(dtype=like.dtype, device=like.device)
                for j, (k, n) in enumerate(((k_out, out), (k_in, inp)))
            )
        phi_out, phi_in = self._phi[index]
        return phi_out.to(like.dtype), phi_in.to(like.dtype)

    def training(self, batch: Batch) -> torch.Tensor:
        """(n, dim): each cut's projected gradient from the batch's captures, then the rest's gradients."""
        parts = []
        for index, cut in enumerate(self.split.cuts):
            shares = batch.shares(cut.name)
            if cut.name in self.damped:
                parts.append(self._project(index, cut, cut_gradients(batch, cut) * self.damped[cut.name].to(batch.dtype).rsqrt()))
            elif len(shares) == 1 and shares[0][0].is_floating_point():
                a, g = shares[0]
                phi_out, phi_in = self._factors(index, cut, a)
                parts.append(outer_gradients(g @ phi_out.T, a @ phi_in.T).reshape(batch.n, -1))
            else:
                parts.append(self._project(index, cut, cut_gradients(batch, cut)))
        if batch.rest is not None:
            parts.append(batch.rest)
        return torch.cat(parts, dim=1)

    def factors(self, flat: torch.Tensor) -> torch.Tensor:
        """(m, dim): query factors (m, p) in the split's column layout, projected as the training side is."""
        parts = [self._project(index, cut, self._whitened(cut, cut.matrix(flat, self.order))) for index, cut in enumerate(self.split.cuts)]
        if self.split.rest_columns is not None:
            parts.append(flat[:, self.split.rest_columns.to(flat.device)])
        return torch.cat(parts, dim=1)

    def _whitened(self, cut: LayerCut, factors: torch.Tensor) -> torch.Tensor:
        return factors * self.damped[cut.name].to(factors.dtype).sqrt() if cut.name in self.damped else factors

    def _project(self, index: int, cut: LayerCut, matrices: torch.Tensor) -> torch.Tensor:
        phi_out, phi_in = self._factors(index, cut, matrices)
        return (phi_out @ matrices @ phi_in.T).reshape(len(matrices), -1)
