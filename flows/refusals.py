"""Refusals in the flow's logs: the one line `field: problem. Fix: ...`, never a traceback, in every run path."""

from __future__ import annotations

import logging
import weakref

from influence_core.errors import ConfigError

# Prefect logs a failed run's exception with its traceback on these loggers: the flow's and tasks' run loggers (in
# the CLI's process, `serve`, or a worker's flow-run subprocess) and the engine's own.
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs", "prefect.engine")


class RefusalWithoutTraceback(logging.Filter):
    """A record carrying a ConfigError becomes its one line, without the traceback; the same refusal is logged once
    (Prefect reports it again as the task's, the flow's and the engine's failure)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: weakref.WeakSet[BaseException] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, ConfigError):
            return True
        if exc in self.logged:
            return False
        self.logged.add(exc)
        record.msg, record.args, record.exc_info, record.exc_text = "%s", (str(exc),), None, None
        return True


def install() -> None:
    """Add the filter to Prefect's run loggers, once per process."""
    refusals = RefusalWithoutTraceback()
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RefusalWithoutTraceback) for f in logger.filters):
            logger.addFilter(refusals)
