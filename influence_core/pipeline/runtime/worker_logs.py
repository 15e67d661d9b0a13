"""The library's log lines (a long solve's progress) from Dask workers, re-emitted in the driver's thread.

A task on a worker logs to the worker process's `influence_core` logger, which by default drops INFO and reaches no
run log. `worker_library_logs` gives it the driver's level and progress cadence for the task's duration;
`forwarded_library_logs` carries its records to the driver (distributed's ForwardLoggingPlugin) and hands them to
the driver's own loggers from the thread that waits on the tasks, where the run's log handlers (Prefect's among
them) find the run they belong to. Distributed's own `forward_logging` re-emits them in the client's event-loop
thread instead, outside that run.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING
from uuid import uuid4

from ... import solvers

if TYPE_CHECKING:
    from distributed import Client

LIBRARY = "influence_core"


def driver_logging() -> tuple[int, float]:
    """What a task needs to log as the driver would: the library logger's effective level and the progress cadence."""
    return logging.getLogger(LIBRARY).getEffectiveLevel(), solvers.PROGRESS_SECONDS


@contextmanager
def worker_library_logs(level: int, progress_seconds: float) -> Iterator[None]:
    """The body logs at the driver's `level` and solves report every `progress_seconds`, as in the driver."""
    library = logging.getLogger(LIBRARY)
    before = library.level, solvers.PROGRESS_SECONDS
    library.setLevel(level)
    solvers.PROGRESS_SECONDS = progress_seconds
    try:
        yield
    finally:
        library.setLevel(before[0])
        solvers.PROGRESS_SECONDS = before[1]


@contextmanager
def forwarded_library_logs(client: Client | None) -> Iterator[Callable[[], None]]:
    """Yields `drain()`: call it from the waiting thread to re-emit the records the workers have sent so far (and
    it runs once more on exit). With no client (tasks run here) there is nothing to forward."""
    if client is None:
        yield lambda: None
        return
    from distributed.diagnostics.plugin import ForwardLoggingPlugin

    topic = f"influence-core-logs-{uuid4().hex}"
    records: queue.SimpleQueue = queue.SimpleQueue()
    client.subscribe_topic(topic, lambda event: records.put(event[1]))
    client.register_plugin(ForwardLoggingPlugin(LIBRARY, logging.NOTSET, topic), name=topic)

    def drain() -> None:
        while True:
            try:
                record = logging.makeLogRecord(records.get_nowait())
            except queue.Empty:
                return
            logging.getLogger(record.name).handle(record)

    try:
        yield drain
    finally:
        drain()
        client.unregister_worker_plugin(topic)
        client.unsubscribe_topic(topic)
