"""K-FAC and EK-FAC (George et al., 2018; Grosse et al., 2023): Kronecker-factored Gauss-Newton curvature per layer.

Per tracked layer: A = E[Σ_t a aᵀ] and S = E[Σ_t g gᵀ]/T from Fisher pseudo-gradients (the exact square root of
the output Hessian, or targets sampled from the model, seeded), eigendecomposed in float64; K-FAC takes the
eigenvalues λ_S ⊗ λ_A, EK-FAC replaces them with the second moments of the pseudo-gradients in that eigenbasis.
Sampled targets of the correction pass are drawn independently of those that fitted the eigenbasis: with the same
draws, the small eigenvalues are biased low (the basis is fitted to that very noise), which damping of the same
size exposes. The factor sums are streamed batch by batch and add up, so they can be computed on chunks and summed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from .. import examples
from ..batches import Batches, Data
from ..blocks import BlockCurvature
from ..contraction import Batch, LayerRows, Rows
from ..errors import ConfigError
from ..layers import Capture, FisherKind, TrackedLayer, capture, outer_gradients, select_layers
from ..noise import ExampleNoise
from ..objective import Objective
from ..self_influence import Diagonal, SelfInfluencePlan
from ..task import Task
from .influence_model import BlockSolver, InfluenceFunctionModel
from .options import DampedOptions, MethodOptions, ProjectedOptions, option

Sums = dict[str, dict[str, torch.Tensor]]
ROW_BUDGET_BYTES = 256 * 2**20  # per-example gradient matrices are formed this many bytes at a time


def row_slices(n: int, layer: TrackedLayer, itemsize: int) -> list[slice]:
    """Row ranges whose (rows, out, in) gradient matrices stay within the budget."""
    step = max(1, ROW_BUDGET_BYTES // (layer.out_dim * layer.in_dim * itemsize))
    return [slice(lo, lo + step) for lo in range(0, n, step)]


def eigen_gradients(a: torch.Tensor, g: torch.Tensor, q_a: torch.Tensor, q_s: torch.Tensor) -> torch.Tensor:
    """Per-example gradients in the Kronecker eigenbasis, Q_Sᵀ (Σ_t g_t a_tᵀ) Q_A, from the rotated captures:
    O(T·(out² + in² + out·in)) per example instead of rotating a formed (out × in) matrix."""
    return outer_gradients(g @ q_s.to(g.dtype), a @ q_a.to(a.dtype))


COVARIANCE_STREAM, CORRECTION_STREAM = 0, 1  # independent sampled targets in the two passes


def _fisher_captures(objective: Objective, layers: list[TrackedLayer], batches: Iterable[tuple[torch.Tensor, torch.Tensor]], fisher: FisherKind, noise: ExampleNoise, offset: int, samples: int) -> Iterator[tuple[torch.Tensor, Capture]]:
    """Fisher pseudo-gradient captures batch by batch, the noise tied to example indices offset, offset+1, ..."""
    for x, y in batches:
        x, y = objective.to_model(x, y)
        yield x, capture(objective.model, layers, objective.task, x, y, fisher, noise, offset, samples)
        offset += examples.count(x)


def covariance_sums(objective: Objective, layers: list[TrackedLayer], batches: Iterable[tuple[torch.Tensor, torch.Tensor]], fisher: FisherKind, seed: int, offset: int = 0, samples: int = 1) -> Sums:
    """Σ over examples of Σ_t a aᵀ and Σ_t g gᵀ per layer, plus counts; sums from disjoint chunks add up."""
    sums: Sums = {layer.name: {} for layer in layers}
    for x, cap in _fisher_captures(objective, layers, batches, fisher, ExampleNoise(seed, COVARIANCE_STREAM), offset, samples):
        for layer in layers:
            a = cap.a[layer.name].to(torch.float64)
            kept = padding_mask(x, a)
            if kept is not None:
                a = a * kept[..., None]
            _add(sums[layer.name], "a", torch.einsum("bti,btj->ij", a, a))
            for g in cap.g[layer.name]:
                g64 = g.to(torch.float64)
                _add(sums[layer.name], "s", torch.einsum("bto,btp->op", g64, g64))
            _add(sums[layer.name], "examples", torch.tensor(float(examples.count(x)), dtype=torch.float64))
            _count_rows(sums[layer.name], x, cap.g[layer.name])
            positions = float(a.shape[0] * a.shape[1]) if kept is None else kept.sum()
            _add(sums[layer.name], "positions", torch.as_tensor(positions, dtype=torch.float64))
    return sums


def _count_rows(values: dict[str, torch.Tensor], x: examples.Inputs, gradients: list[torch.Tensor]) -> None:
    """Count a captured batch's backward rows (examples × output gradients drawn per example) in its layer's sums, so
    they add up across chunks as the sums do (`pass_rows`)."""
    _add(values, "gradient_rows", torch.tensor(float(examples.count(x) * len(gradients)), dtype=torch.float64))


def pass_rows(sums: Sums) -> int:
    """The backward rows one pass's summed captures took (every layer counts the same rows)."""
    return int(next(iter(sums.values()))["gradient_rows"])


def padding_mask(x: examples.Inputs, a: torch.Tensor) -> torch.Tensor | None:
    """(B, T) 0/1 weights of a layer's positions from the inputs' `attention_mask` field when the layer sees those
    T positions: padding adds nothing to the input covariance nor to the positions counted (its output gradients
    are zero already, so the per-example gradients and EK-FAC's correction need no mask); None without one."""
    mask = x.get("attention_mask") if isinstance(x, dict) else None
    if mask is None or tuple(mask.shape) != tuple(a.shape[:2]):
        return None
    return (mask != 0).to(a)


def correction_sums(objective: Objective, layers: list[TrackedLayer], bases: dict[str, tuple[torch.Tensor, torch.Tensor]], batches: Iterable[tuple[torch.Tensor, torch.Tensor]], fisher: FisherKind, seed: int, offset: int = 0, samples: int = 1) -> Sums:
    """Σ over examples of (Q_Sᵀ G Q_A)², the gradient's second moment in the Kronecker eigenbasis (EK-FAC)."""
    sums: Sums = {layer.name: {} for layer in layers}
    for x, cap in _fisher_captures(objective, layers, batches, fisher, ExampleNoise(seed, CORRECTION_STREAM), offset, samples):
        for layer in layers:
            q_a, q_s = bases[layer.name]
            a = cap.a[layer.name]
            _count_rows(sums[layer.name], x, cap.g[layer.name])
            for g in cap.g[layer.name]:
                if a.shape[1] == 1:  # one position: Q_Sᵀ g aᵀ Q_A = u vᵀ, so Σ (u vᵀ)² = (u²)ᵀ (v²), one GEMM
                    u, v = (g[:, 0] @ q_s.to(g.dtype)) ** 2, (a[:, 0] @ q_a.to(a.dtype)) ** 2
                    _add(sums[layer.name], "lambda", (u.T @ v).to(torch.float64))
                    continue
                for rows in row_slices(len(a), layer, a.element_size()):
                    rotated = eigen_gradients(a[rows], g[rows], q_a, q_s)
                    _add(sums[layer.name], "lambda", (rotated * rotated).sum(0).to(torch.float64))
    return sums


def merge(*parts: Sums) -> Sums:
    """Add the sums of disjoint chunks."""
    total: Sums = {name: {} for name in parts[0]}
    for part in parts:
        for name, values in part.items():
            for key, value in values.items():
                _add(total[name], key, value)
    return total


def _add(target: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    target[key] = target[key] + value if key in target else value.clone()


class KroneckerSolver(BlockSolver):
    """(F_l + λI)⁻¹ for one layer, diagonal in the Kronecker eigenbasis: features are the gradient's eigen-coordinates
    Q_Sᵀ G Q_A (an (out, in) matrix, flattened row by row), preconditioned by dividing by Λ + λ."""

    def __init__(self, curvature: BlockCurvature, lam: float, layer: TrackedLayer) -> None:
        super().__init__(curvature, lam)
        self.layer = layer

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"q_a": self.q_a, "q_s": self.q_s, "eigenvalues": self.eigenvalues}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.q_a, self.q_s, self.eigenvalues = state["q_a"], state["q_s"], state["eigenvalues"]

    def curvature_scale(self) -> float:
        return float(self.eigenvalues.abs().max())

    def rotate(self, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Captured inputs and output gradients into the eigenbasis, so that Σ_t (Q_Sᵀg_t)(Q_Aᵀa_t)ᵀ = Q_Sᵀ G Q_A:
        O(T·(out² + in²)) per example, never rotating a formed (out × in) matrix."""
        return a @ self.q_a.to(a.dtype), g @ self.q_s.to(g.dtype)

    def damped(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.eigenvalues + self.lam).to(dtype)

    def whiten(self, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """(F_l + λI)^(-1/2) applied to rotated captures, in eigen-coordinates:
        ⟨whiten(z), whiten(z')⟩ = vec(G)ᵀ (F_l + λI)⁻¹ vec(G')."""
        return outer_gradients(g, a) / self.damped(a.dtype).sqrt()

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        return features / self.damped(features.dtype).reshape(-1)


@dataclass(frozen=True, kw_only=True)
class KfacOptions(MethodOptions, DampedOptions, ProjectedOptions):
    """K-FAC's and EK-FAC's options: always Gauss-Newton and layer-wise, so only λ and the Fisher's targets."""

    fisher: FisherKind = option(
        "auto", "Fisher",
        "exact: the expectation over the outputs, one backward pass per output; sampled: targets drawn from the model (seeded), fisher_samples per example; auto: exact up to 64 outputs per example, sampled above.",
    )
    fisher_samples: int = option(1, "Samples per example", "Targets drawn per example for the sampled Fisher, one backward pass each; the sampling variance falls as 1/samples.", ge=1)
    seed: int = option(0, "Seed", "Seed of the sampled targets.")


class KfacInfluence(InfluenceFunctionModel):
    """Kronecker-factored Gauss-Newton influence over chosen Linear and Conv2d layers (all of them by default).

    Parameters of other modules are excluded explicitly: `excluded_parameters` lists them; embeddings too, as the
    factor passes, rotations and projections take dense inputs (docs/methods.md, "Embeddings and K-FAC"). `fisher` is 'exact'
    (the expectation over the outputs, one backward pass per output; exact for a single linear layer with squared
    loss), 'sampled' (`fisher_samples` targets per example drawn from the model, seeded; one backward pass each),
    or 'auto' (the default, also None): exact up to EXACT_FISHER_MAX_PASSES = 64 backward passes per example
    (the task's `fisher_passes`: classes, or positions × vocabulary), sampled above.
    The correction pass draws its samples independently of the covariance pass.
    """

    name = "kfac"
    title = "K-FAC"
    summary = "K-FAC: Kronecker-factored Gauss-Newton per Linear/Conv2d layer (always layer-wise)."
    Options = KfacOptions
    options: KfacOptions
    fixed_block_structure = "layer_wise"
    projected_curvature = False  # a projection compresses the whitened gradients instead (LoGra)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        projection = self.options.projection
        self.projector = projection.build(self.layers) if projection is not None else None
    needs_positive_regularization = True  # factor eigenvalues reach 0 (dead units, unused inputs): λ = 0 divides by them
    eigen_correction = False
    row_order = "matrix"

    def attributed_names(self, model: nn.Module, task: Task) -> list[str]:
        """The tracked layers' parameters (the layers chosen, and the Fisher options checked, here)."""
        o = self.options
        self.layers = select_layers(model, task.modules if o.modules is None else o.modules)
        if o.query_rank is not None and o.projection is not None:
            raise ConfigError("method.query_rank", "query_rank with a projection", "leave query_rank empty: projected factors are already small")
        if o.fisher not in (None, "auto", "sampled", "exact"):
            raise ConfigError("method.fisher", f"unknown Fisher {o.fisher!r}", "use 'auto', 'exact' or 'sampled'")
        if o.fisher_samples < 1:
            raise ConfigError("method.fisher_samples", f"fisher_samples={o.fisher_samples}", "draw at least 1 target per example")
        self.fisher: FisherKind = o.fisher or "auto"  # None, as the library accepted before, is auto
        self.fisher_samples, self.seed = o.fisher_samples, o.seed
        return [p for layer in self.layers for p in layer.param_names]

    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        return KroneckerSolver(curvature, lam, next(layer for layer in self.layers if layer.block == curvature.name))

    def fit(self, train: Data) -> Self:
        """Two streaming passes for EK-FAC (factors, then the eigenvalue correction), one for K-FAC."""
        self._bind(train)
        assert self.train is not None
        x, y = next(iter(self.train))
        self.objective.check_outputs(x, y)
        self.install(self.fit_factors(self.train))
        self.check_regularization()
        return self

    def fit_factors(self, batches: Batches) -> dict[str, dict[str, torch.Tensor]]:
        """Eigenbases and eigenvalues per layer from the training batches (the state `install` takes)."""
        sums = self.covariance_sums(batches)
        bases = {name: factor_bases(values) for name, values in sums.items()}
        corrected = self.correction_sums(batches, bases) if self.eigen_correction else None
        return self.factor_state(sums, bases, corrected)

    # The three steps of fit_factors, for running the passes on chunks (e.g. as Dask tasks) and adding them up.
    def covariance_sums(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], offset: int = 0) -> Sums:
        """Pass 1 over examples offset, offset+1, ...: Σ a aᵀ, Σ g gᵀ and counts per layer."""
        return covariance_sums(self.objective, self.layers, batches, self.fisher, self.seed, offset, self.fisher_samples)

    def correction_sums(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], bases: dict[str, tuple[torch.Tensor, torch.Tensor]], offset: int = 0) -> Sums:
        """Pass 2 (EK-FAC): Σ (Q_Sᵀ G Q_A)² per layer."""
        return correction_sums(self.objective, self.layers, bases, batches, self.fisher, self.seed, offset, self.fisher_samples)

    def factor_state(self, sums: Sums, bases: dict[str, tuple[torch.Tensor, torch.Tensor]], corrected: Sums | None) -> dict[str, dict[str, torch.Tensor]]:
        """The per-block state from summed passes, whose backward rows are added to the work counted."""
        self.work.gradient_rows += pass_rows(sums) + (0 if corrected is None else pass_rows(corrected))
        if corrected is not None:
            eigenvalues = {name: corrected[name]["lambda"] / sums[name]["examples"] for name in sums}
        else:
            eigenvalues = {name: kfac_eigenvalues(values) for name, values in sums.items()}
        blocks = {layer.name: layer.block for layer in self.layers}
        return {blocks[name]: {"q_a": bases[name][0], "q_s": bases[name][1], "eigenvalues": eigenvalues[name]} for name in sums}

    def install(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for name, solver in self.solvers.items():
            solver.load_state_dict(state[name])
        self._fitted = True

    # -- scoring in the eigenbasis -------------------------------------------------------------------
    # Captures are rotated into each layer's eigenbasis as they are taken, so features, query factors and scores
    # all live there: factors are (Q_Sᵀ G Q_A) / (Λ + λ) (no rotation back), self-influence is Σ (Q_Sᵀ G Q_A)²/(Λ + λ).
    # Scores alone (no self-influence) instead rotate the m query rows back once, Q_S F Q_Aᵀ, and contract the
    # captures as taken, when that costs less than rotating every training position (`rows_as_captured`).
    # With a projection, both sides are whitened, w = (F + λI)^(-1/2) g, then projected (Gaussian, Rademacher, or
    # LoGra's Φ_out ⊗ Φ_in), so score ≈ ⟨Φ w_t, Φ w_i⟩ and self-influence stays exact.

    def to_basis(self, batch: Batch) -> Batch:
        inputs, grads = {}, {}
        for layer in self.layers:
            inputs[layer.name], g = self.solvers[layer.block].rotate(batch.a(layer.name), batch.g(layer.name))  # type: ignore[attr-defined]
            grads[layer.name] = [g]
        return Batch(Capture(inputs, grads), batch.rest, batch.n, batch.dtype, batch.device)

    def rows_as_captured(self, rows: Rows, batch: Batch, n: int) -> Rows | None:
        """⟨F, Q_Sᵀ G Q_A⟩ = ⟨Q_S F Q_Aᵀ, G⟩: each layer's m rows rotated back once (rank-r rows: Q_S L and R Q_Aᵀ),
        when that is fewer flops than rotating the n examples' positions (T·(out² + in²) each)."""
        back = rotate = 0
        for layer in self.layers:
            part, positions = rows.layers[layer.name], batch.a(layer.name).shape[1]
            out, inp = layer.out_dim, layer.in_dim
            back += part.count * (out * inp * (out + inp) if part.rank is None else part.rank * (out * out + inp * inp))
            rotate += n * positions * (out * out + inp * inp)
        if back >= rotate:
            return None
        return Rows({layer.name: self._row_back(layer, rows.layers[layer.name]) for layer in self.layers}, rows.rest, rows.count)

    def _row_back(self, layer: TrackedLayer, part: LayerRows) -> LayerRows:
        """One layer's rows from its eigenbasis to its captures' basis."""
        solver = self.solvers[layer.block]
        q_a, q_s = solver.q_a, solver.q_s  # type: ignore[attr-defined]
        if part.dense is not None:
            return LayerRows(dense=q_s.to(part.dense.dtype) @ part.dense @ q_a.T.to(part.dense.dtype))
        assert part.left is not None and part.right is not None
        return LayerRows(left=q_s.to(part.left.dtype) @ part.left, right=part.right @ q_a.T.to(part.right.dtype))

    def batch_features(self, batch: Batch) -> torch.Tensor:
        if self.projector is None:
            return super().batch_features(batch)
        parts = []
        for i, layer in enumerate(self.layers):
            solver, a, g = self.solvers[layer.block], batch.a(layer.name), batch.g(layer.name)
            parts.append(torch.cat([self.projector.project_matrices(layer, i, solver.whiten(a[sl], g[sl])) for sl in row_slices(batch.n, layer, a.element_size())]))  # type: ignore[attr-defined]
        return torch.cat(parts, dim=1)

    def projected_token_rows(self, factors: torch.Tensor) -> Rows:
        """Φᵀ f whitened once more, (F + λI)^(-1/2) ∘ Φᵀ f in the eigenbasis: the adjoint of the training side's
        whiten-then-project, met with each position's rotated captures."""
        rows = super().projected_token_rows(factors)
        for layer in self.layers:
            dense = rows.layers[layer.name].dense
            assert dense is not None
            rows.layers[layer.name] = LayerRows(dense=dense / self.solvers[layer.block].damped(dense.dtype).sqrt())  # type: ignore[attr-defined]
        return rows

    def _dense_factors(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """With a projection the factors are the queries' projected whitened gradients (the split is symmetric)."""
        return self.gradient_features(x, y, measure=True) if self.projector is not None else super()._dense_factors(x, y)

    def _exact_self_plan(self) -> SelfInfluencePlan:
        return Diagonal({layer.name: 1.0 / self.solvers[layer.block].damped(torch.float64) for layer in self.layers})  # type: ignore[attr-defined]


def factor_bases(values: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvectors of A = Σ a aᵀ / n and S = Σ g gᵀ / positions, in float64."""
    _, q_a = torch.linalg.eigh(values["a"] / values["examples"])
    _, q_s = torch.linalg.eigh(values["s"] / values["positions"])
    return q_a, q_s


def kfac_eigenvalues(values: dict[str, Any]) -> torch.Tensor:
    """λ_S ⊗ λ_A with A = E[Σ_t a aᵀ], S = E[Σ_t g gᵀ]/T: the Kronecker product's eigenvalues."""
    lam_a = torch.linalg.eigvalsh(values["a"] / values["examples"]).clamp_min(0)
    lam_s = torch.linalg.eigvalsh(values["s"] / values["positions"]).clamp_min(0)
    return torch.outer(lam_s, lam_a)


@dataclass(frozen=True, kw_only=True)
class EkfacOptions(KfacOptions):
    """EK-FAC takes K-FAC's options."""


class EkfacInfluence(KfacInfluence):
    """K-FAC's eigenbasis with eigenvalues fitted to the gradients' actual second moments (Kronfluence's default)."""

    name = "ekfac"
    title = "EK-FAC"
    summary = "EK-FAC: K-FAC's eigenbasis with corrected eigenvalues (Kronfluence's default); with projection, LoGra-style."
    Options = EkfacOptions
    eigen_correction = True
