"""Refusals in the flow's logs: the one line `field: problem. Fix: ...`, never a traceback, in every run path."""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

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
            return _without_refusal(record)
        if exc in self.logged:
            return False
        self.logged.add(exc)
        record.msg, record.args, record.exc_info, record.exc_text = "%s", (str(exc),), None, None
        record.refusal = True
        return True


# The engines' closing line of a refused task or flow run repeats the refusal in its state's message.
FINISHED_REFUSED = re.compile(r"^Finished in state Failed\('(?:Task|Flow) run encountered an exception:? (\w+): ([\w.\-]+): ")


def _without_refusal(record: logging.LogRecord) -> bool:
    """A run's `Finished in state Failed(...)` that repeats a refusal names only its field: the line itself is logged
    once, at ERROR. Every other record is left as it is."""
    found = FINISHED_REFUSED.match(record.getMessage())
    if found and found[1] in _refusal_names(ConfigError):
        record.msg, record.args = "Finished in state Failed (refused: %s)", (found[2],)
    return True


def _refusal_names(cls: type[BaseException]) -> set[str]:
    """The class names of ConfigError and its subclasses, as a state message spells them."""
    return {cls.__name__}.union(*(_refusal_names(sub) for sub in cls.__subclasses__()))


@contextmanager
def printed_by_caller() -> Iterator[None]:
    """Within it, refusals stay off the terminal's log output (the API's logs keep them): the CLI prints the line
    itself, once, when the run ends."""
    from prefect.logging.handlers import PrefectConsoleHandler

    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    for handler in consoles:
        handler.addFilter(_not_a_refusal)
    try:
        yield
    finally:
        for handler in consoles:
            handler.removeFilter(_not_a_refusal)


def _not_a_refusal(record: logging.LogRecord) -> bool:
    return not getattr(record, "refusal", False)


def install() -> None:
    """Add the filter to Prefect's run loggers, once per process."""
    refusals = RefusalWithoutTraceback()
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RefusalWithoutTraceback) for f in logger.filters):
            logger.addFilter(refusals)
