"""Self-influence ∇ℓ(z_i)ᵀ (C + λI)⁻¹ ∇ℓ(z_i) as its own choice: exact where the method makes it cheap, a low-rank
estimate where an exact value needs a solve per training example, or off.

Three forms, all in the method's feature coordinates φ (the gradient, its eigenbasis coordinates, or a projection):
- `Diagonal`: (C + λI)⁻¹ is diagonal in φ (identity, Arnoldi, K-FAC/EK-FAC in their eigenbasis): Σ_j w_j φ_j²;
- `Sketch`: (C + λI)⁻¹ ≈ Uᵀ diag(w) U + c (I − UᵀU) with orthonormal rows U (k, p'): exact in the top-k
  eigenspace, the rest weighted by c = 1/(mean remaining eigenvalue + λ). Nyström is exactly this; Direct and the
  iterative methods use it as their low-rank estimate;
- `Solve`: φᵀ (C + λI)⁻¹ φ by the method's own solver, one (batched) solve per training example: exact, and as
  expensive as that sounds for CG, LiSSA and DataInf; its solves and curvature products are counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

import torch

SelfInfluenceMode = Literal["auto", "exact", "lowrank", "off"]


@dataclass
class Diagonal:
    """Weights of the diagonal inverse, one tensor per block of the features (a layer's (out, in) matrix, or a
    vector)."""

    weights: dict[str, torch.Tensor]


@dataclass
class Sketch:
    """Orthonormal rows U (k, p') with their inverse eigenvalues w (k,), the block each row lies in, and per block
    the weight c_b of the block's orthogonal complement:
    φᵀ (C + λI)⁻¹ φ ≈ Σ_k w_k (u_kᵀφ)² + Σ_b c_b (‖φ_b‖² − Σ_{k in b} (u_kᵀφ)²)."""

    rows: torch.Tensor
    weights: torch.Tensor
    row_block: torch.Tensor
    complements: torch.Tensor

    def evaluate(self, coords: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """Self-influences from the rows' coordinates (k, n) and the squared norms of each block (blocks, n)."""
        inside = coords**2
        per_block = torch.zeros_like(norms).index_add_(0, self.row_block.to(norms.device), inside)
        within = self.weights.to(coords.dtype) @ inside if len(inside) else torch.zeros_like(norms[0])
        return within + (self.complements.to(norms.dtype)[:, None] * (norms - per_block).clamp_min(0)).sum(0)

    @staticmethod
    def from_blocks(parts: list[tuple[torch.Tensor, torch.Tensor, float]], slices: list[slice], dim: int) -> "Sketch":
        """Block-diagonal sketch from each block's (rows (k_b, dim_b), weights (k_b,), complement)."""
        rows, weights, blocks = [], [], []
        for index, ((block_rows, block_weights, _), sl) in enumerate(zip(parts, slices)):
            embedded = block_rows.new_zeros(len(block_rows), dim)
            embedded[:, sl] = block_rows
            rows.append(embedded)
            weights.append(block_weights)
            blocks.append(torch.full((len(block_rows),), index, dtype=torch.long))
        complements = torch.tensor([complement for _, _, complement in parts], dtype=torch.float64)
        return Sketch(torch.cat(rows), torch.cat(weights), torch.cat(blocks), complements)


@dataclass
class Solve:
    """Exact, by the method's solver applied to each example's features."""


SelfInfluencePlan = Union[Diagonal, Sketch, Solve, None]


def eigen_sketch(values: torch.Tensor, vectors: torch.Tensor, lam: float, rank: int, trace: float | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One block's (rows, weights, complement) from eigenpairs of its C (values, vectors as columns (p_b, ≥k)):
    the top-`rank` eigenvectors, and the complement weighted by 1/(μ̄ + λ), μ̄ the mean of the eigenvalues not
    kept (from `trace`; without one, μ̄ = 0 gives Nyström's 1/λ)."""
    dim = len(vectors)
    order = torch.argsort(values, descending=True)[:rank]
    kept = values[order].to(torch.float64).clamp_min(0)
    rest = dim - len(kept)
    mean_rest = max(0.0, (trace - float(kept.sum())) / rest) if (trace is not None and rest > 0) else 0.0
    complement = 1.0 / (mean_rest + lam) if rest > 0 and mean_rest + lam > 0 else 0.0
    return vectors[:, order].T.contiguous(), (1.0 / (kept + lam)).to(vectors.dtype), complement


def auto_rank(requested: int, n_queries: int) -> int:
    """The rank `auto` uses: at most half the queries, so the sketch rows cost at most half the scores' GEMM,
    and at least 4."""
    return max(4, min(requested, n_queries // 2))


def plan_state(plan: SelfInfluencePlan) -> dict:
    """A plan as tensors and strings, to store and ship to workers (read back with weights_only=True)."""
    if plan is None:
        return {"kind": "off"}
    if isinstance(plan, Diagonal):
        return {"kind": "diagonal", "weights": plan.weights}
    if isinstance(plan, Sketch):
        return {"kind": "sketch", "rows": plan.rows, "weights": plan.weights, "row_block": plan.row_block, "complements": plan.complements}
    return {"kind": "solve"}


def plan_from_state(state: dict) -> SelfInfluencePlan:
    kind = state["kind"]
    if kind == "off":
        return None
    if kind == "diagonal":
        return Diagonal(state["weights"])
    if kind == "sketch":
        return Sketch(state["rows"], state["weights"], state["row_block"], state["complements"])
    return Solve()


def describe(plan: SelfInfluencePlan) -> dict:
    """What a summary says about a plan: its form, and the sketch's rank (rows per block of the curvature)."""
    state = plan_state(plan)
    if not isinstance(plan, Sketch):
        return {"form": state["kind"]}
    return {"form": "sketch", "rank": int(torch.bincount(plan.row_block).max()) if len(plan.row_block) else 0}
