"""Calling stage tasks from the flow: one input each, checked once against the store, outcomes recorded."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TypeVar

from prefect.tasks import Task

from influence_core.pipeline.stages.training import query_metrics
from influence_core.pipeline.store.refs import DataRef, ModelRef, StageRef
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.store.stage import StageInput, producer

R = TypeVar("R", bound=StageRef)


class StageRunner:
    """Calls stage tasks, bypassing Prefect's cache when the store no longer holds the output, and records outcomes."""

    def __init__(self, store: RunStore, checkpoint: Callable[[], None] = lambda: None) -> None:
        self.store, self.checkpoint = store, checkpoint  # called before each stage: may stop the run (a signal seen)
        self.started = datetime.now(timezone.utc)
        self.refs: dict[str, StageRef] = {}
        self.outcomes: dict[str, dict[str, Any]] = {}

    def __call__(self, stage: Task[..., R], stage_input: StageInput[R], member: int = 0, variant: str = "") -> R:
        """Run `stage` on its input. The input's call reads the manifest here, once; the task's body shares the answer.
        An ensemble's member m > 0 is recorded as `stage[m]` (member 0 under the stage's own name); a second call of
        a stage in one run (the exact query factors beside a compressed index's) as `stage (variant)`."""
        self.checkpoint()
        present = stage_input.call.existing() is not None
        wall = time.perf_counter()
        name = (f"{stage.name}[{member}]" if member else stage.name) + (f" ({variant})" if variant else "")
        named = {"task_run_name": name} if member or variant else {}  # the Prefect UI shows member m's task run as stage[m]
        state = stage.with_options(refresh_cache=not present, **named)(stage_input, return_state=True)
        ref: R = state.result().moved(self.store.resolve)  # stored relative to the output's root, which may have moved
        if state.name == "Cached":
            outcome = "cached"
        else:
            mine = ref.producer == producer() and ref.created_at >= self.started  # not a concurrent run's work
            outcome = "computed" if mine else "found complete"
        self.refs[name] = ref
        work = ref.model_dump(include={"work", "metrics", "n_chunks", "chunks_computed", "gradient_rows", "self_influence", "candidates", "parameters", "compression", "bytes_per_row", "skipped", "ran", "side", "sides", "total_bytes", "dim", "exact_dim", "probe"})  # what the stage did
        if getattr(ref, "spread", None) is not None:  # method magic's scores: their largest over their median
            work["spread"] = ref.spread  # type: ignore[attr-defined]
        self.outcomes[name] = {"outcome": outcome, "seconds": ref.seconds, "wall_seconds": round(time.perf_counter() - wall, 3), "url": ref.url, "fingerprint": ref.fingerprint, **work}
        return ref

    def add_query_metrics(self, model: ModelRef, data: DataRef, device: str) -> None:
        """fit_model's outcome gets the model's loss (and accuracy) on this run's queries, evaluated now: its stored
        output, reused by runs asking other queries, holds the training rows' alone."""
        self.outcomes["fit_model"]["metrics"] = {**self.outcomes["fit_model"].get("metrics", {}), **query_metrics(model, data, self.store, device)}
