"""A compressed training index: LoGra's Kronecker projection per gradient matrix, applied to both sides of a score.

A method whose features are the gradient itself (or its rotation into a curvature eigenbasis) scores
⟨F_q, G_i⟩ summed over layers, F_q the query's factor and G_i the training example's gradient matrix. Projecting
both with Φ_out (k × out) and Φ_in (k × in), random orthonormal rows scaled by √(n/k), gives ⟨Φ_out F Φ_inᵀ, Φ_out G Φ_inᵀ⟩, an unbiased
estimate of each layer's term in k² numbers per example instead of out·in. The training side is projected from the
captures (Σ_t (Φ_out g_t)(Φ_in a_t)ᵀ), never forming a per-example gradient; a cut whose captures are not one float
input (an embedding, a tied weight) is projected from its gradient matrices. A whitened cut, G ∘ W with W = D^(-1/2)
elementwise (not a Kronecker product), is projected from the captures too, through W's truncated SVD Σ_r u_r v_rᵀ:
Φ_out (G ∘ W) Φ_inᵀ = Σ_{r,t} (Φ_out diag(u_r) g_t)(Φ_in diag(v_r) a_t)ᵀ, R·T·k·(out + in) per example instead of
out·in·k; R keeps every entry of W within `whitening_rtol` (so every whitened gradient within it, in Frobenius norm),
and where that R makes it no cheaper, the matrices are formed. The rank is searched no further than where factoring
stops paying for the cut's positions (`break_even_rank`), through W's top singular triples alone when that rank is
far below its size: a convolution's or a language model's cut, formed anyway, takes no full SVD. The parameters
outside the cuts (the vmapped rest: biases of normalisations and the like, few) are kept as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import examples
from .contraction import BUDGET_BYTES, Batch, GradientSplit, LayerCut, RowOrder, cut_gradients
from .layers import outer_gradients
from .projection import draw

if TYPE_CHECKING:
    from .methods.influence_model import InfluenceFunctionModel

WHITENING_RTOL = 1e-3  # the largest relative error of an entry of the factored W = D^(-1/2)
# the formed path's multiply-adds ran at 14-15 G/s on one EPYC thread for matrices of 10^5 entries (W3's 1024 × 101
# layer: 0.53 ms an example, against 0.17 factored at full rank), the factored ones at 22-50 (benchmarks/projection_paths.py)
FORMED_COST = 1.5
OVERSAMPLE = 10  # singular triples beyond the rank wanted, for the randomized range finder's accuracy
FIRST_RANK = 16  # the whitening's rank search starts here and doubles
MAX_SIDE = 4096  # the largest side a compressed index takes (compute.index_side's bound)


def orthogonal_rows(k: int, n: int, key: list[int]) -> torch.Tensor:
    """Φ (k × n): k orthonormal rows of a seeded random rotation, scaled by √(n/k), so E[ΦᵀΦ] = I as for a Gaussian Φ,
    with less variance (none at k = n): a side near a matrix's size keeps it nearly exactly."""
    q, r = torch.linalg.qr(draw("gaussian", k, n, key, torch.float64, torch.device("cpu")).T)
    return (q * torch.sign(torch.diagonal(r))).T * (n / k) ** 0.5


def whitening_factors(damped: torch.Tensor, rtol: float, max_rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W = D^(-1/2) (out × in) as left (R, out) and right (R, in) in float64, Σ_r left_r right_rᵀ its SVD truncated to
    a rank (bisected) whose every entry is within rtol of W's, relatively, so ‖G∘W̃ − G∘W‖ ≤ rtol ‖G∘W‖ for every G;
    full rank where no smaller one is. With `max_rank` below W's size (the rank past which factoring costs more than
    forming), none (R = 0) when rank max_rank misses rtol. A cap far below W's size takes its randomized top singular
    triples (`_top_svd`) alone; otherwise ranks from FIRST_RANK up, doubling, are tried on theirs while they cost a
    small share of the full SVD, which is taken only past them (W3's 1024 × 1025 layer keeps rtol at rank 47: its
    whitening 0.26 -> 0.07 s; a D that needs full rank pays 11-21% more: projection_paths.py's 1024 × 4096, 2.3 -> 2.8 s)."""
    w = damped.to(torch.float64).rsqrt()
    full = min(w.shape)
    hi = full if max_rank is None else min(max_rank, full)
    if hi == 0:
        return w.new_zeros(0, w.shape[0]), w.new_zeros(0, w.shape[1])
    if (hi + OVERSAMPLE) * 4 <= full:  # a cap far below W's size: its top triples hold every smaller rank
        left, right = _truncatable(*_top_svd(w, hi))
        return _smallest(left, right, w, rtol, 0, hi) if _keeps(left, right, w, rtol, hi) else (left[:0], right[:0])
    lo, rank = 0, FIRST_RANK
    while rank < hi and (rank + OVERSAMPLE) * 8 <= full:  # small ranks first, on their randomized triples
        left, right = _truncatable(*_top_svd(w, rank))
        if _keeps(left, right, w, rtol, rank):
            return _smallest(left, right, w, rtol, lo, rank)
        lo, rank = rank, 2 * rank
    left, right = _truncatable(*torch.linalg.svd(w, full_matrices=False))
    if hi < full and not _keeps(left, right, w, rtol, hi):  # full rank keeps rtol as exactly as the SVD
        return left[:0], right[:0]
    return _smallest(left, right, w, rtol, lo, hi)


def _truncatable(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An SVD's triples as (left, right) rows: the rank-r truncation is left[:r].T @ right[:r]."""
    return (u * s).T, vh


def _keeps(left: torch.Tensor, right: torch.Tensor, w: torch.Tensor, rtol: float, rank: int) -> bool:
    """Whether the rank-`rank` truncation has every entry within rtol of w's, relatively."""
    return bool(((left[:rank].T @ right[:rank] - w).abs() <= rtol * w).all())


def _smallest(left: torch.Tensor, right: torch.Tensor, w: torch.Tensor, rtol: float, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors truncated to the smallest rank in (lo, hi] that keeps rtol, bisected: rank hi keeps it, lo is
    taken to miss it (a rank checked on other triples; were it to keep, a rank that keeps is still returned)."""
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if _keeps(left, right, w, rtol, mid):
            hi = mid
        else:
            lo = mid
    return left[:hi], right[:hi]


def _top_svd(w: torch.Tensor, rank: int, power: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top `rank` + OVERSAMPLE singular triples of w by a randomized range finder (Halko et al. 2011, with `power`
    re-orthonormalised power steps), its test matrix drawn by key (`projection.draw`), so the same w always gives the
    same factors; torch.svd_lowrank draws from the global generator. O(out·in·rank) where the full SVD is
    O(out·in·min(out, in))."""
    q = min(rank + OVERSAMPLE, *w.shape)
    basis, _ = torch.linalg.qr(w @ draw("gaussian", w.shape[1], q, [rank, *w.shape], w.dtype, w.device))
    for _ in range(power):
        basis, _ = torch.linalg.qr(w @ (w.T @ basis))
    u, s, vh = torch.linalg.svd(basis.T @ w, full_matrices=False)
    return basis @ u, s, vh


def factored_is_cheaper(rank: int, shape: tuple[int, int], sides: tuple[int, int], positions: int) -> bool:
    """Whether projecting G ∘ W from T captures through rank-R factors, R·T·(k_out·out + k_in·in + k_out·k_in)
    multiply-adds per example, costs less than forming G, whitening and projecting it, out·in·(T + 1 + k_out) +
    k_out·k_in·in, whose multiply-adds count FORMED_COST times: they run slower (one matrix per example)."""
    (out, inp), (k_out, k_in) = shape, sides
    return rank * positions * (k_out * out + k_in * inp + k_out * k_in) < FORMED_COST * (out * inp * (positions + 1 + k_out) + k_out * k_in * inp)


def break_even_rank(shape: tuple[int, int], sides: tuple[int, int], positions: int) -> int:
    """The largest whitening rank R at which `factored_is_cheaper` (0: none is), so no SVD past it is needed."""
    (out, inp), (k_out, k_in) = shape, sides
    per_rank = positions * (k_out * out + k_in * inp + k_out * k_in)
    return max(0, math.ceil(FORMED_COST * (out * inp * (positions + 1 + k_out) + k_out * k_in * inp) / per_rank) - 1)


def factored_projection(a: torch.Tensor, g: torch.Tensor, phi: tuple[torch.Tensor, torch.Tensor], whitening: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """(n, k_out·k_in): Σ_{r,t} (Φ_out diag(u_r) g_t)(Φ_in diag(v_r) a_t)ᵀ per example, from captures a (n, T, in) and
    g (n, T, out), Φ = (Φ_out, Φ_in) and W's factors (u (R, out), v (R, in)): the rows Φ diag(u_r) stacked a few ranks
    at a time, examples in blocks, so neither the stacked rows nor the (T·R·(k_out + k_in)) intermediates pass BUDGET_BYTES."""
    (phi_out, phi_in), (left, right) = phi, whitening
    (n, positions, width), (k_out, height), k_in = a.shape, phi_out.shape, len(phi_in)
    out = a.new_zeros(n, k_out, k_in)
    ranks = max(1, BUDGET_BYTES // ((k_out * height + k_in * width) * a.element_size()))
    for r in range(0, len(left), ranks):
        stacked_out = (left[r : r + ranks, :, None] * phi_out.T).transpose(1, 2).reshape(-1, height)
        stacked_in = (right[r : r + ranks, :, None] * phi_in.T).transpose(1, 2).reshape(-1, width)
        rank = len(stacked_out) // k_out
        step = max(1, BUDGET_BYTES // (positions * rank * (k_out + k_in) * a.element_size()))
        for lo in range(0, n, step):
            g_side = (g[lo : lo + step] @ stacked_out.T).reshape(-1, positions * rank, k_out)
            a_side = (a[lo : lo + step] @ stacked_in.T).reshape(-1, positions * rank, k_in)
            out[lo : lo + step] += outer_gradients(g_side, a_side)
    return out.reshape(n, -1)


def cut_sides(cut: LayerCut, side: int) -> tuple[int, int]:
    """A cut's k_out, k_in at `side`: the side, or the matrix's own size where smaller (kept exactly, Φ = I)."""
    return min(side, cut.shape[0]), min(side, cut.shape[1])


def projected_dim(split: GradientSplit, side: int) -> int:
    """Numbers per row of a split projected at `side`: each cut's k_out·k_in, then the rest's columns as they are."""
    rest = 0 if split.rest_columns is None else len(split.rest_columns)
    return sum(k_out * k_in for k_out, k_in in (cut_sides(cut, side) for cut in split.cuts)) + rest


def largest_side(split: GradientSplit, fits: Callable[[int], bool]) -> int | None:
    """The largest side (at most MAX_SIDE, and no larger than the split's largest matrix, past which no cut grows)
    whose row of `projected_dim` numbers `fits`; None when not even side 1 fits. The dimension grows with the side,
    so the side is bisected."""
    lo, hi = 1, min(MAX_SIDE, max((max(cut.shape) for cut in split.cuts), default=1))
    if not fits(projected_dim(split, lo)):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(projected_dim(split, mid)) else (lo, mid - 1)
    return lo


class IndexProjection:
    """Φ_out ⊗ Φ_in of side at most `side` for every cut of a gradient split, seeded by (seed, cut number); the rest
    columns kept. `training` maps a captured batch and `factors` flat query factors to the same `dim` coordinates.

    With `damped` (a curvature diagonal in the captures' basis per cut, K-FAC/EK-FAC's Λ + λ in its eigenbasis) both
    sides are whitened before projecting: G D^(-1/2) for training rows, F D^(1/2) for the factors F = G_q D⁻¹, so the
    projected inner product estimates ⟨G_q D^(-1/2), G_i D^(-1/2)⟩, the same score, from two vectors of like size;
    projecting F and G themselves loses the score when D spans orders of magnitude. The training side takes D^(-1/2)
    through its truncated SVD (`whitening_factors`, within `whitening_rtol`) where that is cheaper."""

    def __init__(
        self, split: GradientSplit, order: RowOrder, side: int, seed: int, damped: dict[str, torch.Tensor] | None = None,
        whitening_rtol: float = WHITENING_RTOL, whitening: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        positions: dict[str, int] | None = None,
    ) -> None:
        self.split, self.order, self.side, self.seed, self.damped = split, order, side, seed, damped or {}
        self.whitening_rtol = whitening_rtol
        self.positions = positions  # each cut's capture positions T, where one float input is captured (None: unknown)
        self._phi: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._whitening = dict(whitening or {})  # factors computed before (kept with an index), by cut name

    @classmethod
    def for_model(cls, im: "InfluenceFunctionModel", x: Any, y: torch.Tensor, side: int, whitening: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> "IndexProjection":
        """The compressed index's projection for a fitted influence model, its gradient split probed on the rows
        (x, y) (a few training rows), seed 0: for K-FAC/EK-FAC whitened by each layer's damped curvature diagonal in
        its eigenbasis (`whitening`: factors kept with an index, else computed on first use, their rank capped by
        the capture positions the split's probe found)."""
        from .methods.kfac import KfacInfluence

        damped = {layer.name: im.solvers[layer.block].damped(im.objective.space.dtype) for layer in im.layers} if isinstance(im, KfacInfluence) else None  # type: ignore[attr-defined]
        split = im.gradient_split(x, y)  # its probe recorded each cut's capture positions, which cap the cut's SVD
        return cls(split, im.row_order, side, seed=0, damped=damped, whitening=whitening, positions=split.positions)

    def sides(self, cut: LayerCut) -> tuple[int, int]:
        """k_out, k_in: `side`, or the matrix's own size when smaller (such a side is kept exactly, Φ = I)."""
        return cut_sides(cut, self.side)

    @property
    def dim(self) -> int:
        return projected_dim(self.split, self.side)

    def resized(self, side: int) -> "IndexProjection":
        """The same projection (split, seed, whitening diagonal) at another side; nothing that depends on the side
        (Φ, the whitening's capped factors) is carried over."""
        return IndexProjection(self.split, self.order, side, self.seed, self.damped, self.whitening_rtol, positions=self.positions)

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
            capture = shares[0] if len(shares) == 1 and shares[0][0].is_floating_point() else None  # one float input
            if cut.name in self.damped:
                parts.append(self._whitened_training(index, cut, batch, capture))
            elif capture is not None:
                a, g = capture
                phi_out, phi_in = self._factors(index, cut, a)
                parts.append(outer_gradients(g @ phi_out.T, a @ phi_in.T).reshape(batch.n, -1))
            else:
                parts.append(self._project(index, cut, cut_gradients(batch, cut)))
        if batch.rest is not None:
            parts.append(batch.rest)
        return torch.cat(parts, dim=1)

    def _whitened_training(self, index: int, cut: LayerCut, batch: Batch, capture: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """(n, k_out·k_in): Φ_out (G ∘ D^(-1/2)) Φ_inᵀ, from the cut's one float capture (a, g) through W's factors
        where that is cheaper, else from the formed gradient matrices."""
        if capture is not None:
            a, g = capture
            left, right = self.whitening(cut)
            if len(left) and factored_is_cheaper(len(left), cut.shape, self.sides(cut), a.shape[1]):
                return factored_projection(a, g, self._factors(index, cut, a), (left.to(a), right.to(a)))
        return self._project(index, cut, cut_gradients(batch, cut) * self.damped[cut.name].to(batch.dtype).rsqrt())

    def whitening(self, cut: LayerCut) -> tuple[torch.Tensor, torch.Tensor]:
        """A damped cut's `whitening_factors`, computed once (or as given): with its positions known, capped at the
        rank where factoring stops being cheaper (none for a cut without one float capture, which is always formed),
        so no SVD is taken that the formed path would not use."""
        if cut.name not in self._whitening:
            cap = None if self.positions is None else (break_even_rank(cut.shape, self.sides(cut), self.positions[cut.name]) if cut.name in self.positions else 0)
            self._whitening[cut.name] = whitening_factors(self.damped[cut.name], self.whitening_rtol, cap)
        return self._whitening[cut.name]

    def factors(self, flat: torch.Tensor) -> torch.Tensor:
        """(m, dim): query factors (m, p) in the split's column layout, projected as the training side is."""
        parts = [self._project(index, cut, self._whitened(cut, cut.matrix(flat, self.order))) for index, cut in enumerate(self.split.cuts)]
        if self.split.rest_columns is not None:
            parts.append(flat[:, self.split.rest_columns.to(flat.device)])
        return torch.cat(parts, dim=1)

    def all_whitening(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every damped cut's `whitening`, by cut name: what an index keeps so its queries need no SVD."""
        return {cut.name: self.whitening(cut) for cut in self.split.cuts if cut.name in self.damped}

    def from_captures(self, im: "InfluenceFunctionModel") -> bool:
        """Whether `im`'s query factors, as projected, are the training rows' own form of the queries' captures:
        gradient dot products (F = G_q, nothing damped), or K-FAC/EK-FAC with every cut whitened and no rest
        columns (F = G_q D⁻¹ projects as F D^(1/2) = G_q D^(-1/2))."""
        from .methods.identity import IdentityInfluence

        if isinstance(im, IdentityInfluence):
            return not self.damped
        return self.split.rest_columns is None and not {cut.name for cut in self.split.cuts} - set(self.damped)

    def queries(self, im: "InfluenceFunctionModel", x: Any, y: torch.Tensor) -> torch.Tensor:
        """(m, dim): the query factors of (x, y) in the index's coordinates: projected from their measurement's
        captures as the training rows are where that is their form (`from_captures`), so no factor as wide as the
        model is formed (nor compressed by method.query_rank: an index is never built with it); otherwise the factors
        are solved, then projected."""
        if not self.from_captures(im):
            return self.factors(im.influence_factors(x, y))
        step = im.batch_size
        return torch.cat([self.training(im.gradient_batch(examples.take(x, slice(lo, lo + step)), y[lo : lo + step], measure=True)) for lo in range(0, examples.count(x), step)])

    def _whitened(self, cut: LayerCut, factors: torch.Tensor) -> torch.Tensor:
        return factors * self.damped[cut.name].to(factors.dtype).sqrt() if cut.name in self.damped else factors

    def _project(self, index: int, cut: LayerCut, matrices: torch.Tensor) -> torch.Tensor:
        phi_out, phi_in = self._factors(index, cut, matrices)
        return (phi_out @ matrices @ phi_in.T).reshape(len(matrices), -1)
