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
A weight W (V × d) tied between an `nn.Embedding` and an output `nn.Linear` (GPT-2's lm_head.weight is wte.weight)
is one cut with two shares: G = G_emb + G_out, G_out = Σ_s δ_s h_sᵀ from the Linear's capture (its first d inputs;
its bias is a cut of its own). Scores are linear in G, so both contractions above apply and add; the squared norm
adds the cross term 2⟨G_emb, G_out⟩ = 2 Σ_v (Σ_{t: id_t = v} g_t)·(Σ_s δ_s[v] h_s), the δ columns gathered at each
example's distinct tokens (work ∝ distinct tokens × T × d, never V × d). Every reader of captures here (scores,
materialised gradients, squared norms, rank-r rows, sketches, a basis's features) goes through a cut's shares;
K-FAC/EK-FAC and projections take their layers from `select_layers`, which leaves tied weights out.
Parameters outside such layers (position embeddings of arange(T), norms, custom modules, a weight shared in any
other way) keep vmap per-sample gradients. So does a cut whose captures, summed over the split's probe examples,
miss part of autograd's gradient (a weight tensor code also uses, as F.linear(h, emb.weight)): checked once per split.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from . import examples
from .errors import ConfigError
from .layers import Capture, TrackedLayer, capture, contractible, listed_names, outer_gradients, per_example_layers, shared_parameters, tied_embeddings
from .objective import Objective
from .work import Work

BUDGET_BYTES = 128 * 2**20  # largest intermediate a contraction forms at once
SMALL_LAYER_BYTES = 16 * 2**20  # a batch's gradients of a layer up to this size are formed and met by one long-K GEMM:
# 2-4x faster than input-first's short-K products on small layers (W1's 64-32-10), about even at this size
CACHE_BYTES = 4 * 2**20  # an intermediate reduced right after its GEMM: kept in cache, ~20% faster than a large one
RowOrder = Literal["parameters", "matrix"]  # how a layer's columns are laid out in a flat row


@dataclass(frozen=True)
class Share:
    """A captured layer's part Σ_t g_t a_tᵀ in a cut's gradient, its inputs a narrowed to the columns `inputs`."""

    layer: TrackedLayer
    inputs: slice | None = None  # None: all of them

    def read(self, batch: "Batch") -> tuple[torch.Tensor, torch.Tensor]:
        """This share's (a, g) in a captured batch."""
        a = batch.a(self.layer.name)
        return (a if self.inputs is None else a[..., self.inputs]), batch.g(self.layer.name)


@dataclass(frozen=True)
class LayerCut:
    """Columns in the flat parameter (or feature) vector holding a gradient matrix (out, in) that is the sum of its
    captured shares: a whole tracked layer (its own capture); or, of a weight tied between an embedding and an output
    Linear, the weight (the embedding's share, then the Linear's on its first d inputs) and that Linear's bias."""

    name: str
    cols: slice
    shape: tuple[int, int]
    shares: tuple[Share, ...]
    layer: TrackedLayer | None = None  # a whole layer, which lays out its columns; None: row-major (out, in)

    @staticmethod
    def whole(layer: TrackedLayer, cols: slice) -> "LayerCut":
        """A whole tracked layer, its gradient its own capture's."""
        return LayerCut(layer.name, cols, (layer.out_dim, layer.in_dim), (Share(layer),), layer)

    def matrix(self, flat: torch.Tensor, order: RowOrder) -> torch.Tensor:
        """Rows (m, cols) of this cut as (m, out, in) matrices."""
        block = flat[:, self.cols]
        return self.layer.to_matrix(block) if order == "parameters" and self.layer is not None else block.reshape(len(flat), *self.shape)

    def to_flat(self, matrices: torch.Tensor, order: RowOrder) -> torch.Tensor:
        """Inverse of `matrix`."""
        return self.layer.to_flat(matrices) if order == "parameters" and self.layer is not None else matrices.reshape(len(matrices), -1)


def tied_cuts(embedding: TrackedLayer, output: TrackedLayer, blocks: dict[str, slice], names: dict[int, str], shared: set[int]) -> list[LayerCut]:
    """A weight (V × d) tied between an embedding and an output Linear as cuts, where attributed: the weight, whose
    gradient is the embedding's share plus the Linear's on its first d inputs, and the Linear's bias (its share on the
    last input, the captures' 1), itself no shared tensor."""
    vocab, width = embedding.module.weight.shape
    weight, bias = names[id(embedding.module.weight)], output.module.bias
    cuts = []
    if weight in blocks:
        cuts.append(LayerCut(embedding.name, blocks[weight], (vocab, width), (Share(embedding), Share(output, slice(0, width)))))
    if bias is not None and id(bias) not in shared and names.get(id(bias)) in blocks:
        cuts.append(LayerCut(output.name, blocks[names[id(bias)]], (vocab, 1), (Share(output, slice(width, width + 1)),)))
    return cuts


class GradientSplit:
    """An objective's parameters split into cuts contracted from captures, whole Linear/Conv2d/Conv1D/Embedding
    layers and the weights tied between an embedding and an output Linear (and that Linear's bias), and the rest,
    which keeps vmap per-sample gradients. A layer called more than once per forward pass (shared layers), on an input
    without the batch dimension (a position embedding of arange(T)), or whose weight other modules also use (other
    than one embedding and one Linear) stays in the rest, since its captures cannot hold its gradient."""

    def __init__(self, objective: Objective, probe: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.objective = objective
        model, blocks = objective.model, objective.space.blocks()
        shared = shared_parameters(model)
        candidates = []
        for name, module in model.named_modules():
            layer = TrackedLayer(name, module)
            if (contractible(module) and all(p in blocks for p in layer.param_names) and _contiguous([blocks[p] for p in layer.param_names])
                    and not any(id(p) in shared for p in module.parameters(recurse=False))):
                candidates.append(layer)
        ties = [pair for pair in tied_embeddings(model) if contractible(pair[0].module)]
        captured = per_example_layers(model, candidates + [layer for pair in ties for layer in pair], objective.to_model(*probe)[0])
        self.cuts = [LayerCut.whole(layer, slice(blocks[layer.param_names[0]].start, blocks[layer.param_names[-1]].stop)) for layer in candidates if layer.name in captured]
        names = listed_names(model)
        self.cuts += [cut for embedding, output in ties if {embedding.name, output.name} <= captured for cut in tied_cuts(embedding, output, blocks, names, shared)]
        incomplete, positions = self._probe(probe) if self.cuts else (set(), {})
        self.cuts = [cut for cut in self.cuts if cut.name not in incomplete]
        self.positions: dict[str, int] = {name: t for name, t in positions.items() if name not in incomplete}  # each kept cut's capture positions T, where it has one float capture
        rest = [n for n, b in blocks.items() if not any(cut.cols.start <= b.start and b.stop <= cut.cols.stop for cut in self.cuts)]
        self.rest_columns = torch.cat([torch.arange(blocks[n].start, blocks[n].stop) for n in rest]) if rest else None
        self.rest = Objective(objective.model, objective.task, rest) if rest else None

    def _probe(self, probe: tuple[torch.Tensor, torch.Tensor], rtol: float = 1e-3) -> tuple[set[str], dict[str, int]]:
        """From one captured pass over the probe's rows: the cuts whose captured gradient, summed over the examples, is
        not autograd's (a weight that tensor code also uses outside its module, F.linear(h, emb.weight), has gradient
        its captures miss; those keep vmap), and the capture positions T of each cut with one float capture."""
        objective = self.objective
        x, y = objective.to_model(*probe)
        expected = objective.summed_gradient(x, y)
        batch, incomplete = captured_batch(self, x, y), set()
        positions = {cut.name: shares[0][0].shape[1] for cut in self.cuts if len(shares := batch.shares(cut.name)) == 1 and shares[0][0].is_floating_point()}
        for cut in self.cuts:
            found, want = cut.to_flat(summed_cut_gradient(batch, cut), "parameters")[0], expected[cut.cols]
            if (want - found).norm() > rtol * want.norm():
                incomplete.add(cut.name)
        return incomplete, positions

    @property
    def layers(self) -> list[TrackedLayer]:
        """The layers to capture: those of every cut's shares, each once."""
        return list({share.layer.name: share.layer for cut in self.cuts for share in cut.shares}.values())

    def block_norms(self, batch: "Batch", blocks: list[slice], work: Work) -> torch.Tensor:
        """Squared gradient norms per block of columns and example (blocks, n), from the captures and the rest."""
        norms = torch.zeros(len(blocks), batch.n, dtype=batch.dtype, device=batch.device)
        for cut in self.cuts:
            index = next(i for i, b in enumerate(blocks) if b.start <= cut.cols.start and cut.cols.stop <= b.stop)
            norms[index] += cut_squared_norms(batch.shares(cut.name), work)
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

    def take(self, index: slice | torch.Tensor) -> "Rows":
        """Some of the rows (a slice: views; indices: copies), per layer and of the rest."""
        layers = {name: LayerRows(**{k: t[index] for k, t in _parts(rows).items()}) for name, rows in self.layers.items()}
        rest = None if self.rest is None else self.rest[index]
        count = len(range(*index.indices(self.count))) if isinstance(index, slice) else len(index)
        return Rows(layers, rest, count)

    @staticmethod
    def from_flat(flat: torch.Tensor, split: GradientSplit, order: RowOrder = "parameters") -> "Rows":
        """Each layer's rows as one contiguous (m, out, in) tensor: its GEMMs then read them as a matrix, where a
        view into the flat rows would be copied again for every batch."""
        layers = {cut.name: LayerRows(dense=cut.matrix(flat, order).contiguous()) for cut in split.cuts}
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
    tied: dict[str, tuple[Share, ...]] = field(default_factory=dict)  # the shares of tied weights' cuts, by cut name

    def a(self, layer: str) -> torch.Tensor:
        return self.capture.a[layer]

    def g(self, layer: str) -> torch.Tensor:
        return self.capture.g[layer][0]

    def shares(self, cut: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(a, g) of each share in a cut's gradient: its layer's own capture, or a tied weight's shares."""
        return [share.read(self) for share in self.tied[cut]] if cut in self.tied else [(self.a(cut), self.g(cut))]

    def take(self, index: torch.Tensor) -> "Batch":
        """The examples `index` of this batch (repeats allowed), captures and rest, in the same basis."""
        capture = Capture({name: a[index] for name, a in self.capture.a.items()}, {name: [g[index] for g in gs] for name, gs in self.capture.g.items()})
        return Batch(capture, None if self.rest is None else self.rest[index], len(index), self.dtype, self.device, self.tied)


def gradient_batch(split: GradientSplit, x: torch.Tensor, y: torch.Tensor, work: Work, measure: bool = False) -> Batch:
    """Capture the tracked layers and take vmap gradients of the rest, of the training loss (of the task's query
    measurement with `measure`); counted as one gradient per example."""
    x, y = split.objective.to_model(x, y)
    work.gradient_rows += examples.count(x)
    batch = captured_batch(split, x, y, measure)
    batch.rest = None if split.rest is None else split.rest.per_sample_grads(x, y, measure)
    return batch


def captured_batch(split: GradientSplit, x: examples.Inputs, y: torch.Tensor, measure: bool = False) -> Batch:
    """The captures of the split's layers for a batch already on the model's device and dtype (no rest yet)."""
    objective = split.objective
    cap = capture(objective.model, split.layers, objective.task, x, y, "measurement" if measure else "labels") if split.cuts else Capture({}, {})
    tied = {cut.name: cut.shares for cut in split.cuts if cut.layer is None}
    return Batch(cap, None, examples.count(x), objective.space.dtype, objective.space.device, tied)


def contract(rows: Rows, batch: Batch, work: Work, per_token: bool = False) -> torch.Tensor:
    """Scores (rows, n): every row against every example's gradient, summed over layers (and a tied weight's shares);
    with `per_token`, (rows, n, T): each position t's share g_tᵀ F a_t, the contraction before its sum over t (the
    rest's vmap gradients have no positions: the caller refuses them)."""
    out = None
    for name, layer_rows in rows.layers.items():
        for a, g in batch.shares(name):
            part = contract_layer(layer_rows, a, g, work, per_token)
            if out is not None and part.shape != out.shape:
                raise ConfigError("per_token", f"layer {name} runs at {part.shape[-1]} positions, the layers before it at {out.shape[-1]}", "track only layers applied at every token position (method.modules)")
            out = part if out is None else out.add_(part)
    if rows.rest is not None:
        assert batch.rest is not None and not per_token
        part = rows.rest @ batch.rest.T
        work.score_flops += 2.0 * rows.rest.numel() * batch.n
        out = part if out is None else out.add_(part)
    assert out is not None, "no parameters to score"
    return out


def contract_layer(rows: LayerRows, a: torch.Tensor, g: torch.Tensor, work: Work, per_token: bool = False) -> torch.Tensor:
    """⟨F_j, Σ_t g_t a_tᵀ⟩ for rows F_j of one layer and examples with inputs a (n, T, in), gradients g (n, T, out);
    for an embedding, a holds the ids (n, T) and the rows are (m, V, d). `per_token`: (m, n, T), before the sum."""
    if not a.is_floating_point():
        return _embedding_scores(rows, a, g, work, per_token)
    n, positions, width = a.shape
    height = g.shape[2]
    if rows.rank is not None:
        low = rows.rank * positions * (height + width)
        if per_token or low < height * width:
            return _low_rank(rows.left, rows.right, a, g, work, per_token)
    dense = dense_rows(rows)
    if per_token:
        return _per_position(dense, a, g, work)
    if positions == 1 and n * height * width * dense.element_size() > SMALL_LAYER_BYTES:
        return _input_first(dense, a[:, 0], g[:, 0], work)
    return _materialised(dense, a, g, work)


def _per_position(dense: torch.Tensor, a: torch.Tensor, g: torch.Tensor, work: Work) -> torch.Tensor:
    """Each position kept: X = F a_t as one GEMM (m·out, in) × (in, n·T) for a few examples at a time, then
    Σ_out X ⊙ g_t, (m, n, T)."""
    m, height, width = dense.shape
    n, positions, _ = a.shape
    out = dense.new_empty(m, n, positions)
    step = max(1, BUDGET_BYTES // (m * height * positions * dense.element_size()))
    flat = dense.reshape(m * height, width)
    for lo in range(0, n, step):
        a_block, g_block = a[lo : lo + step], g[lo : lo + step]
        x = (flat @ a_block.reshape(-1, width).T).view(m, height, len(a_block), positions)
        out[:, lo : lo + step] = (x * g_block.permute(2, 0, 1)).sum(1)
    work.score_flops += 2.0 * m * n * positions * height * (width + 1)
    return out


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


def _low_rank(left: torch.Tensor, right: torch.Tensor, a: torch.Tensor, g: torch.Tensor, work: Work, per_token: bool = False) -> torch.Tensor:
    """Rank-r rows F = L R: score = Σ_{r,t} (L_rᵀ g_t)(R_r a_t), with (m·r, n·T) intermediates in blocks of examples;
    `per_token`: summed over r only, (m, n, T)."""
    m, height, rank = left.shape
    n, positions, width = a.shape
    lt = left.transpose(1, 2).reshape(m * rank, height)
    r = right.reshape(m * rank, width)
    out = left.new_empty(m, n, positions) if per_token else left.new_empty(m, n)
    step = max(1, BUDGET_BYTES // (2 * m * rank * positions * left.element_size()))
    for lo in range(0, n, step):
        gs, as_ = g[lo : lo + step].reshape(-1, height), a[lo : lo + step].reshape(-1, width)
        both = ((lt @ gs.T) * (r @ as_.T)).view(m, rank, -1, positions)
        out[:, lo : lo + step] = both.sum(1) if per_token else both.sum(dim=(1, 3))
    work.score_flops += 2.0 * m * rank * n * positions * (height + width + 1)
    return out


def _embedding_scores(rows: LayerRows, ids: torch.Tensor, g: torch.Tensor, work: Work, per_token: bool = False) -> torch.Tensor:
    """Rows F (m, V, d), dense or rank-r, against an embedding's per-example gradients: F[v]·(Σ_{t: id_t = v} g_t)
    for each distinct (example, v), summed per example; nothing of size V·d is formed (a sparse-dense product
    transposed the (m, V·d) rows every batch: 1 s at V 50,000 against 44 ms). `per_token`: F[id_t]·g_t at every
    position, (m, n, T)."""
    if per_token:
        n, positions = ids.shape
        return _gathered(rows, ids.reshape(-1), g.reshape(n * positions, -1), work).T.reshape(rows.count, n, positions)
    example, token, values = token_rows(ids, g)
    return _per_example(_gathered(rows, token, values, work), example, len(ids)).T


def _gathered(rows: LayerRows, token: torch.Tensor, values: torch.Tensor, work: Work) -> torch.Tensor:
    """F[v_k]·values_k (K, m) for K (token, value) pairs, the rows F[v] gathered (L[v] R for rank-r rows) and
    reduced in blocks of pairs."""
    m, width = rows.count, values.shape[1]
    step = max(1, BUDGET_BYTES // (m * width * values.element_size()))
    parts = []
    for lo in range(0, len(token), step):
        block = token[lo : lo + step]
        gathered = rows.dense.index_select(1, block) if rows.dense is not None else rows.left.index_select(1, block) @ rows.right
        parts.append(torch.einsum("mkd,kd->km", gathered, values[lo : lo + step]))
    work.score_flops += 2.0 * m * values.numel() * (1 if rows.rank is None else rows.rank + 1)  # the gather L[v] R, then the product
    return torch.cat(parts)


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
    """Per-example gradients Σ_t e_{id_t} g_tᵀ of an embedding with `vocab` rows, formed (n, vocab, d), for the
    methods that need gradients as features."""
    n, _, width = g.shape
    example, token, values = token_rows(ids, g)
    grads = g.new_zeros(n, vocab, width)
    grads[example, token] = values  # each (example, id) once
    return grads


def tied_cross(ids: torch.Tensor, g: torch.Tensor, h: torch.Tensor, delta: torch.Tensor, work: Work) -> torch.Tensor:
    """⟨G_emb, G_out⟩ per example of a tied weight's shares G_emb = Σ_t e_{id_t} g_tᵀ and G_out = Σ_s δ_s h_sᵀ:
    Σ_v (Σ_{t: id_t = v} g_t)·(Σ_s δ_s[v] h_s) over each example's distinct tokens v, the δ columns gathered at
    them (work ∝ distinct tokens × T × d, never V × d), in blocks of (example, token) pairs."""
    example, token, values = token_rows(ids, g)
    n, positions, width = h.shape
    step = max(1, BUDGET_BYTES // (positions * width * h.element_size()))
    parts = []
    for lo in range(0, len(token), step):
        pair, v = example[lo : lo + step], token[lo : lo + step]
        summed = torch.einsum("ks,ksd->kd", delta[pair, :, v], h[pair])  # Σ_s δ_s[v] h_s per pair
        parts.append((summed * values[lo : lo + step]).sum(1))
    work.score_flops += 2.0 * len(token) * positions * (width + 1)
    return _per_example(torch.cat(parts), example, n)


def cut_squared_norms(shares: list[tuple[torch.Tensor, torch.Tensor]], work: Work) -> torch.Tensor:
    """‖Σ_k G_k‖² per example over a cut's shares (a, g): their squared norms, plus twice the cross term of a tied
    weight's two shares (the embedding's, then the output Linear's)."""
    norms = sum(layer_squared_norms(a, g, work) for a, g in shares)
    if len(shares) == 2:
        (ids, g), (h, delta) = shares
        norms = norms + 2 * tied_cross(ids, g, h, delta, work)
    return norms


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
        out[:, cut.cols] = cut.to_flat(cut_gradients(batch, cut), order)
    if batch.rest is not None:
        assert split.rest_columns is not None
        out[:, split.rest_columns.to(out.device)] = batch.rest
    return out


def _share_gradients(shares: list[tuple[torch.Tensor, torch.Tensor]], rows: int) -> torch.Tensor:
    """Σ over shares of each example's gradient matrix (n, rows, in) from its captures (a, g)."""
    return sum(outer_gradients(g, a) if a.is_floating_point() else embedding_gradients(a, g, rows) for a, g in shares)


def cut_gradients(batch: Batch, cut: LayerCut) -> torch.Tensor:
    """A cut's per-example gradient matrices (n, out, in): its shares' summed."""
    return _share_gradients(batch.shares(cut.name), cut.shape[0])


def summed_cut_gradient(batch: Batch, cut: LayerCut) -> torch.Tensor:
    """A cut's gradient summed over the batch's examples (1, out, in): the examples' positions taken as one example's,
    one GEMM a share, not n matrices formed and added (the probe's check, on every process that splits a model)."""
    merged = [(a.reshape(1, -1, *a.shape[2:]), g.reshape(1, -1, *g.shape[2:])) for a, g in batch.shares(cut.name)]
    return _share_gradients(merged, cut.shape[0])


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
        height, width = cut.shape
        if rank < min(height, width):
            left = flat[:, col : col + height * rank].reshape(m, height, rank).contiguous()
            col += height * rank
            right = flat[:, col : col + rank * width].reshape(m, rank, width).contiguous()
            col += rank * width
            layers[cut.name] = LayerRows(left=left, right=right)
        else:
            layers[cut.name] = LayerRows(dense=flat[:, col : col + height * width].reshape(m, height, width).contiguous())
            col += height * width
    rest = flat[:, col:].contiguous() if split.rest_columns is not None else None
    return Rows(layers, rest, m)
