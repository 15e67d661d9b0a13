"""Progress of long stages: a Prefect progress artifact, a CLI bar on a terminal, and log lines."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from uuid import UUID

from prefect import get_run_logger
from prefect.exceptions import MissingContextError
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


ARTIFACT_SECONDS = 1.0  # the progress artifact is updated at most this often (and at the end): each update is a call to the API


class ChunkProgress:
    """Callable `(done, total)`, fed by the engine as units of work (train chunks, retrained subsets) finish."""

    def __init__(self, description: str, unit: str = "train chunks") -> None:
        self.description = description
        self.unit = unit
        self.artifact: UUID | None = None
        self.updated = -math.inf  # monotonic seconds of the artifact's last update
        self.bar: Progress | None = None
        self.task_id = None
        self.logged = -1

    def __call__(self, done: int, total: int) -> None:
        percent = 100.0 * done / max(total, 1)
        self._artifact(percent, done >= total)
        self._bar(done, total)
        decile = int(percent // 10)
        if decile != self.logged or done == total:
            self.logged = decile
            get_run_logger().info("%s: %d/%d %s (%.0f%%)", self.description, done, total, self.unit, percent)

    def _artifact(self, percent: float, finished: bool) -> None:
        """Created at the first call, then updated when ARTIFACT_SECONDS have passed, and at the end: a stage of many
        small chunks does not spend its cores on the API."""
        now = time.monotonic()
        if self.artifact is None:
            self.artifact = create_progress_artifact(percent, key="influence-progress", description=self.description)
        elif finished or now - self.updated >= ARTIFACT_SECONDS:
            update_progress_artifact(self.artifact, percent)
        else:
            return
        self.updated = now

    def _bar(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=False)
            if not self.bar.console.is_terminal:
                self.bar = None
                return
            self.bar.start()
            self.task_id = self.bar.add_task(self.description, total=total)
        self.bar.update(self.task_id, completed=done)
        if done >= total:
            self.bar.stop()


@contextmanager
def library_logs() -> Iterator[None]:
    """The library's log lines (a long solve's progress) at the run loggers' level while a stage runs: Prefect gives
    `influence_core` its handlers (PREFECT_LOGGING_EXTRA_LOGGERS) but no level, so its INFO lines stopped at the
    root's WARNING."""
    library = logging.getLogger("influence_core")
    before = library.level
    try:
        level = get_run_logger().getEffectiveLevel()
    except MissingContextError:  # the body called outside a run (a test calling `.fn`): the library's level stays
        level = before
    library.setLevel(level)
    try:
        yield
    finally:
        library.setLevel(before)
