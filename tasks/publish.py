"""The closing task: report.png, summary.json, status=complete, and the Prefect artifacts people read."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from influence_core.pipeline import publish
from influence_core.pipeline.store import RunStore
from influence_core.refs import StageRef
from influence_core.report import summary_markdown, table_records


@task(name="publish", retries=2, retry_delay_seconds=[2, 10])
def publish_run(store: RunStore, refs: dict[str, StageRef], config: dict[str, Any], stages: dict[str, dict[str, Any]], n_queries: int) -> dict[str, Any]:
    """Write the report and summary, mark the run complete, and publish the top-k table and summary artifacts."""
    summary, rows = publish.publish(store, refs, config, stages, n_queries)
    create_table_artifact(table_records(rows), key="influence-topk", description=f"Top training examples for the first {len(rows)} queries")
    create_markdown_artifact(summary_markdown(summary), key="influence-summary", description="Influence run summary")
    return summary
