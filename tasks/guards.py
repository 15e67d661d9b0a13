"""The flow's plain helpers around its stages: cheap checks before computing, the run's lock and cluster session,
and the claim on the output. Plain functions, not tasks: they compute nothing worth caching or retrying."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from influence_core.pipeline.store import publish
from influence_core.pipeline.stages.aggregation import check_top_k
from influence_core.pipeline.score.candidate_scoring import check_knn_k
from influence_core.pipeline.store.loading import open_data
from influence_core.pipeline.model.models import check_queries, check_query_labels
from influence_core.pipeline.runtime.cluster import shared_clusters
from influence_core.pipeline.stages.preconditioner import check_method
from influence_core.pipeline.runtime.preflight import preflight
from influence_core.pipeline.store.refs import DataRef
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.store.runlock import exclusive_run
from influence_core.pipeline.score.scoring import space_warning
from influence_core.pipeline.sources.data import fewer_queries
from influence_core.pipeline.specs import AggregateSpec, CandidatesSpec, ComputeSpec, DatasetSpec, MethodSpec, ModelSpec, TrainingSpec
from influence_core.pipeline.score.token_scores import check_token_scores


def check_run(store: RunStore, compute: ComputeSpec, model: ModelSpec, training: TrainingSpec, fingerprint: str, overwrite: bool) -> None:
    """In seconds, before any stage computes or anything is written: output, cache and scheduler reachable, checkpoint
    and initial weights present, and the output this run's to write (or `overwrite`)."""
    preflight(store, compute, model, training)
    publish.check_owner(store, fingerprint, overwrite)


@contextmanager
def run_session(store: RunStore, on_wait: Callable[[str], None]) -> Iterator[None]:
    """The output's run lock (`on_wait` told once when another run holds it) and one cluster for every stage."""
    with exclusive_run(store, on_wait=on_wait), shared_clusters():
        yield


def check_data(
    data: DataRef, dataset: DatasetSpec, aggregate: AggregateSpec, candidates: CandidatesSpec, method: MethodSpec, model: ModelSpec, training: TrainingSpec, store: RunStore
) -> str | None:
    """Once the data's sizes are known, before training: top_k and knn_k fit the training set, the method fits the
    model, and the queries fit it (every run: the model may come from a run with other queries). Returns a warning
    when the source held fewer queries than dataset.n_test asked for."""
    check_top_k(aggregate, data.n_train)
    check_knn_k(candidates, data.n_train)
    arrays = open_data(data, store.options)
    check_method(method, model, training, data, arrays)
    check_queries(model, arrays)
    check_query_labels(model, data, arrays["y_test"])
    if aggregate.token_scores:
        check_token_scores(method, model, data, arrays)
    return fewer_queries(dataset, data.n_test)


def begin_output(store: RunStore, fingerprint: str, overwrite: bool, data: DataRef, aggregate: AggregateSpec) -> str | None:
    """Claim influence.zarr for this run (only now is it touched: bad input found earlier leaves it as it was); a
    warning when its disk cannot hold the scores."""
    publish.begin_run(store, fingerprint, overwrite)
    return space_warning(store, data, aggregate)
