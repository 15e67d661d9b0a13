"""What influence attributes: the per-example training loss, the query measurement, Fisher targets and the modules
to track (a package, not `tasks.py`: the top-level `tasks/` holds the pipeline's Prefect tasks)."""

from .base import Task
from .builtin import IGNORE_INDEX, Classification, LanguageModelling, Regression, mask_prompt
from .loss_task import BUILTIN, LossFn, LossTask, resolve_task

__all__ = ["BUILTIN", "IGNORE_INDEX", "Classification", "LanguageModelling", "LossFn", "LossTask", "Regression", "Task", "mask_prompt", "resolve_task"]
