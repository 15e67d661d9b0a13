"""Gradient compression: seeded random projections (Gaussian or Rademacher, generated in blocks) and LoGra's
Kronecker-structured projection, which never materialises a per-example gradient.

Each tracked layer is projected to its own `dim` coordinates, so inner products are preserved layer by layer
(E⟨Φu, Φv⟩ = ⟨u, v⟩) and per-module scores stay separable.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from .errors import ConfigError
from .layers import Capture, TrackedLayer, outer_gradients

ProjectionKind = Literal["gaussian", "rademacher", "logra"]


def draw(kind: str, rows: int, cols: int, key: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The block of Φ named by `key`, rows×cols with unit-variance entries scaled by 1/√rows: the same key
    always gives the same block, on any machine."""
    rng = np.random.default_rng(key)
    block = rng.standard_normal((rows, cols), dtype=np.float32) if kind == "gaussian" else rng.integers(0, 2, (rows, cols)).astype(np.float32) * 2 - 1
    return (torch.from_numpy(block) / math.sqrt(rows)).to(dtype=dtype, device=device)


class Projector(ABC):
    """Maps each tracked layer's per-example gradient to `dims[layer]` coordinates."""

    def __init__(self, layers: list[TrackedLayer], dim: int, seed: int) -> None:
        if dim < 1:
            raise ConfigError("method.projection.dim", f"dim={dim}", "use a positive projection dimension")
        self.layers, self.dim, self.seed = layers, dim, seed

    @property
    def dims(self) -> dict[str, int]:
        return {layer.name: self.layer_dim(layer) for layer in self.layers}

    def layer_dim(self, layer: TrackedLayer) -> int:
        return self.dim

    def project_capture(self, layer: TrackedLayer, index: int, cap: Capture) -> torch.Tensor:
        """The projected per-example gradients of one layer from its captured (a, g)."""
        return self.project_matrices(layer, index, cap.gradient(layer.name))

    @abstractmethod
    def project_matrices(self, layer: TrackedLayer, index: int, matrices: torch.Tensor) -> torch.Tensor:
        """Project gradient matrices (n, out, in) of layer number `index`."""

    @abstractmethod
    def back_project(self, layer: TrackedLayer, index: int, rows: torch.Tensor) -> torch.Tensor:
        """Φ_lᵀ rows: rows (m, dim) of layer number `index` as matrices (m, out, in), so ⟨row, Φ_l G⟩ = ⟨Φ_lᵀ row, G⟩
        for any gradient matrix G, one position's included (a projected score split by token)."""


class RandomProjector(Projector):
    """Φ_l (dim × p_l) with i.i.d. Gaussian or Rademacher entries, built in column blocks of at most
    `block_mb` megabytes: a p×k matrix beyond that budget never exists."""

    def __init__(self, layers: list[TrackedLayer], dim: int, seed: int, kind: Literal["gaussian", "rademacher"], block_mb: float) -> None:
        super().__init__(layers, dim, seed)
        self.kind, self.block_mb = kind, block_mb

    def block_columns(self) -> int:
        return max(1, int(self.block_mb * 2**20 // (4 * self.dim)))

    def project_matrices(self, layer: TrackedLayer, index: int, matrices: torch.Tensor) -> torch.Tensor:
        flat = matrices.reshape(matrices.shape[0], -1)
        out = flat.new_zeros(flat.shape[0], self.dim)
        step = self.block_columns()
        for j, lo in enumerate(range(0, flat.shape[1], step)):
            hi = min(lo + step, flat.shape[1])
            out += flat[:, lo:hi] @ draw(self.kind, self.dim, hi - lo, [self.seed, index, j], flat.dtype, flat.device).T
        return out

    def back_project(self, layer: TrackedLayer, index: int, rows: torch.Tensor) -> torch.Tensor:
        size = layer.out_dim * layer.in_dim
        step = self.block_columns()
        blocks = [rows @ draw(self.kind, self.dim, min(lo + step, size) - lo, [self.seed, index, j], rows.dtype, rows.device) for j, lo in enumerate(range(0, size, step))]
        return torch.cat(blocks, dim=1).reshape(len(rows), layer.out_dim, layer.in_dim)


class KroneckerProjector(Projector):
    """LoGra: Φ_l = Φ_out ⊗ Φ_in with Φ_out (k × out), Φ_in (k × in), k = √dim; the projected gradient
    Σ_t (Φ_out g_t)(Φ_in a_t)ᵀ is formed from the layer's inputs and output gradients directly."""

    def __init__(self, layers: list[TrackedLayer], dim: int, seed: int) -> None:
        super().__init__(layers, dim, seed)
        side = math.isqrt(dim)
        if side * side != dim:
            raise ConfigError("method.projection.dim", f"LoGra projects to k×k per layer, and dim={dim} is not a square", f"use e.g. dim={side * side} or {(side + 1) ** 2}")
        self.side = side
        self._factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def factors(self, layer: TrackedLayer, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self._factors:
            self._factors[index] = (
                draw("gaussian", self.side, layer.out_dim, [self.seed, index, 0], like.dtype, like.device),
                draw("gaussian", self.side, layer.in_dim, [self.seed, index, 1], like.dtype, like.device),
            )
        return self._factors[index]

    def project_capture(self, layer: TrackedLayer, index: int, cap: Capture) -> torch.Tensor:
        a, g = cap.a[layer.name], cap.g[layer.name][0]
        phi_out, phi_in = self.factors(layer, index, a)
        return outer_gradients(g @ phi_out.T, a @ phi_in.T).reshape(a.shape[0], -1)

    def project_matrices(self, layer: TrackedLayer, index: int, matrices: torch.Tensor) -> torch.Tensor:
        phi_out, phi_in = self.factors(layer, index, matrices)
        return (phi_out @ matrices @ phi_in.T).reshape(matrices.shape[0], -1)

    def back_project(self, layer: TrackedLayer, index: int, rows: torch.Tensor) -> torch.Tensor:
        phi_out, phi_in = self.factors(layer, index, rows)
        return phi_out.T @ rows.reshape(len(rows), self.side, self.side) @ phi_in


@dataclass(frozen=True)
class Projection:
    """How to compress gradients: `dim` coordinates per tracked layer, a seeded Gaussian, Rademacher or LoGra
    (Kronecker) projection, random blocks of at most `block_mb` megabytes."""

    kind: ProjectionKind = "logra"
    dim: int = 256
    seed: int = 0
    block_mb: float = 256.0

    def build(self, layers: list[TrackedLayer]) -> Projector:
        if self.kind == "logra":
            return KroneckerProjector(layers, self.dim, self.seed)
        if self.kind in ("gaussian", "rademacher"):
            return RandomProjector(layers, self.dim, self.seed, self.kind, self.block_mb)
        raise ConfigError("method.projection.kind", f"unknown projection {self.kind!r}", "use gaussian, rademacher or logra")


def project_batch(projector: Projector, cap: Capture) -> torch.Tensor:
    """All tracked layers' projected gradients of one captured batch, concatenated in layer order."""
    return torch.cat([projector.project_capture(layer, i, cap) for i, layer in enumerate(projector.layers)], dim=1)


def projected_rows(projector: Projector, factors: torch.Tensor) -> dict[str, torch.Tensor]:
    """Projected query factors (m, Σ dims, layer order as `project_batch`) back in each layer's gradient space
    (m, out, in): contracted with a training example's captures position by position, they split its projected score
    by token exactly, since the projection is linear in the gradient Σ_t g_t a_tᵀ."""
    rows, lo = {}, 0
    for i, layer in enumerate(projector.layers):
        dim = projector.layer_dim(layer)
        rows[layer.name] = projector.back_project(layer, i, factors[:, lo : lo + dim])
        lo += dim
    return rows
