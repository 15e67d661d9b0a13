"""The stage tasks (six, and the optional validation). Each takes its stage's one input and returns a small ref;
caching is keyed on the input's planned stage key (fingerprints and config), never tensors. The input types are
exported here for the flow."""

from __future__ import annotations

from influence_core.pipeline.stages import aggregation, index, metagradients, preconditioner, prepare, query_factors, training, validation
from influence_core.pipeline.score import rerank as reranking, scoring
from influence_core.pipeline.score.rerank import RerankInput
from influence_core.pipeline.stages.aggregation import AggregationInput
from influence_core.pipeline.stages.index import IndexInput
from influence_core.pipeline.stages.metagradients import MagicInput
from influence_core.pipeline.runtime.cluster import dask_client
from influence_core.pipeline.stages.preconditioner import PreconditionerInput
from influence_core.pipeline.stages.prepare import PrepareInput
from influence_core.pipeline.stages.query_factors import QueryFactorsInput
from influence_core.pipeline.store.refs import FactorsRef, IndexRef, ScoresRef, StageRef, ValidationRef
from influence_core.pipeline.score.score_input import Member, ScoringInput
from influence_core.pipeline.specs import METHOD_CLASSES
from influence_core.pipeline.stages.training import TrainingInput
from influence_core.pipeline.stages.validation import ValidationInput

from .policy import stage_task
from .progress import ChunkProgress

__all__ = [
    "AggregationInput", "IndexInput", "MagicInput", "Member", "PreconditionerInput", "PrepareInput", "QueryFactorsInput", "RerankInput", "ScoringInput", "TrainingInput", "ValidationInput",
    "aggregate", "compute_influences", "compute_metagradients", "compute_test_factors", "fit_model", "fit_preconditioner", "index_training", "prepare_data", "rerank", "validate_run",
]

prepare_data = stage_task("prepare_data")(prepare.run)  # dataset → row-chunked Zarr arrays with a content fingerprint
fit_model = stage_task("fit_model")(training.run)  # train the model (or load its checkpoint) and store its state_dict
aggregate = stage_task("aggregate")(aggregation.run)  # top-k helpful and harmful, argmax and train totals, streamed over the scores


@stage_task("fit_preconditioner")
def fit_preconditioner(stage: PreconditionerInput) -> StageRef:
    """Fit the curvature state of the chosen method and store it (K-FAC factor passes run on the cluster)."""
    return preconditioner.run(stage, client_factory=lambda: dask_client(stage.compute, METHOD_CLASSES[stage.method.name].thread_safe))


@stage_task("index_training")
def index_training(stage: IndexInput) -> IndexRef:
    """Every training example's features and self-influence, once per training side: later runs score new queries
    against them with no training gradient (skipped, with the reason, when over compute.index_budget_gb)."""
    thread_safe = METHOD_CLASSES[stage.method.name].thread_safe
    return index.run(stage, client_factory=lambda: dask_client(stage.compute, thread_safe), on_progress=ChunkProgress("index_training", "train chunks indexed"))


@stage_task("compute_test_factors")
def compute_test_factors(stage: QueryFactorsInput) -> FactorsRef:
    """(C + λI)⁻¹ ∇ℓ for every query, once per run (in a compressed index's coordinates when given one); LiSSA's
    repeats run on the cluster (FastIF's parallel s_test)."""
    compute = stage.compute
    factory = None if compute is None else (lambda: dask_client(compute, METHOD_CLASSES[stage.method.name].thread_safe))
    return query_factors.run(stage, client_factory=factory)


@stage_task("compute_influences")
def compute_influences(stage: ScoringInput) -> ScoresRef:
    """Scores (and self-influences) for every (query, training example), or FastIF's candidate scores, one train chunk per Dask task; resumes where it stopped."""
    thread_safe = METHOD_CLASSES[stage.method.name].thread_safe
    return scoring.run(stage, client_factory=lambda: dask_client(stage.compute, thread_safe), on_progress=ChunkProgress("compute_influences"))


@stage_task("rerank")
def rerank(stage: RerankInput) -> ScoresRef:
    """Each query's candidates by a compressed index's scores, scored again exactly: one gradient pass over their
    union, one train chunk per Dask task; resumes where it stopped."""
    thread_safe = METHOD_CLASSES[stage.method.name].thread_safe
    return reranking.run(stage, client_factory=lambda: dask_client(stage.compute, thread_safe), on_progress=ChunkProgress("rerank", "train chunks with candidates"))


@stage_task("compute_influences")
def compute_metagradients(stage: MagicInput) -> ScoresRef:
    """Method magic's scores: one block of queries per Dask task, each one reverse pass through the replayed training; resumes where it stopped."""
    return metagradients.run(stage, client_factory=lambda: dask_client(stage.compute, False), on_progress=ChunkProgress("compute_influences", "query blocks"))


@stage_task("validate")
def validate_run(stage: ValidationInput) -> ValidationRef:
    """The run's LDS: retrain on random subsets, one Dask task each (resumed per subset), and rank-correlate."""
    return validation.run(stage, client_factory=lambda: dask_client(stage.compute, True), on_progress=ChunkProgress("validate", "retrained subsets"))
