"""The influence-model interface shared by every curvature method (pyDVL-style fit / factors / influences).

A model splits its parameters into blocks (all of them, or one per layer); each block gets a `BlockSolver` that
applies (C_b + λ_b I)⁻¹, so the curvature is block-diagonal with its own λ per block under `layer_wise`.

Every gradient comes from one captured batch (`contraction.Batch`): the inputs (token ids for an embedding) and
output gradients of the Linear/Conv2d/Conv1D/Embedding layers, plus vmap gradients of any other parameters. Methods whose features are the gradient itself
(or its rotation, K-FAC) score by contracting query rows with the captures; the others (Arnoldi's eigenbasis,
projections) form their low-dimensional features from the same batch.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar, Self

import torch
from torch import nn

from .. import examples
from ..batches import Batches, Data, as_batches
from ..blocks import BlockCurvature, BlockStructure, Regularization, block_regularization, layer_blocks, make_blocks
from ..contraction import Batch, GradientSplit, LayerRows, RowOrder, Rows, compress_rows, contract, gradient_batch, materialise
from ..curvature import CurvatureOperator, SecondOrderMode
from ..errors import ConfigError
from ..layers import module_param_names, select_layers
from ..spectral import frobenius_estimate, hutchinson_trace, lanczos, nystroem
from ..objective import Objective
from ..projection import Projection, Projector, project_batch, projected_rows
from ..self_influence import SelfInfluenceMode, SelfInfluencePlan, Sketch, Solve, auto_rank, eigen_sketch
from ..task import LossFn, Task, resolve_task
from .feature_covariance import FeatureCovariance
from .options import MethodOptions, parse_options
from .scorer import Scorer

SKETCH_SEED = 0
SWAMPING = 1e6  # λ above this many times the curvature's largest eigenvalue leaves (C + λI)⁻¹ = I/λ to 1 part in a million
SCALE_PROBES = 4  # Rademacher products of the matrix-free estimate of that eigenvalue's bound (one pass over the data)


class BlockSolver(ABC):
    """(C_b + λ_b I)⁻¹ for one parameter block, optionally in a compressed feature space."""

    def __init__(self, curvature: BlockCurvature, lam: float) -> None:
        self.curvature, self.lam = curvature, lam

    @property
    def second_order_mode(self) -> str | None:
        """'hessian' or 'gauss_newton' for a block of the model's curvature; None for a projected covariance (PSD)."""
        operator = getattr(self.curvature, "operator", None)
        return getattr(operator, "mode", None)

    @property
    def feature_dim(self) -> int:
        return self.curvature.dim

    def fit(self) -> None:
        """Compute the block's curvature state; methods that only need products at solve time keep this."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` returned; stateless solvers keep this."""

    def feature_rows(self) -> torch.Tensor | None:
        """Rows B (k, p_b) when the block's features are B g (a basis), None when they are the gradient itself."""
        return None

    @abstractmethod
    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        """Apply (C_b + λ_b I)⁻¹ to each row of `features`."""

    def curvature_product(self, vectors: torch.Tensor) -> torch.Tensor:
        """Rows of `vectors` times the matrix this solver inverts (without λ)."""
        return self.curvature.matmat(vectors)

    @property
    def product_is_psd(self) -> bool:
        """Whether that matrix is positive semi-definite by construction."""
        return self.curvature.psd

    def curvature_scale(self) -> float:
        """The fitted block's largest curvature eigenvalue in magnitude, or a bound of it from above: here ‖C‖_F,
        estimated from SCALE_PROBES products (one pass over the data); solvers that fitted eigenvalues or the matrix
        itself return what they have."""
        c = self.curvature
        return frobenius_estimate(self.curvature_product, c.dim, SCALE_PROBES, SKETCH_SEED, c.dtype, c.device)

    def sketch(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        """Top eigenpairs (values, vectors as columns) of the block's curvature and an estimate of its trace, for the
        low-rank self-influence estimate: a one-pass Nyström sketch when C is positive semi-definite, Lanczos plus a
        Hutchinson trace otherwise (the Hessian)."""
        c = self.curvature
        if self.product_is_psd:
            return nystroem(self.curvature_product, c.dim, rank, SKETCH_SEED, c.dtype, c.device)
        values, vectors = lanczos(self.curvature_product, c.dim, rank, 2 * rank, SKETCH_SEED, c.dtype, c.device)
        return values, vectors, hutchinson_trace(self.curvature_product, c.dim, rank, SKETCH_SEED, c.dtype, c.device)


class InfluenceFunctionModel(ABC):
    """score[t, i] = ∇ℓ(z_t)ᵀ (C + λI)⁻¹ ∇ℓ(z_i); positive means z_i helped the prediction on z_t.

    Subclasses choose the curvature approximation through `make_solver`. Results follow the parameters' dtype
    and device. With `query_rank`, each query's factor is kept per layer as a rank-r product (Kronfluence's
    `query_gradient_low_rank`), and scores contract those factors.
    """

    name: ClassVar[str]
    title: ClassVar[str]  # the method's name in the parameter form
    summary: ClassVar[str]  # one line on what it does, under the form's method choice
    Options: ClassVar[type[MethodOptions]]  # its typed options, with their defaults: the one place they are declared
    fixed_block_structure: ClassVar[BlockStructure] = "full"  # the blocks of a method whose options do not choose them
    projected_curvature: ClassVar[bool] = True  # a projection takes the curvature into the projected space (TRAK)
    # torch.func.functional_call swaps tensors on the module during a call, so one module must not serve
    # two threads at once; a method that avoids this may declare itself thread-safe.
    thread_safe: ClassVar[bool] = False
    # Query rows the pipeline solves together, in float64 bytes of their gradients: small blocks let a block be
    # written while the next is solved; iterative solvers raise it, as every row of a block shares each data pass.
    solve_block_bytes: ClassVar[int] = 256 * 2**20
    solves_on_data: ClassVar[bool] = False  # a query's solve passes over the training data (CG): blocks run as Dask tasks
    needs_positive_regularization: ClassVar[bool] = False
    row_order: ClassVar[RowOrder] = "parameters"  # how a layer's columns lie in a factor row
    cheap_solve: ClassVar[bool] = False  # whether `auto` self-influence may solve once per training example

    def __init__(self, model: nn.Module, loss: Task | LossFn | str, regularization: Regularization | None = None, **options: Any) -> None:
        """`options` are the fields of the method's `Options` (pyDVL-style keywords); `regularization` is λ."""
        given = options if regularization is None else {"regularization": regularization, **options}
        self.options = parse_options(self.Options, self.name, given)
        task = resolve_task(loss)
        param_names = self.attributed_names(model, task)
        o = self.options
        modules = task.modules if o.modules is None else o.modules
        projection: Projection | None = getattr(o, "projection", None) if self.projected_curvature else None
        block_structure: BlockStructure = getattr(o, "block_structure", self.fixed_block_structure)
        self.projector: Projector | None = None
        self.feature_space = projection is not None  # curvature taken in the projected space (TRAK-style)
        if projection is not None:
            layers = select_layers(model, modules)
            self.projector = projection.build(layers)
            param_names = [p for layer in layers for p in layer.param_names]
        elif param_names is None:
            param_names = module_param_names(model, modules)
        if o.query_rank is not None and (o.query_rank < 1 or projection is not None):
            raise ConfigError("method.query_rank", f"query_rank={o.query_rank} with projection={projection}", "use a positive rank, without a projection (projected factors are already small)")
        self.query_rank = o.query_rank
        self.objective = Objective(model, task, param_names)
        self.excluded_parameters = [n for n, p in model.named_parameters() if p.requires_grad and n not in self.objective.space.params]
        self.frozen_parameters = [n for n, p in model.named_parameters() if not p.requires_grad]  # never attributed
        self.blocks = self._feature_blocks(block_structure) if self.projector else make_blocks(self.objective.space, block_structure)
        self.regularization = block_regularization(self.blocks, getattr(o, "regularization", 0.0), self.needs_positive_regularization, self.name)
        self.second_order_mode: SecondOrderMode = getattr(o, "second_order_mode", "gauss_newton")
        self.block_structure = block_structure
        self.batch_size = o.batch_size
        self.train: Batches | None = None
        self.solvers: dict[str, BlockSolver] = {}
        self._split: GradientSplit | None = None
        self._basis: Rows | None = None
        self._fitted = False

    def attributed_names(self, model: nn.Module, task: Task) -> list[str] | None:
        """The names of the parameters a method attributes by its own rule; None: those of the options' (or the
        task's) modules, or of the projected layers."""
        return None

    def attributed_parameters(self) -> dict[str, dict[str, Any]]:
        """Which of the model's parameters the scores are taken over: included, excluded (outside `modules` or the
        method's layers) and frozen (requires_grad=False), each with its tensor names and element count. Once fitted,
        the included ones are also split by how their per-example gradients are taken: `captured` from whole
        Linear/Conv1D/Conv2d/Embedding layers and weights tied between an embedding and an output Linear (contracted
        with the queries where the method contracts) and `vmapped` by torch.func (position embeddings of arange(T),
        norms, shared layers)."""
        named = dict(self.objective.model.named_parameters())
        groups = {"included": list(self.objective.space.params), "excluded": self.excluded_parameters, "frozen": self.frozen_parameters}
        if self.train is not None:
            split = self.gradient_split(*next(iter(self.train)))
            vmapped = set() if split.rest is None else set(split.rest.space.names)
            groups["captured"] = [n for n in groups["included"] if n not in vmapped]
            groups["vmapped"] = [n for n in groups["included"] if n in vmapped]
        return {kind: {"tensors": len(names), "elements": sum(named[n].numel() for n in names), "names": names} for kind, names in groups.items()}

    @property
    def work(self):  # type: ignore[no-untyped-def]
        """The work counted so far (gradient rows, curvature products, solves, score flops)."""
        return self.objective.work

    @property
    def feature_dim(self) -> int:
        """Size of the space curvature is taken in: p, or the projected dimension."""
        return max(sl.stop for sl in self.blocks.values())

    @property
    def factor_dim(self) -> int:
        """Width p' of the query factors and of each example's features (`batch_features`): p, the projected
        dimension, or the low-rank solvers' ranks summed."""
        if self.projector is not None:
            return sum(self.projector.dims.values())
        return sum(solver.feature_dim for solver in self.solvers.values())

    @abstractmethod
    def make_solver(self, curvature: BlockCurvature, lam: float) -> BlockSolver:
        """The solver of one block."""

    # -- fitting ---------------------------------------------------------------------------------
    def _feature_blocks(self, structure: BlockStructure) -> dict[str, slice]:
        """Blocks of the projected feature space: all of it, or one per tracked layer."""
        assert self.projector is not None
        slices, start = {}, 0
        for layer in self.projector.layers:
            dim = self.projector.layer_dim(layer)
            slices[layer.block] = slice(start, start + dim)
            start += dim
        return {"all": slice(0, start)} if structure == "full" else slices

    def _bind(self, train: Data | None) -> None:
        if train is not None:
            self.train = as_batches(train, self.batch_size)
        if self.feature_space:
            covariance = FeatureCovariance(self.train, self.features_of, self.objective)
            curvatures = {name: covariance.block(sl, name) for name, sl in self.blocks.items()}
        else:
            operator = CurvatureOperator(self.objective, self.train, self.second_order_mode)
            partition = tuple(self.blocks.values())
            curvatures = {name: BlockCurvature(operator, sl, name, partition) for name, sl in self.blocks.items()}
        self.solvers = {name: self.make_solver(curvature, self.regularization[name]) for name, curvature in curvatures.items()}
        self._basis = None

    def fit(self, train: Data) -> Self:
        """Compute the curvature state from training data (a DataLoader or an (x, y) tuple)."""
        self._bind(train)
        assert self.train is not None
        x, y = next(iter(self.train))
        self.objective.check_outputs(x, y)
        for solver in self.solvers.values():
            solver.fit()
        self._fitted = True
        self.check_regularization()
        return self

    def check_regularization(self) -> None:
        """Refuse, once the curvature is fitted, a λ that swamps it: above SWAMPING times a block's largest curvature
        eigenvalue (or a bound of it from above), (C + λI)⁻¹ is I/λ, so every score is a plain gradient dot product
        divided by λ (λ=1e300 stores every score as 0), which no curvature method is meant to give. Names the block
        most swamped."""
        ratios = {}
        for name, solver in self.solvers.items():
            scale = solver.curvature_scale() if solver.lam > 0 else 0.0
            if math.isfinite(scale) and scale > 0:  # a block without curvature has nothing to swamp
                ratios[name] = (solver.lam / scale, scale)
        if not ratios or max(ratios.values())[0] <= SWAMPING:
            return
        name = max(ratios, key=lambda block: ratios[block][0])
        scale, lam = ratios[name][1], self.solvers[name].lam
        where = "" if name == "all" else f" of block {name!r}"
        field = f"method.regularization.{name}" if isinstance(getattr(self.options, "regularization", None), dict) else "method.regularization"
        raise ConfigError(
            field, f"λ={lam:g} swamps the curvature{where}, whose largest eigenvalue is at most {scale:.2e}: (C + λI)⁻¹ is I/λ there, so the scores would be gradient dot products divided by λ",
            f"set {field} below {SWAMPING * scale:.1e} ({SWAMPING:g} × that eigenvalue), typically 1e-3 to 1 × it; or use method.name: identity for plain gradient dot products",
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fitted curvature state, to store and restore without fitting again."""
        return {f"{block}/{key}": value for block, solver in self.solvers.items() for key, value in solver.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], train: Data | None = None) -> Self:
        """Restore a fitted state; methods that take curvature products at solve time need `train` back."""
        self._bind(train)
        for block, solver in self.solvers.items():
            prefix = f"{block}/"
            solver.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
        self._fitted = True
        return self

    @property
    def is_fitted(self) -> bool:
        return self._fitted

    def _require_fitted(self) -> None:
        if not self._fitted:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(train) first")

    # -- gradients, once per batch ------------------------------------------------------------------
    def gradient_split(self, x: torch.Tensor, y: torch.Tensor) -> GradientSplit:
        """Which parameters come from layer captures and which from vmap (probed once on a few rows of `x`)."""
        if self._split is None:
            self._split = GradientSplit(self.objective, (examples.take(x, slice(0, 8)), y[:8]))
        return self._split

    def gradient_batch(self, x: torch.Tensor, y: torch.Tensor, measure: bool = False, in_basis: bool = True) -> Batch:
        """The captured gradients of one batch (of the query measurement with `measure`), in the coordinates the
        method's features use, or (`in_basis=False`) as captured."""
        batch = gradient_batch(self.gradient_split(x, y), x, y, self.objective.work, measure)
        return self.to_basis(batch) if in_basis else batch

    def to_basis(self, batch: Batch) -> Batch:
        """A captured batch in the method's feature coordinates (unchanged here; K-FAC rotates it)."""
        return batch

    def rows_as_captured(self, rows: Rows, batch: Batch, n: int) -> Rows | None:
        """Query rows mapped back from the method's basis to the captures' own, when that costs less than rotating
        n examples like `batch` (K-FAC, EK-FAC); None: keep the basis (here there is none to leave)."""
        return None

    def contracts(self) -> bool:
        """True when the features are the gradient itself (or its rotation): scores then contract query rows with
        the captures, and no (n, p) matrix of per-sample gradients is formed."""
        return self.projector is None and all(solver.feature_rows() is None for solver in self.solvers.values())

    def batch_features(self, batch: Batch) -> torch.Tensor:
        """Per-example features (n, p') of a captured batch: projected, in the eigenbasis, or the gradient itself."""
        if self.projector is not None:
            return project_batch(self.projector, batch.capture)
        if self.contracts():
            assert self._split is not None
            return materialise(batch, self._split, self.row_order, self.objective.space.dim)
        return contract(self._basis_rows(), batch, self.objective.work).T

    def check_per_token(self) -> None:
        """Refuse per-token scores where an example's gradient has lost its positions: parameters on vmap per-sample
        gradients."""
        rest = [] if self._split is None or self._split.rest is None else self._split.rest.space.names
        if rest:
            shown = ", ".join(rest[:3]) + (", ..." if len(rest) > 3 else "")
            raise ConfigError("per_token", f"parameters {shown} take vmap per-sample gradients, which have no positions", "attribute only Linear/Conv1D/Embedding layers (method.modules), or use kfac/ekfac, which track only those")

    def projected_token_rows(self, factors: torch.Tensor) -> Rows:
        """Projected factors (m, p') as rows in the captures' coordinates, Φᵀ f per layer: contracted position by
        position they split each projected score by token exactly (the projection is linear in Σ_t g_t a_tᵀ)."""
        assert self.projector is not None
        return Rows({name: LayerRows(dense=rows) for name, rows in projected_rows(self.projector, factors).items()}, None, len(factors))

    def token_features(self, batch: Batch) -> torch.Tensor:
        """Per-position features (p', n, T) of a method with a basis: its rows contracted before the sum over
        positions (summed over T: `batch_features`ᵀ)."""
        return contract(self._basis_rows(), batch, self.objective.work, per_token=True)

    def _basis_rows(self) -> Rows:
        """The solvers' feature rows, block-diagonal in parameter space, for contracting with captures."""
        if self._basis is None:
            assert self._split is not None
            parts = []
            for solver, sl in zip(self.solvers.values(), self.blocks.values()):
                rows = solver.feature_rows()
                assert rows is not None
                block = rows.new_zeros(len(rows), self.objective.space.dim)
                block[:, sl] = rows
                parts.append(block)
            self._basis = Rows.from_flat(torch.cat(parts), self._split, "parameters")
        return self._basis

    def features_of(self, x: torch.Tensor, y: torch.Tensor, measure: bool = False) -> torch.Tensor:
        """Per-example features (n, p') of (x, y), batch by batch (no fitted state needed for projections)."""
        step = self.batch_size
        return torch.cat([self.batch_features(self.gradient_batch(examples.take(x, slice(lo, lo + step)), y[lo : lo + step], measure)) for lo in range(0, examples.count(x), step)])

    def gradient_features(self, x: torch.Tensor, y: torch.Tensor, measure: bool = False) -> torch.Tensor:
        """Per-example representation (n, p'): the loss gradient (the measurement's with `measure`, for queries),
        projected or in the method's basis where it has one."""
        self._require_fitted()
        return self.features_of(x, y, measure)

    def precondition(self, features: torch.Tensor) -> torch.Tensor:
        """Apply (C + λI)⁻¹, block by block, to each row of `features` (n, p')."""
        self._require_fitted()
        return self._per_block(features, self._feature_slices(), lambda s, f: s.precondition(f))

    def _feature_slices(self) -> list[slice]:
        slices, start = [], 0  # the solvers' blocks of the factor_dim columns
        for solver in self.solvers.values():
            slices.append(slice(start, start + solver.feature_dim))
            start += solver.feature_dim
        return slices

    def _per_block(self, rows: torch.Tensor, slices: Iterable[slice], apply: Any) -> torch.Tensor:
        parts = [apply(solver, rows[:, sl]) for solver, sl in zip(self.solvers.values(), slices)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    # -- public API ------------------------------------------------------------------------------
    def influence_factors(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(C + λI)⁻¹ ∇ℓ for each query example: shape (n_test, p'), in the method's feature coordinates (rank-r
        factors per layer with `query_rank`)."""
        return self.finish_factors(self._dense_factors(x, y), x, y)

    def finish_factors(self, factors: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Dense query factors of (x, y) as stored: unchanged, or rank-r per layer with `query_rank`."""
        if self.query_rank is None:
            return factors
        return compress_rows(factors, self.gradient_split(x, y), self.row_order, self.query_rank)

    def _dense_factors(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The query factors before any rank-r compression."""
        return self.precondition(self.gradient_features(x, y, measure=True))

    def influences_from_factors(self, factors: torch.Tensor, x: torch.Tensor, y: torch.Tensor, per_token: bool = False) -> torch.Tensor:
        """Scores (n_test, n) of the examples (x, y) on the queries behind `factors`; `per_token`: (n_test, n, T),
        each training position's share (docs/methods.md, "Per-token scores"), summing over T to the scores."""
        scores, _ = Scorer(self, factors, None, per_token)(x, y)
        assert scores is not None
        return scores

    def influences(
        self, x_test: torch.Tensor, y_test: torch.Tensor, x: torch.Tensor | None = None, y: torch.Tensor | None = None, per_token: bool = False
    ) -> torch.Tensor:
        """Scores (n_test, n) of (x, y), or of the whole training set when they are omitted; `per_token`: (n_test,
        n, T), as `influences_from_factors`."""
        factors = self.influence_factors(x_test, y_test)
        if x is None or y is None:
            assert self.train is not None
            return torch.cat([self.influences_from_factors(factors, xb, yb, per_token) for xb, yb in self.train], dim=1)
        return self.influences_from_factors(factors, x, y, per_token)

    def self_influences(self, x: torch.Tensor, y: torch.Tensor, mode: SelfInfluenceMode = "exact", rank: int = 32) -> torch.Tensor:
        """∇ℓ(z_i)ᵀ (C + λI)⁻¹ ∇ℓ(z_i) for each example: high values flag unusual or mislabelled points. `mode`
        as in `self_influence_plan`."""
        _, values = Scorer(self, None, self.self_influence_plan(mode, rank))(x, y)
        assert values is not None
        return values

    # -- self-influence ---------------------------------------------------------------------------
    def self_influence_plan(self, mode: SelfInfluenceMode = "exact", rank: int = 32, n_queries: int | None = None) -> SelfInfluencePlan:
        """How self-influences are computed: `exact`; `lowrank`, a rank-`rank` sketch where the exact value needs a
        solve per example (exact elsewhere); `auto`, exact where the method makes it cheap (`cheap_solve`, or a
        form other than a solve per example), else the sketch at `auto_rank` for `n_queries` queries; or `off`."""
        self._require_fitted()
        if mode == "off":
            return None
        exact = self._exact_self_plan()
        if mode == "exact" or not isinstance(exact, Solve):
            return exact
        if mode == "auto" and self.cheap_solve:
            return exact
        return self._low_rank_self_plan(rank if mode == "lowrank" else auto_rank(rank, n_queries or 2 * rank))

    def _exact_self_plan(self) -> SelfInfluencePlan:
        """The method's exact form: by default its solver, applied to every example's features."""
        return Solve()

    def _low_rank_self_plan(self, rank: int) -> Sketch:
        """Each block's top-`rank` eigenspace exact, the rest at its mean eigenvalue."""
        parts = []
        for solver in self.solvers.values():
            k = min(rank, solver.feature_dim)
            values, vectors, trace = solver.sketch(k)
            parts.append(eigen_sketch(values, vectors, solver.lam, k, trace))
        return Sketch.from_blocks(parts, self._feature_slices(), sum(s.feature_dim for s in self.solvers.values()))

    def block_norms(self, batch: Batch, features: torch.Tensor | None) -> torch.Tensor:
        """Squared norms of each block of each example's features (blocks, n), from the features when formed,
        else from the captures."""
        slices = self._feature_slices()
        if features is not None:
            return torch.stack([(features[:, sl] ** 2).sum(1) for sl in slices])
        assert self._split is not None
        return self._split.block_norms(batch, slices, self.objective.work)

    # -- per-module scores -------------------------------------------------------------------------
    def module_segments(self) -> dict[str, slice]:
        """The slice of the feature space that belongs to each module."""
        if self.projector is not None:
            return self._feature_blocks("layer_wise")
        if all(solver.feature_dim == sl.stop - sl.start for solver, sl in zip(self.solvers.values(), self.blocks.values())):
            return layer_blocks(self.objective.space)
        if self.block_structure == "layer_wise":
            return dict(zip(self.solvers, self._feature_slices()))
        raise ConfigError("method.block_structure", f"{self.name} mixes modules in its compressed features", "use block_structure='layer_wise' for per-module scores")

    def influences_by_module(self, x_test: torch.Tensor, y_test: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """Scores split by the module whose parameters carry them; they sum to `influences`."""
        factors, features = self._dense_factors(x_test, y_test), self.gradient_features(x, y)
        return {module: factors[:, sl] @ features[:, sl].T for module, sl in self.module_segments().items()}

