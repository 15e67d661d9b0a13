"""The stage tasks (six, and the optional validation). Each returns a small ref; caching is keyed on fingerprints and config, never tensors."""

from __future__ import annotations

from prefect import task

from influence_core.pipeline.cluster import dask_client
from influence_core.pipeline import aggregation, preconditioner as preconditioner_stage, prepare, query_factors, scoring, training as training_stage, validation
from influence_core.pipeline.run_store import RunStore
from influence_core.pipeline.refs import DataRef, ModelRef, ScoresRef, StageRef, ValidationRef
from influence_core.pipeline.specs import METHOD_CLASSES, AggregateSpec, CandidatesSpec, ComputeSpec, DatasetSpec, MethodSpec, ModelSpec, TrainingSpec, ValidationSpec

from .policy import STAGE_OPTIONS, portable, stage_policy
from .progress import ChunkProgress


@task(name="prepare_data", cache_policy=stage_policy(prepare.plan), **STAGE_OPTIONS)
@portable
def prepare_data(spec: DatasetSpec, store: RunStore) -> DataRef:
    """Dataset → row-chunked Zarr arrays with a content fingerprint."""
    return prepare.run(spec, store)


@task(name="fit_model", cache_policy=stage_policy(training_stage.plan), **STAGE_OPTIONS)
@portable
def fit_model(spec: ModelSpec, training: TrainingSpec, data: DataRef, store: RunStore, threads: int) -> ModelRef:
    """Train the model (or load its checkpoint) and store its state_dict."""
    return training_stage.run(spec, training, data, store, threads)


@task(name="fit_preconditioner", cache_policy=stage_policy(preconditioner_stage.plan), **STAGE_OPTIONS)
@portable
def fit_preconditioner(method: MethodSpec, model: ModelRef, data: DataRef, store: RunStore, compute: ComputeSpec) -> StageRef:
    """Fit the curvature state of the chosen method and store it (K-FAC factor passes run on the cluster)."""
    return preconditioner_stage.run(method, model, data, store, compute, client_factory=lambda: dask_client(compute, METHOD_CLASSES[method.name].thread_safe))


@task(name="compute_test_factors", cache_policy=stage_policy(query_factors.plan), **STAGE_OPTIONS)
@portable
def compute_test_factors(method: MethodSpec, model: ModelRef, data: DataRef, preconditioner: StageRef, store: RunStore, threads: int, compute: ComputeSpec | None = None) -> StageRef:
    """(C + λI)⁻¹ ∇ℓ for every query, once per run; LiSSA's repeats run on the cluster (FastIF's parallel s_test)."""
    factory = None if compute is None else (lambda: dask_client(compute, METHOD_CLASSES[method.name].thread_safe))
    return query_factors.run(method, model, data, preconditioner, store, threads, client_factory=factory)


@task(name="compute_influences", cache_policy=stage_policy(scoring.plan), **STAGE_OPTIONS)
@portable
def compute_influences(
    compute: ComputeSpec, method: MethodSpec, aggregate: AggregateSpec, model: ModelRef, data: DataRef, preconditioner: StageRef, factors: StageRef, store: RunStore,
    candidates: CandidatesSpec | None = None,
) -> ScoresRef:
    """Scores (and self-influences) for every (query, training example), or FastIF's candidate scores, one train chunk per Dask task; resumes where it stopped."""
    thread_safe = METHOD_CLASSES[method.name].thread_safe
    return scoring.run(
        compute, method, aggregate, model, data, preconditioner, factors, store,
        client_factory=lambda: dask_client(compute, thread_safe),
        on_progress=ChunkProgress("compute_influences"), candidates=candidates,
    )


@task(name="aggregate", cache_policy=stage_policy(aggregation.plan), **STAGE_OPTIONS)
@portable
def aggregate(spec: AggregateSpec, scores: StageRef, store: RunStore) -> StageRef:
    """Top-k helpful and harmful, argmax and train totals, streamed over the scores."""
    return aggregation.run(spec, scores, store)


@task(name="validate", cache_policy=stage_policy(validation.plan), **STAGE_OPTIONS)
@portable
def validate_run(spec: ValidationSpec, model_spec: ModelSpec, training: TrainingSpec, data: DataRef, model: ModelRef, scores: StageRef, store: RunStore, threads: int, compute: ComputeSpec) -> ValidationRef:
    """The run's LDS: retrain on random subsets, one Dask task each (resumed per subset), and rank-correlate."""
    return validation.run(
        spec, model_spec, training, data, model, scores, store, threads,
        client_factory=lambda: dask_client(compute, True), on_progress=ChunkProgress("validate", "retrained subsets"),
    )
