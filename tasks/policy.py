"""Cache and retry policy shared by every stage task."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from prefect import Task
from prefect.cache_policies import CachePolicy
from prefect.client.schemas.objects import State, TaskRun
from prefect.context import TaskRunContext

from influence_core import ConfigError, NumericalError
from influence_core.pipeline.stage import StageCall


@dataclass
class StagePolicy(CachePolicy):
    """Cache key = the stage key: input fingerprints, the stage's own config and the code version.

    Never the tensors: tasks only receive refs and specs. `planner` takes the task's arguments and returns the
    `StageCall`, which also tells the flow whether the store still holds the output.
    """

    planner: Optional[Callable[..., StageCall[Any]]] = None

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> Optional[str]:
        assert self.planner is not None
        return self.planner(**inputs).key


def is_transient(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry connection errors and lost workers; never bad input or numerical failures, which fail at once."""
    try:
        state.result(raise_on_failure=True)
    except (ConfigError, NumericalError, ValueError, TypeError, KeyError):
        return False
    except Exception:
        return True
    return False


STAGE_OPTIONS: dict[str, Any] = {
    "retries": 2,
    "retry_delay_seconds": [2, 10],
    "retry_condition_fn": is_transient,
    "persist_result": True,
    "result_serializer": "json",
}
