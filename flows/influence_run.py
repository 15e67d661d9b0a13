"""The influence flow: six cached, retryable stages from dataset to top-k, on a Dask cluster, into Zarr.

No `from __future__ import annotations` here: `serve()` runs the flow from a pickled copy of the function, which
carries the globals its code uses but not names that appear only in string annotations, and Prefect validates the
parameters against those annotations.
"""

import time
from datetime import datetime, timezone
from typing import Any, Callable, TypeVar

from prefect import flow, get_run_logger
from prefect.tasks import Task

from influence_core.pipeline.cluster import shared_clusters
from influence_core.pipeline import publish
from influence_core.pipeline.aggregation import check_top_k
from influence_core.pipeline.candidate_scoring import check_knn_k
from influence_core.pipeline.preconditioner import check_method
from influence_core.pipeline.preflight import preflight
from influence_core.pipeline.runlock import exclusive_run
from influence_core.pipeline.scoring import space_warning
from influence_core.pipeline.stage import producer
from influence_core.pipeline.run_store import RunStore
from influence_core.pipeline.refs import StageRef
from influence_core.pipeline.specs import AggregateSpec, CandidatesSpec, ComputeSpec, DatasetSpec, DigitsDataset, DirectMethod, MethodSpec, ModelSpec, StorageSpec, TrainingSpec, ValidationSpec
from tasks import aggregate, compute_influences, compute_test_factors, fit_model, fit_preconditioner, prepare_data, validate_run
from tasks.publish import publish_run

from . import refusals
from .parameters import RunParameters

refusals.install()  # wherever the flow is loaded (CLI, serve, a worker's flow run): refusals log one line, no traceback

R = TypeVar("R", bound=StageRef)


class StageRunner:
    """Calls stage tasks, bypassing Prefect's cache when the store no longer holds the output, and records outcomes."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.started = datetime.now(timezone.utc)
        self.refs: dict[str, StageRef] = {}
        self.outcomes: dict[str, dict[str, Any]] = {}

    def __call__(self, stage: Task[..., R], **inputs: Any) -> R:
        present = stage.cache_policy.plan(inputs).existing() is not None  # type: ignore[union-attr]
        wall = time.perf_counter()
        state = stage.with_options(refresh_cache=not present)(**inputs, return_state=True)
        ref: R = state.result().moved(self.store.resolve)  # stored relative to the output's root, which may have moved
        if state.name == "Cached":
            outcome = "cached"
        else:
            mine = ref.producer == producer() and ref.created_at >= self.started  # not a concurrent run's work
            outcome = "computed" if mine else "found complete"
        self.refs[stage.name] = ref
        work = ref.model_dump(include={"work", "n_chunks", "chunks_computed", "gradient_rows", "self_influence", "candidates", "parameters"})  # what the stage did
        self.outcomes[stage.name] = {"outcome": outcome, "seconds": ref.seconds, "wall_seconds": round(time.perf_counter() - wall, 3), "url": ref.url, "fingerprint": ref.fingerprint, **work}
        return ref


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
    preflight(store, params.compute, params.model)  # seconds, before any stage computes or anything is written
    fingerprint = params.run_fingerprint()
    publish.check_owner(store, fingerprint, params.overwrite)  # refused at once, before waiting or computing
    with exclusive_run(store, on_wait=get_run_logger().warning), shared_clusters():  # one cluster serves every stage
        return _stages(params, store, fingerprint)


def _stages(params: RunParameters, store: RunStore, fingerprint: str) -> dict[str, Any]:
    """The six stages, the optional validation and the closing publish, under the output's run lock."""
    run = StageRunner(store)
    data = run(prepare_data, spec=params.dataset, store=store)
    check_top_k(params.aggregate, data.n_train)
    check_knn_k(params.candidates, data.n_train)
    check_method(params.method, params.model, data)
    threads = params.compute.torch_threads
    model = run(fit_model, spec=params.model, training=params.training, data=data, store=store, threads=threads)
    preconditioner = run(fit_preconditioner, method=params.method, model=model, data=data, store=store, compute=params.compute)
    factors = run(compute_test_factors, method=params.method, model=model, data=data, preconditioner=preconditioner, store=store, threads=threads, compute=params.compute)
    publish.begin_run(store, fingerprint, params.overwrite)  # only now is influence.zarr touched: bad input found earlier leaves it as it was
    short = space_warning(store, data, params.aggregate)
    if short:
        get_run_logger().warning(short)
    scores = run(compute_influences, compute=params.compute, method=params.method, aggregate=params.aggregate, model=model, data=data, preconditioner=preconditioner, factors=factors, store=store, candidates=params.candidates)
    run(aggregate, spec=params.aggregate, scores=scores, store=store)
    if params.validation.subsets:
        run(validate_run, spec=params.validation, model_spec=params.model, training=params.training, data=data, model=model, scores=scores, store=store, threads=threads, compute=params.compute)
    return publish_run(store, run.refs, params.public_config(), run.outcomes, params.aggregate)
