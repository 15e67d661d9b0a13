"""Curvature of the mean training loss as a matrix-free operator (H or Gauss-Newton times vectors), and its explicit
diagonal blocks."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Literal

import torch

from . import examples
from .batches import Batches, count_rows
from .objective import Objective, UntraceableModel
from .solvers import PassProgress
from .task.base import resolve_fisher
from .work import Work

log = logging.getLogger(__name__)
SecondOrderMode = Literal["hessian", "gauss_newton"]
MODE_NAMES = {"hessian": "Hessian", "gauss_newton": "Gauss-Newton"}

# Forward activations one product call may hold (vectors × rows × the model's activation bytes per example). The
# products' elementwise passes over (vectors, rows, width) tensors run at memory speed once those leave the cache.
# Measured on W2 (MLP 100-256-256-10, 500 queries, 4,000 rows), A/B against 64 vectors per call: LiSSA (20 steps of
# 256 rows) 33.0/33.4 s -> 24.2/24.2 s, Gauss-Newton CG 43.1/41.2 s -> 37.9/38.8 s, scores bit-identical.
PRODUCT_ACTIVATION_BYTES = 32 * 2**20
# The identity's products (an explicit matrix) take four times that budget per call: measured on issue 52's CNN (p =
# 3,657, 256 rows, hessian) 127 -> 70 µs of CPU per (vector, row) product, on an MLP 100-256-256-10 35 -> 28 µs
# (hessian) and 43 -> 25 µs (Gauss-Newton); 16 times gained nothing more on the CNN. Not measured for CG and LiSSA.
IDENTITY_BUDGET_SCALE = 4
GRAM_ROWS_BYTES = 64 * 2**20  # Gauss-Newton rows (examples × Fisher columns × p) formed and multiplied at once
GRAM_PANEL = 256  # rows per panel of a Gram matrix: the panels on and above the diagonal only, (k+1)/2k of the flops


class CurvatureOperator:
    """`V ↦ V·C` for the curvature C of the *mean* loss over all training examples.

    Each batch's mean-loss curvature is weighted by its share of the examples (n_b / n), so batches of unequal
    size, or a single batch, give the same operator.
    """

    def __init__(self, objective: Objective, data: Batches | None, mode: SecondOrderMode = "hessian", activation_budget: int = PRODUCT_ACTIVATION_BYTES) -> None:
        if mode not in ("hessian", "gauss_newton"):
            raise ValueError(f"second_order_mode must be 'hessian' or 'gauss_newton', not {mode!r}")
        self.objective, self.data, self.mode = objective, data, mode
        self.activation_budget = activation_budget
        self.dim = objective.space.dim
        self._n: int | None = None
        self._activation_bytes: int | None = None
        self._dense: dict[tuple[int, int], torch.Tensor] = {}  # explicit blocks formed together, each until its own call

    @property
    def batches(self) -> Batches:
        """The training data; methods restored without it cannot take curvature products."""
        if self.data is None:
            raise RuntimeError("this method needs the training data again: pass train= to load_state_dict")
        return self.data

    @property
    def n(self) -> int:
        """Number of training examples (counted once, on first use)."""
        if self._n is None:
            self._n = count_rows(self.batches)
        return self._n

    def vectors_per_call(self, x: torch.Tensor, scale: int = 1) -> int:
        """How many vectors one product call over the rows `x` takes, so its activations fit the budget (times `scale`)."""
        if self._activation_bytes is None:
            self._activation_bytes = max(1, self.objective.activation_bytes(examples.take(x, slice(0, 8))))
        return max(1, scale * self.activation_budget // (examples.count(x) * self._activation_bytes))

    def _products(self, x: torch.Tensor, y: torch.Tensor, vectors: torch.Tensor, scale: int = 1) -> Iterator[tuple[slice, torch.Tensor]]:
        """(rows of `vectors`, their product with this batch's mean-loss curvature), `vectors_per_call` rows at a time."""
        setup = self.objective.hessian_product if self.mode == "hessian" else self.objective.gauss_newton_product
        product = setup(x, y)  # the batch's graph once, then one call per slice of vectors
        step = self.vectors_per_call(x, scale)
        for start in range(0, len(vectors), step):
            rows = slice(start, start + step)
            yield rows, product(vectors[rows])

    def batch_product(self, x: torch.Tensor, y: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
        """Rows of `vectors` times the curvature of one batch's mean loss."""
        out = torch.empty_like(vectors)
        for rows, product in self._products(x, y, vectors):
            out[rows] = product
        return out

    def matmat(self, vectors: torch.Tensor) -> torch.Tensor:
        """Apply the curvature to each row of `vectors` (k, p), in one pass over the data."""
        out = torch.zeros_like(vectors)
        n = self.n
        for x, y in self.batches:
            for rows, product in self._products(x, y, vectors):
                out[rows].add_(product, alpha=len(y) / n)
        return out

    def dense_block(self, block: slice, partition: Sequence[slice]) -> torch.Tensor:
        """The explicit matrix of `block`, float64 and symmetric: its first call forms every block of `partition` in
        one pass over the data (`dense_blocks`) and keeps the others until their own call."""
        key = (block.start, block.stop)
        if key not in self._dense:
            self._dense = {(b.start, b.stop): matrix for b, matrix in zip(partition, self.dense_blocks(partition))}
        return self._dense.pop(key)

    def dense_blocks(self, blocks: Sequence[slice]) -> list[torch.Tensor]:
        """The curvature's diagonal `blocks` as explicit float64 matrices, in one pass over the data, with a progress
        line at least every PROGRESS_SECONDS. Gauss-Newton is the Gram matrix RᵀR/n of the examples' rows J_iᵀ L_ik
        (`Objective.gauss_newton_rows`), one GEMM per chunk of rows, where the task's exact Fisher has K ≤
        EXACT_FISHER_MAX_PASSES columns per example (n·K·p² flops, against p·n Jacobian products otherwise) and the
        model traces under per-example vmap; the Hessian, and Gauss-Newton elsewhere, from products with the
        identity: p vectors per batch, p·n (vector, example) products in all."""
        if self.mode == "gauss_newton" and resolve_fisher("auto", columns := self._fisher_columns()) == "exact":
            try:
                return self._gram_blocks(blocks, columns)
            except UntraceableModel:
                log.info("the model does not trace under per-example vmap: the Gauss-Newton matrix is formed from products with the identity instead")
        return self._product_blocks(blocks)

    def _fisher_columns(self) -> int:
        """Columns K of the task's exact Fisher square root per example (`Task.fisher_passes`), from one example."""
        x, y = next(iter(self.batches))
        x, _ = self.objective.to_model(examples.take(x, slice(0, 1)), y[:1])
        with torch.no_grad():
            return self.objective.task.fisher_passes(self.objective.outputs(self.objective.params, x))

    def _gram_blocks(self, blocks: Sequence[slice], columns: int) -> list[torch.Tensor]:
        """Gauss-Newton blocks from the examples' rows, formed for as many examples at a time as GRAM_ROWS_BYTES holds."""
        n, objective = self.n, self.objective
        space = objective.space
        step = max(1, GRAM_ROWS_BYTES // (columns * space.dim * space.dtype.itemsize))
        totals = [torch.zeros(b.stop - b.start, b.stop - b.start, dtype=space.dtype, device=space.device) for b in blocks]  # summed in the model dtype, as the products were
        progress = PassProgress(f"Gauss-Newton matrix of {space.dim} parameters ({len(blocks)} block(s)) by GEMM", n)
        done = 0
        for x, y in self.batches:
            for lo in range(0, len(y), step):
                rows = objective.gauss_newton_rows(examples.take(x, slice(lo, lo + step)), y[lo : lo + step])
                for total, b in zip(totals, blocks):
                    add_gram(total, rows[:, b], objective.work)
                done += len(y[lo : lo + step])
                progress.step(done)
        return [symmetric_from_upper(total).to(torch.float64) / n for total in totals]

    def _product_blocks(self, blocks: Sequence[slice]) -> list[torch.Tensor]:
        """The blocks from products with each block's unit vectors, batch by batch, symmetrised."""
        n, space = self.n, self.objective.space
        units = [embed(torch.eye(b.stop - b.start, dtype=space.dtype, device=space.device), b, self.dim) for b in blocks]
        totals = [torch.zeros(len(u), len(u), dtype=torch.float64, device=space.device) for u in units]
        progress = PassProgress(f"{MODE_NAMES[self.mode]} matrix of {space.dim} parameters ({len(blocks)} block(s)) by products with the identity", n)
        done, vectors = 0, sum(len(u) for u in units)
        for x, y in self.batches:
            finished = 0  # vectors of this batch multiplied so far
            for total, vectors_b, b in zip(totals, units, blocks):
                for rows, product in self._products(x, y, vectors_b, IDENTITY_BUDGET_SCALE):
                    total[rows].add_(product[:, b], alpha=len(y) / n)
                    progress.step(done + len(y) * (finished + min(rows.stop, len(vectors_b))) / vectors)
                finished += len(vectors_b)
            done += len(y)
        return [(total + total.T) / 2 for total in totals]


def embed(vectors: torch.Tensor, block: slice, dim: int) -> torch.Tensor:
    """Rows of a block's coordinates (k, p_block) as rows of length `dim`, zero outside the block."""
    full = vectors.new_zeros(len(vectors), dim)
    full[:, block] = vectors
    return full


def add_gram(total: torch.Tensor, rows: torch.Tensor, work: Work) -> None:
    """total += rowsᵀ rows on and above the diagonal, one in-place GEMM per panel of GRAM_PANEL rows of `total` (the
    panels below are the transposes of those above); `symmetric_from_upper` completes it. In place: adding a GEMM's
    result into a float64 total cost a fifth of the GEMM's time again (measured at p = 3,657, 2,560 rows)."""
    width = rows.shape[1]
    for lo in range(0, width, GRAM_PANEL):
        hi = min(lo + GRAM_PANEL, width)
        total[lo:hi, lo:].addmm_(rows[:, lo:hi].T, rows[:, lo:])
        work.curvature_flops += 2.0 * len(rows) * (hi - lo) * (width - lo)


def symmetric_from_upper(upper: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix whose upper triangle (diagonal included) is `upper`'s."""
    return torch.triu(upper) + torch.triu(upper, 1).T
