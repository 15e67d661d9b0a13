"""The closing task: report.png, summary.json, status=complete, and the Prefect artifacts people read."""

from __future__ import annotations

import base64
from datetime import datetime
from typing import Any

from prefect import task
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact

from influence_core.pipeline.store import publish, storage
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.store.refs import StageRef
from influence_core.pipeline.report.report import summary_markdown, table_records, validation_markdown
from influence_core.pipeline.specs import AggregateSpec

from .policy import is_transient

TABLE_MAX_K = 10  # helpful and harmful columns each in the table artifact; a wider table is unreadable in the UI


@task(name="publish", retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=is_transient)
def publish_run(store: RunStore, refs: dict[str, StageRef], config: dict[str, Any], stages: dict[str, dict[str, Any]], aggregate: AggregateSpec, started: datetime) -> dict[str, Any]:
    """Write the report and summary, mark the run complete, and publish the top-k table, report and summary artifacts."""
    shown = min(aggregate.top_k, TABLE_MAX_K)
    summary, table = publish.publish(store, refs, config, stages, aggregate.report_queries, shown, started)
    of = "" if shown == aggregate.top_k else f" (of top_k={aggregate.top_k}; all are in influence.zarr)"
    create_table_artifact(table_records(table), key="influence-topk", description=f"The {shown} most helpful and {shown} most harmful training examples{of} for the first {len(table)} queries")
    create_image_artifact(report_data_url(store), key="influence-report", description=f"report.png ({summary['report']}): queries beside their most helpful and most harmful training examples")
    create_markdown_artifact(summary_markdown(summary), key="influence-summary", description="Influence run summary")
    if "validation" in summary:
        create_markdown_artifact(validation_markdown(summary["validation"]), key="influence-validation", description="The run's linear datamodeling score")
    return summary


def report_data_url(store: RunStore) -> str:
    """report.png inline as a data: URL, so the UI shows it wherever the output lives (a worker's disk, a private
    bucket) without the browser needing access or credentials."""
    png = storage.read_bytes(store.url("report.png"), store.options)
    return "data:image/png;base64," + base64.b64encode(png).decode()
