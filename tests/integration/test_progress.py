"""The progress artifact of a stage of many small chunks: created at the first chunk, then updated at most every
ARTIFACT_SECONDS and at the end (each update is a call to the Prefect API, which shares the flow's cores)."""

from __future__ import annotations

from uuid import UUID

import pytest

pytestmark = pytest.mark.usefixtures("prefect_api")


def artifact_percent(artifact_id: UUID) -> float:
    """The percentage the Prefect API holds for the artifact."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))
        return float(artifact.data)


def test_progress_artifact_is_throttled_and_ends_at_100(monkeypatch):
    """Chunks 1 and 2 of 10 within a second: the API keeps 10%; after ARTIFACT_SECONDS (set to 0), chunk 3 makes it
    30%; the last chunk, 100% whatever the time."""
    from prefect import flow

    from tasks import progress

    seen: list[float] = []

    @flow
    def chunks() -> None:
        bar = progress.ChunkProgress("index_training", "train chunks indexed")
        bar(1, 10)
        bar(2, 10)
        assert bar.artifact is not None
        seen.append(artifact_percent(bar.artifact))
        monkeypatch.setattr(progress, "ARTIFACT_SECONDS", 0.0)
        bar(3, 10)
        seen.append(artifact_percent(bar.artifact))
        monkeypatch.setattr(progress, "ARTIFACT_SECONDS", 3600.0)
        bar(9, 10)
        bar(10, 10)
        seen.append(artifact_percent(bar.artifact))

    chunks()
    assert seen == [10.0, 30.0, 100.0]
