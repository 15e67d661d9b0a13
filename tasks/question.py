"""The on-demand question's task: new queries against a finished run's training index, and its top-k artifact."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact

from influence_core.pipeline.score import query
from influence_core.pipeline.report.report import table_records
from influence_core.pipeline.specs import SearchSpec
from influence_core.pipeline.store.run_store import RunStore

from .policy import is_transient
from .publish import TABLE_MAX_K


@task(name="answer_question", retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=is_transient)
def answer_question(run: RunStore, queries: str, top_k: int, output: RunStore, search: SearchSpec, rerank: int | None = None) -> dict[str, Any]:
    """Score the queries against the run's index (no training gradient; by its FAISS index when `search` says so;
    over a compressed index, each query's `rerank` candidates a side scored again exactly), write the answer,
    publish its top-k table."""
    found, rows, method = query.ask(run, queries, top_k, output, search, endpoint_field="storage.endpoint_url", rerank=rerank)
    shown = [row.first(TABLE_MAX_K) for row in rows]
    create_table_artifact(table_records(shown), key="influence-question", description=f"{len(rows)} new queries against {run.output_url}'s training index ({method})")
    return {"run": run.output_url, "answer": output.influence_url, "queries": len(rows), "work": found.work.as_dict(), "search": found.search}
