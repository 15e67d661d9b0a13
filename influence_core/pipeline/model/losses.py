"""Loss names the pipeline's model spec accepts (each is a built-in Task, see influence_core.task)."""

from __future__ import annotations

from typing import Literal

LossName = Literal["cross_entropy", "mse"]
