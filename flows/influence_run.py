"""The influence flow: six cached, retryable stages from dataset to top-k, on a Dask cluster, into Zarr.

No `from __future__ import annotations` here: `serve()` runs the flow from a pickled copy of the function, which
carries the globals its code uses but not names that appear only in string annotations, and Prefect validates the
parameters against those annotations.
"""

from typing import Any, Callable

from prefect import flow, get_run_logger

from influence_core.pipeline.stages.metagradients import first_step_warning
from influence_core.pipeline.store.refs import DataRef, FactorsRef, ModelRef, ScoresRef
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.specs import AggregateSpec, CandidatesSpec, ComputeSpec, DatasetSpec, DigitsDataset, DirectMethod, MagicMethod, MethodSpec, ModelSpec, StorageSpec, TrainingSpec, ValidationSpec
from tasks import aggregate, compute_influences, compute_metagradients, compute_test_factors, fit_model, fit_preconditioner, index_training, prepare_data, rerank, validate_run
from tasks.guards import begin_output, check_data, check_run, run_session
from tasks.publish import publish_run
from tasks.runner import StageRunner
from tasks.stages import AggregationInput, IndexInput, MagicInput, Member, PreconditionerInput, PrepareInput, QueryFactorsInput, RerankInput, ScoringInput, TrainingInput, ValidationInput

from . import interrupts, refusals
from .parameters import RunParameters

refusals.install()  # wherever the flow is loaded (CLI, serve, a worker's flow run): refusals log one line, no traceback


def _described_sections(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Prefect takes a parameter's description in the run form from the docstring's Args: RunParameters' own."""
    fn.__doc__ = f"{fn.__doc__}\nArgs:\n" + "".join(f"    {name}: {field.description}\n" for name, field in RunParameters.model_fields.items())
    return fn


@flow(name="influence-run", log_prints=True, validate_parameters=True)
@_described_sections
def influence_run(
    output_url: str = "runs/demo",
    dataset: DatasetSpec = DigitsDataset(),
    model: ModelSpec = ModelSpec(),
    training: TrainingSpec = TrainingSpec(),
    method: MethodSpec = DirectMethod(),
    compute: ComputeSpec = ComputeSpec(),
    aggregate: AggregateSpec = AggregateSpec(),
    candidates: CandidatesSpec = CandidatesSpec(),
    validation: ValidationSpec = ValidationSpec(),
    storage: StorageSpec = StorageSpec(),
    overwrite: bool = False,
) -> dict[str, Any]:
    """Which training examples made the model predict this? Scores, top-k, self-influence and totals.

    One parameter per section of RunParameters, so a deployment's defaults and a run's parameters merge section by
    section (Prefect merges top-level parameters): `--param method='{"name": "cg"}'` keeps the deployment's output_url.
    """
    params = RunParameters.from_sections(
        output_url=output_url, dataset=dataset, model=model, training=training, method=method, compute=compute,
        aggregate=aggregate, candidates=candidates, validation=validation, storage=storage, overwrite=overwrite,
    )
    store = params.store()
    fingerprint = params.run_fingerprint()
    get_run_logger().info("Results go to %s", store.output_url)  # output_url resolved: {fingerprint} filled in
    check_run(store, params.compute, params.model, params.training, fingerprint, params.overwrite)  # refused at once, before waiting or computing
    with run_session(store, on_wait=get_run_logger().warning):
        return _stages(params, store, fingerprint)


def _stages(params: RunParameters, store: RunStore, fingerprint: str) -> dict[str, Any]:
    """The six stages, the optional validation and the closing publish, under the output's run lock."""
    run = StageRunner(store, checkpoint=interrupts.raise_if_interrupted)
    data = run(prepare_data, PrepareInput(params.dataset, store))
    if fewer := check_data(data, params.dataset, params.aggregate, params.candidates, params.method, params.model, params.training, store):
        get_run_logger().warning(fewer)
    model, scores, scoring, reranked = _magic(run, params, data, store, fingerprint) if isinstance(params.method, MagicMethod) else _influence(run, params, data, store, fingerprint)
    run.add_query_metrics(model, data, params.compute.torch_device)
    run(aggregate, AggregationInput(params.aggregate, scores, store, scoring, reranked))
    if params.validation.subsets:
        run(validate_run, ValidationInput(params.validation, params.model, params.training, data, model, scores, store, params.compute))
    interrupts.raise_if_interrupted()
    return publish_run(store, run.refs, params.public_config(), run.outcomes, params.aggregate, run.started)


def _influence(run: StageRunner, params: RunParameters, data: DataRef, store: RunStore, fingerprint: str) -> tuple[ModelRef, ScoresRef, ScoringInput, ScoresRef | None]:
    """Every member's model, curvature, index and query factors, then the scores, and over a compressed index the
    re-ranked candidates: the model's, the scores' and the re-ranking's refs, and the scoring input (per-token
    scores take its model, curvature and factors)."""
    members = [_member(run, params, data, store, index) for index in range(params.training.ensemble)]
    first, *others = members
    _begin_output(params, data, store, fingerprint)
    inputs = ScoringInput(params.compute, params.method, params.aggregate, first.model, data, first.preconditioner, first.factors, store, params.candidates, tuple(others), first.index)
    scores = run(compute_influences, inputs)
    return first.model, scores, inputs, _rerank(run, params, data, store, members, scores)


def _rerank(run: StageRunner, params: RunParameters, data: DataRef, store: RunStore, members: list[Member], scores: ScoresRef) -> ScoresRef | None:
    """Over a compressed index (with aggregate.rerank on): each member's exact query factors (compute_test_factors
    without the index, unless its factors are already exact), then each query's candidates scored again with them."""
    per_side = params.aggregate.rerank_per_side
    if not per_side or not any(member.index is not None and member.index.compression == "logra" for member in members):
        return None
    exact = [Member(m.model, m.preconditioner, m.factors if m.factors.coordinates == "parameters" else _exact_factors(run, params, data, store, m, index)) for index, m in enumerate(members)]
    first, *others = exact
    compute, method, aggregate = params.compute, params.method, params.aggregate
    return run(rerank, RerankInput(compute, method, aggregate, first.model, data, first.preconditioner, first.factors, store, None, tuple(others), scores=scores, per_side=per_side))


def _exact_factors(run: StageRunner, params: RunParameters, data: DataRef, store: RunStore, member: Member, index: int) -> FactorsRef:
    """A member's query factors in the method's own coordinates, as a run without an index solves them."""
    return run(compute_test_factors, QueryFactorsInput(params.method, member.model, data, member.preconditioner, store, params.compute.torch_threads, params.compute), index, "exact")


def _magic(run: StageRunner, params: RunParameters, data: DataRef, store: RunStore, fingerprint: str) -> tuple[ModelRef, ScoresRef, None, None]:
    """Method magic: the trained model, then the metagradients through its replayed training (no curvature)."""
    compute = params.compute
    if warning := first_step_warning(params.training, data.n_train):
        get_run_logger().warning(warning)
    model = run(fit_model, TrainingInput(params.model, params.training, data, store, compute.torch_threads, compute.torch_device))
    _begin_output(params, data, store, fingerprint)
    assert isinstance(params.method, MagicMethod)
    return model, run(compute_metagradients, MagicInput(compute, params.method, params.model, params.training, data, model, store)), None, None


def _begin_output(params: RunParameters, data: DataRef, store: RunStore, fingerprint: str) -> None:
    """Claim the output, just before scoring; warn when its disk cannot hold the scores."""
    short = begin_output(store, fingerprint, params.overwrite, data, params.aggregate)
    if short:
        get_run_logger().warning(short)


def _member(run: StageRunner, params: RunParameters, data: DataRef, store: RunStore, index: int) -> Member:
    """Ensemble member `index` (the model itself when there is one): trained with seed + index, its curvature, its
    training index (unless off, or with FastIF's candidates) and its query factors, each its own cached stage."""
    compute, threads = params.compute, params.compute.torch_threads
    model = run(fit_model, TrainingInput(params.model, params.training.member(index), data, store, threads, compute.torch_device), index)
    preconditioner = run(fit_preconditioner, PreconditionerInput(params.method, model, data, store, compute), index)
    indexed = compute.index_budget_gb > 0 and params.candidates.knn_k is None
    train_index = run(index_training, IndexInput(params.method, params.aggregate, model, data, preconditioner, store, compute), index) if indexed else None
    if train_index is not None and "warning" in train_index.probe:  # the compression costs more than the probe allows
        get_run_logger().warning(train_index.probe["warning"])
    # per-token scores split the factors by position in the model's coordinates: then the index's are not taken
    projected = train_index if train_index is not None and train_index.compression == "logra" and not params.aggregate.token_scores else None
    factors = run(compute_test_factors, QueryFactorsInput(params.method, model, data, preconditioner, store, threads, compute, projected), index)
    return Member(model, preconditioner, factors, train_index)
