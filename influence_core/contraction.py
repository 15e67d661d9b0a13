"""Scores without per-sample gradients: rows (query factors, sketch vectors) contracted with each layer's captured
inputs and output gradients.

An example's gradient for a Linear or Conv2d layer is G = Σ_t g_t a_tᵀ (layers.py), so a row F of that layer
(out × in) scores it as ⟨F, G⟩ = Σ_t g_tᵀ F a_t, and the (n, p) matrix of per-sample gradients is never formed:
- one position (T = 1) of a large layer: X = F a for every row at once, one GEMM of shape (m·out, in) × (in, n),
  then Σ_out X ⊙ g;
- several positions, or a small layer: G for a few examples at a time, then one GEMM (m, out·in) × (out·in, rows);
- rank-r rows F = L R: (Lᵀg)·(R a) summed over rank and positions, when r·T·(out + in) < out·in.
An `nn.Embedding` (V × d) has the gradient Σ_t e_{id_t} g_tᵀ: each example's gradient is kept as its nonzero rows,
one per distinct token (repeats summed), so a row F scores it as Σ_v F[v]·(Σ_{t: id_t = v} g_t), the rows F[v]
gathered, with work ∝ distinct tokens × d, never V × d; its squared norm is Σ_v ‖Σ_{t: id_t = v} g_t‖².
Parameters outside such layers (position embeddings of arange(T), tied weights, norms, custom modules) keep vmap
per-sample gradients.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from . import examples
from .layers import Capture, TrackedLayer, capture, contractible, outer_gradients, per_example_layers, shared_parameters
from .objective import Objective
from .work import Work

BUDGET_BYTES = 128 * 2**20  # largest intermediate a contraction forms at once
SMALL_LAYER_BYTES = 16 * 2**20  # a batch's gradients of a layer up to this size are formed and met by one long-K GEMM:
# 2-4x faster than input-first's short-K products on small layers (W1's 64-32-10), about even at this size
CACHE_BYTES = 4 * 2**20  # an intermediate reduced right after its GEMM: kept in cache, ~20% faster than a large one
RowOrder = Literal["parameters", "matrix"]  # how a layer's columns are laid out in a flat row


@dataclass(frozen=True)
class LayerCut:
    """A tracked layer and its columns in the flat parameter (or feature) vector."""

    layer: TrackedLayer
    cols: slice

    def matrix(self, flat: torch.Tensor, order: RowOrder) -> torch.Tensor:
        """Rows (m, cols) of this layer as (m, out, in) matrices."""
        block = flat[:, self.cols]
        return self.layer.to_matrix(block) if order == "parameters" else block.reshape(len(flat), self.layer.out_dim, self.layer.in_dim)


class GradientSplit:
    """An objective's parameters split into whole Linear/Conv2d/Conv1D/Embedding layers, contracted from captures,
    and the rest, which keeps vmap per-sample gradients. A layer called more than once per forward pass (shared
    layers), on an input without the batch dimension (a position embedding of arange(T)), or whose weight another
    module also uses (tied input/output embeddings) stays in the rest, since its capture cannot hold its gradient."""

    def __init__(self, objective: Objective, probe: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.objective = objective
        blocks = objective.space.blocks()
        shared = shared_parameters(objective.model)
        candidates = []
        for name, module in objective.model.named_modules():
            layer = TrackedLayer(name, module)
            if (contractible(module) and all(p in blocks for p in layer.param_names) and _contiguous([blocks[p] for p in layer.param_names])
                    and not any(id(p) in shared for p in module.parameters(recurse=False))):
                candidates.append(layer)
        captured = per_example_layers(objective.model, candidates, objective.to_model(*probe)[0])
        self.cuts = [LayerCut(layer, slice(blocks[layer.param_names[0]].start, blocks[layer.param_names[-1]].stop)) for layer in candidates if layer.name in captured]
        covered = {p for cut in self.cuts for p in cut.layer.param_names}
        rest = [n for n in objective.space.names if n not in covered]
        self.rest_columns = torch.cat([torch.arange(blocks[n].start, blocks[n].stop) for n in rest]) if rest else None
        self.rest = Objective(objective.model, objective.task, rest) if rest else None

    @property
    def layers(self) -> list[TrackedLayer]:
        return [cut.layer for cut in self.cuts]

    def block_norms(self, batch: "Batch", blocks: list[slice], work: Work) -> torch.Tensor:
        """Squared gradient norms per block of columns and example (blocks, n), from the captures and the rest."""
        norms = torch.zeros(len(blocks), batch.n, dtype=batch.dtype, device=batch.device)
        for cut in self.cuts:
            index = next(i for i, b in enumerate(blocks) if b.start <= cut.cols.start and cut.cols.stop <= b.stop)
            norms[index] += layer_squared_norms(batch.a(cut.layer.name), batch.g(cut.layer.name), work)
        if batch.rest is not None:
            assert self.rest_columns is not None
            for index, b in enumerate(blocks):
                inside = (self.rest_columns >= b.start) & (self.rest_columns < b.stop)
                norms[index] += (batch.rest[:, inside.to(batch.rest.device)] ** 2).sum(1)
        return norms


def _contiguous(slices: list[slice]) -> bool:
    return all(a.stop == b.start for a, b in zip(slices, slices[1:]))


@dataclass
class LayerRows:
    """One layer's rows: dense (m, out, in), or rank-r factors left (m, out, r) and right (m, r, in)."""

    dense: torch.Tensor | None = None
    left: torch.Tensor | None = None
    right: torch.Tensor | None = None

    @property
    def rank(self) -> int | None:
        return None if self.left is None else self.left.shape[2]

    @property
    def count(self) -> int:
        """The number of rows m."""
        return len(self.dense if self.dense is not None else self.left)


@dataclass
class Rows:
    """Rows to contract with training gradients: per tracked layer, plus the columns of the remaining parameters."""

    layers: dict[str, LayerRows]
    rest: torch.Tensor | None
    count: int

    @staticmethod
    def from_flat(flat: torch.Tensor, split: GradientSplit, order: RowOrder = "parameters") -> "Rows":
        """Each layer's rows as one contiguous (m, out, in) tensor: its GEMMs then read them as a matrix, where a
        view into the flat rows would be copied again for every batch."""
        layers = {cut.layer.name: LayerRows(dense=cut.matrix(flat, order).contiguous()) for cut in split.cuts}
        rest = None if split.rest_columns is None else flat[:, split.rest_columns.to(flat.device)]
        return Rows(layers, rest, len(flat))


def _parts(rows: LayerRows) -> dict[str, torch.Tensor]:
    return {name: t for name in ("dense", "left", "right") if (t := getattr(rows, name)) is not None}


def stream_rows(blocks: Iterable[tuple[int, torch.Tensor]], count: int, split: GradientSplit, order: RowOrder, rank: int | None) -> Rows:
    """`factor_rows` of `count` stored rows that arrive as (first row, flat block) pairs: each block is copied into
    per-layer tensors allocated once, so the flat (count, p) matrix is never held beside them (half the memory)."""
    out: Rows | None = None
    for lo, flat in blocks:
        part = factor_rows(flat, split, order, rank)
        if out is None:
            layers = {name: LayerRows(**{k: t.new_empty(count, *t.shape[1:]) for k, t in _parts(rows).items()}) for name, rows in part.layers.items()}
            rest = None if part.rest is None else part.rest.new_empty(count, part.rest.shape[1])
            out = Rows(layers, rest, count)
        for name, rows in part.layers.items():
            for k, t in _parts(rows).items():
                getattr(out.layers[name], k)[lo : lo + len(flat)] = t
        if out.rest is not None:
            assert part.rest is not None
            out.rest[lo : lo + len(flat)] = part.rest
    assert out is not None, "no factor rows to read"
    return out


def dense_rows(rows: LayerRows) -> torch.Tensor:
    return rows.dense if rows.dense is not None else rows.left @ rows.right


@dataclass
class Batch:
    """One batch of training examples as the contractions see it: captures of the tracked layers (possibly in a
    rotated basis) and vmap gradients of the remaining parameters."""

    capture: Capture
    rest: torch.Tensor | None
    n: int
    dtype: torch.dtype
    device: torch.device

    def a(self, layer: str) -> torch.Tensor:
        return self.capture.a[layer]

    def g(self, layer: str) -> torch.Tensor:
        return self.capture.g[layer][0]


def gradient_batch(split: GradientSplit, x: torch.Tensor, y: torch.Tensor, work: Work, measure: bool = False) -> Batch:
    """Capture the tracked layers and take vmap gradients of the rest, of the training loss (of the task's query
    measurement with `measure`); counted as one gradient per example."""
    objective = split.objective
    x, y = objective.to_model(x, y)
    work.gradient_rows += examples.count(x)
    cap = capture(objective.model, split.layers, objective.task, x, y, "measurement" if measure else "labels") if split.cuts else Capture({}, {})
    rest = None if split.rest is None else split.rest.per_sample_grads(x, y, measure)
    return Batch(cap, rest, examples.count(x), objective.space.dtype, objective.space.device)


def contract(rows: Rows, batch: Batch, work: Work) -> torch.Tensor:
    """Scores (rows, n): every row against every example's gradient, summed over layers."""
    out = None
    for name, layer_rows in rows.layers.items():
        part = contract_layer(layer_rows, batch.a(name), batch.g(name), work)
        out = part if out is None else out.add_(part)
    if rows.rest is not None:
        assert batch.rest is not None
        part = rows.rest @ batch.rest.T
        work.score_flops += 2.0 * rows.rest.numel() * batch.n
        out = part if out is None else out.add_(part)
    assert out is not None, "no parameters to score"
    return out


def contract_layer(rows: LayerRows, a: torch.Tensor, g: torch.Tensor, work: Work) -> torch.Tensor:
    """⟨F_j, Σ_t g_t a_tᵀ⟩ for rows F_j of one layer and examples with inputs a (n, T, in), gradients g (n, T, out);
    for an embedding, a holds the ids (n, T) and the rows are (m, V, d)."""
    if not a.is_floating_point():
        return _embedding_scores(rows, a, g, work)
    n, positions, width = a.shape
    height = g.shape[2]
    if rows.rank is not None:
        low = rows.rank * positions * (height + width)
        if low < height * width:
            return _low_rank(rows.left, rows.right, a, g, work)
    dense = dense_rows(rows)
    if positions == 1 and n * height * width * dense.element_size() > SMALL_LAYER_BYTES:
        return _input_first(dense, a[:, 0], g[:, 0], work)
    return _materialised(dense, a, g, work)


def _input_first(dense: torch.Tensor, a: torch.Tensor, g: torch.Tensor, work: Work) -> torch.Tensor:
    """One position: X = F a as one GEMM of shape (m·out, in) × (in, n), then Σ_out X ⊙ g; rows in blocks small
    enough that X is reduced while still in cache."""
    m, height, width = dense.shape
    n = len(a)
    out = dense.new_empty(m, n)
    step = min(m, max(1, CACHE_BYTES // (height * n * dense.element_size())))
    g_t, a_t = g.T.contiguous(), a.T
    buffer = dense.new_empty(step * height, n)  # one buffer for every block: no allocation (nor page faults) per block
    for lo in range(0, m, step):
        block = dense[lo : lo + step]
        x = torch.mm(block.reshape(-1, width), a_t, out=buffer[: len(block) * height]).view(len(block), height, n)
        torch.sum(x.mul_(g_t), dim=1, out=out[lo : lo + step])
    work.score_flops += 2.0 * m * height * n * (width + 1)
    return out


def _materialised(dense: torch.Tensor, a: torch.Tensor, g: torch.Tensor, work: Work) -> torch.Tensor:
    """Several positions: each example's G = Σ_t g_t a_tᵀ for a few examples at a time, then one GEMM."""
    m, height, width = dense.shape
    n, positions, _ = a.shape
    flat = dense.reshape(m, -1)
    out = dense.new_empty(m, n)
    step = max(1, BUDGET_BYTES // (height * width * dense.element_size()))
    for lo in range(0, n, step):
        grads = torch.einsum("bto,bti->boi", g[lo : lo + step], a[lo : lo + step]).reshape(-1, height * width)
        out[:, lo : lo + step] = flat @ grads.T
    work.score_flops += 2.0 * n * height * width * (positions + m)
    return out


def _low_rank(left: torch.Tensor, right: torch.Tensor, a: torch.Tensor, g: torch.Tensor, work: Work) -> torch.Tensor:
    """Rank-r rows F = L R: score = Σ_{r,t} (L_rᵀ g_t)(R_r a_t), with (m·r, n·T) intermediates in blocks of examples."""
    m, height, rank = left.shape
    n, positions, width = a.shape
    lt = left.transpose(1, 2).reshape(m * rank, height)
    r = right.reshape(m * rank, width)
    out = left.new_empty(m, n)
    step = max(1, BUDGET_BYTES // (2 * m * rank * positions * left.element_size()))
    for lo in range(0, n, step):
        gs, as_ = g[lo : lo + step].reshape(-1, height), a[lo : lo + step].reshape(-1, width)
        both = (lt @ gs.T) * (r @ as_.T)  # (m·r, rows·T)
        out[:, lo : lo + step] = both.view(m, rank, -1, positions).sum(dim=(1, 3))
    work.score_flops += 2.0 * m * rank * n * positions * (height + width + 1)
    return out


def _embedding_scores(rows: LayerRows, ids: torch.Tensor, g: torch.Tensor, work: Work) -> torch.Tensor:
    """Rows F (m, V, d), dense or rank-r, against an embedding's per-example gradients: F[v]·(Σ_{t: id_t = v} g_t)
    for each distinct (example, v), the rows F[v] gathered (L[v] R for rank-r rows) and reduced in blocks of pairs,
    then summed per example; nothing of size V·d is formed (a sparse-dense product transposed the (m, V·d) rows
    every batch: 1 s at V 50,000 against 44 ms)."""
    example, token, values = token_rows(ids, g)
    m, width = rows.count, g.shape[2]
    step = max(1, BUDGET_BYTES // (m * width * g.element_size()))
    parts = []
    for lo in range(0, len(token), step):
        block = token[lo : lo + step]
        gathered = rows.dense.index_select(1, block) if rows.dense is not None else rows.left.index_select(1, block) @ rows.right
        parts.append(torch.einsum("mkd,kd->km", gathered, values[lo : lo + step]))
    work.score_flops += 2.0 * m * values.numel() * (1 if rows.rank is None else rows.rank + 1)  # the gather L[v] R, then the product
    return _per_example(torch.cat(parts), example, len(ids)).T


def token_rows(ids: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An embedding's per-example gradients as their nonzero rows: (example, token id, Σ_{t: id_t = id} g_t) for
    each distinct (example, id) pair, sorted by example then id; a token repeated in an example is one row. A stable
    sort and a segment sum: index_add_ is 5-10x slower on CPU here."""
    n, positions, width = g.shape
    key = (torch.arange(n, device=ids.device)[:, None] << 32) + ids  # (example, id) as one sortable int64
    key, order = torch.sort(key.reshape(-1), stable=True)
    pairs, counts = torch.unique_consecutive(key, return_counts=True)
    values = torch.segment_reduce(g.reshape(-1, width)[order], "sum", lengths=counts)
    return pairs >> 32, pairs & 0xFFFFFFFF, values


def _per_example(rows: torch.Tensor, example: torch.Tensor, n: int) -> torch.Tensor:
    """Rows (K, ...) of `token_rows`' pairs, sorted by example, summed per example: (n, ...)."""
    return torch.segment_reduce(rows, "sum", lengths=torch.bincount(example, minlength=n), axis=0)


def embedding_gradients(ids: torch.Tensor, g: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per-example gradients Σ_t e_{id_t} g_tᵀ of an embedding with `vocab` rows, formed (n, vocab·d) in the weight's
    own row-major layout, for the methods that need gradients as features."""
    n, _, width = g.shape
    example, token, values = token_rows(ids, g)
    grads = g.new_zeros(n, vocab, width)
    grads[example, token] = values  # each (example, id) once
    return grads.reshape(n, -1)


def layer_squared_norms(a: torch.Tensor, g: torch.Tensor, work: Work) -> torch.Tensor:
    """‖Σ_t g_t a_tᵀ‖² per example: a product of norms for one position, Gram matrices over positions when
    that is cheaper than forming the gradient; for an embedding (a = ids), Σ over its distinct tokens v of
    ‖Σ_{t: id_t = v} g_t‖² (repeated tokens add before squaring)."""
    if not a.is_floating_point():
        example, _, values = token_rows(a, g)
        work.score_flops += 2.0 * values.numel()
        return _per_example((values**2).sum(1), example, len(a))
    n, positions, width = a.shape
    height = g.shape[2]
    if positions == 1:
        work.score_flops += 2.0 * n * (height + width)
        return (g[:, 0] ** 2).sum(1) * (a[:, 0] ** 2).sum(1)
    if positions * (height + width) < height * width:
        work.score_flops += 2.0 * n * positions * positions * (height + width)
        return (torch.einsum("bto,bso->bts", g, g) * torch.einsum("bti,bsi->bts", a, a)).sum(dim=(1, 2))
    work.score_flops += 2.0 * n * positions * height * width
    return (torch.einsum("bto,bti->boi", g, a) ** 2).sum(dim=(1, 2))


def materialise(batch: Batch, split: GradientSplit, order: RowOrder, dim: int) -> torch.Tensor:
    """The per-example gradients (n, p) in the split's column layout, from the captures and the rest."""
    out = torch.zeros(batch.n, dim, dtype=batch.dtype, device=batch.device)
    for cut in split.cuts:
        a, g = batch.a(cut.layer.name), batch.g(cut.layer.name)
        if cut.layer.embedding:  # its (V, d) weight's layout is its matrix's, in either order
            out[:, cut.cols] = embedding_gradients(a, g, cut.layer.out_dim)
        else:
            grads = outer_gradients(g, a)
            out[:, cut.cols] = cut.layer.to_flat(grads) if order == "parameters" else grads.reshape(batch.n, -1)
    if batch.rest is not None:
        assert split.rest_columns is not None
        out[:, split.rest_columns.to(out.device)] = batch.rest
    return out


def weighted_squares(weights: dict[str, torch.Tensor], batch: Batch, work: Work) -> torch.Tensor:
    """Σ_layers Σ_{o,i} w[o, i] G[o, i]² per example, G from the captures: a diagonal quadratic form, e.g. EK-FAC's
    (Λ + λ)⁻¹ in its eigenbasis; one GEMM (g²) W (a²) per layer when there is one position."""
    total = torch.zeros(batch.n, dtype=batch.dtype, device=batch.device)
    for name, w in weights.items():
        a, g = batch.a(name), batch.g(name)
        n, positions, width = a.shape
        height = g.shape[2]
        w = w.to(a.dtype)
        if positions == 1:
            total += ((g[:, 0] ** 2 @ w) * a[:, 0] ** 2).sum(1)
        else:
            step = max(1, BUDGET_BYTES // (height * width * a.element_size()))
            for lo in range(0, n, step):
                grads = torch.einsum("bto,bti->boi", g[lo : lo + step], a[lo : lo + step])
                total[lo : lo + step] += (grads**2 * w).sum(dim=(1, 2))
        work.score_flops += 2.0 * n * height * width * (positions if positions > 1 else 1)
    return total


def low_rank_rows(dense: torch.Tensor, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-r factors (m, out, r), (m, r, in) of dense rows (m, out, in) by a randomised SVD (Halko et al.), in
    float64: the best rank-r approximation up to the sketch's error, as Kronfluence's `query_gradient_low_rank`."""
    m, height, width = dense.shape
    generator = torch.Generator(device="cpu").manual_seed(seed)
    work64 = dense.to(torch.float64)
    oversampled = min(rank + 10, min(height, width))
    probe = torch.randn(width, oversampled, generator=generator, dtype=torch.float64).to(dense.device)
    basis, _ = torch.linalg.qr(work64 @ probe)
    for _ in range(2):  # power iterations sharpen the spectrum
        basis, _ = torch.linalg.qr(work64.transpose(1, 2) @ basis)
        basis, _ = torch.linalg.qr(work64 @ basis)
    u, s, vh = torch.linalg.svd(basis.transpose(1, 2) @ work64, full_matrices=False)
    left = (basis @ u[:, :, :rank]) * s[:, None, :rank]
    return left.to(dense.dtype), vh[:, :rank].to(dense.dtype)


def compress_rows(flat: torch.Tensor, split: GradientSplit, order: RowOrder, rank: int) -> torch.Tensor:
    """Rows (m, p) as per-layer rank-r factors, flattened: for each layer left (out·r) then right (r·in), or the
    dense (out·in) matrix when r ≥ min(out, in); then the remaining parameters' columns as they are."""
    parts = []
    for cut in split.cuts:
        dense = cut.matrix(flat, order)
        if rank < min(dense.shape[1:]):
            left, right = low_rank_rows(dense, rank)
            parts += [left.reshape(len(flat), -1), right.reshape(len(flat), -1)]
        else:
            parts.append(dense.reshape(len(flat), -1))
    if split.rest_columns is not None:
        parts.append(flat[:, split.rest_columns.to(flat.device)])
    return torch.cat(parts, dim=1)


def factor_rows(flat: torch.Tensor, split: GradientSplit, order: RowOrder, rank: int | None) -> Rows:
    """Rows from stored factors: full rows in the method's column order, or the layout of `compress_rows`."""
    if rank is None:
        return Rows.from_flat(flat, split, order)
    m, layers, col = len(flat), {}, 0
    for cut in split.cuts:
        height, width = cut.layer.out_dim, cut.layer.in_dim
        if rank < min(height, width):
            left = flat[:, col : col + height * rank].reshape(m, height, rank).contiguous()
            col += height * rank
            right = flat[:, col : col + rank * width].reshape(m, rank, width).contiguous()
            col += rank * width
            layers[cut.layer.name] = LayerRows(left=left, right=right)
        else:
            layers[cut.layer.name] = LayerRows(dense=flat[:, col : col + height * width].reshape(m, height, width).contiguous())
            col += height * width
    rest = flat[:, col:].contiguous() if split.rest_columns is not None else None
    return Rows(layers, rest, m)
