"""Stage 5's train-chunk tasks, shared by full and candidate scoring: one job type, one worker cache, one marker
scheme and one executor.

A task scores one train chunk against every query, writes its part, then leaves the marker
`{stage_url}/done/{index}`. A chunk is done only when its marker and its written part are both in the store (a
marker alone never counts), so a rerun submits only the rest.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from distributed import Client, as_completed

from . import storage
from ..methods import InfluenceFunctionModel
from ..methods.scorer import Scorer
from ..self_influence import SelfInfluencePlan
from ..work import Work
from .loading import load_influence_model, open_data, read_factors
from .score_input import ScoringInput
from .threads import TASK_THREADS, torch_threads

Progress = Callable[[int, int], None]
KEPT_WORKERS = 2  # jobs whose loaded state a worker process keeps (least recently used goes first)


class ChunkWorker:
    """What a worker process keeps between chunk tasks of one job: the fitted influence model, the scorer of the
    query factors (with the job's self-influence plan), the training arrays, and what the job holds besides."""

    def __init__(self, job: ChunkJob) -> None:
        stage, options = job.stage, job.options
        self.im: InfluenceFunctionModel = load_influence_model(stage.method, stage.model, stage.data, stage.preconditioner, options, stage.compute.torch_device)
        arrays = open_data(stage.data, options)
        self.x, self.y = arrays["x_train"], arrays["y_train"]
        plan = job.self_influence_plan()
        self.scorer = Scorer(self.im, read_factors(self.im, stage.factors.url, options, self.x, self.y), plan)
        self.held = job.hold(plan)


@dataclass(frozen=True)
class ChunkJob(ABC):
    """Everything a chunk task needs, by reference only (the stage's input, planned): a few kilobytes, never data."""

    stage: ScoringInput

    @property
    def key(self) -> str:
        return self.stage.call.key

    @property
    def options(self) -> dict[str, Any]:
        return self.stage.store.options

    @property
    def influence_url(self) -> str:
        return self.stage.store.influence_url

    def path(self, *parts: str) -> str:
        """A file of the stage's own directory (markers, parts, plans)."""
        return storage.join(self.stage.call.location.url, *parts)

    def marked(self) -> set[int]:
        """Chunks whose completion marker is in the store."""
        return {int(name) for name in storage.list_names(self.path("done"), self.options) if name.isdigit()}

    def pending(self, needed: list[int]) -> list[int]:
        """The chunks of `needed` without both a marker and their written part."""
        done = self.marked() & self.written()
        return [i for i in needed if i not in done]

    def self_influence_plan(self) -> SelfInfluencePlan | None:
        """The self-influence plan the scorer applies (None: no self-influence)."""
        return None

    @abstractmethod
    def hold(self, plan: SelfInfluencePlan | None) -> Any:
        """What a worker keeps for this job's tasks besides the scorer (open output arrays, candidates)."""

    @abstractmethod
    def written(self) -> set[int]:
        """Chunks whose part is wholly in the store."""

    @abstractmethod
    def score(self, worker: ChunkWorker, index: int) -> None:
        """Score train chunk `index` and write its part."""


_WORKERS: OrderedDict[str, ChunkWorker] = OrderedDict()
_WORKERS_LOCK = threading.Lock()


def _worker(job: ChunkJob) -> ChunkWorker:
    """Load once per worker process and job; later tasks of the same job reuse it. Keyed by the job and where it
    writes: two outputs of the same parameters share a key but never a worker's open arrays."""
    where = f"{job.key}:{job.influence_url}"
    with _WORKERS_LOCK:
        if where not in _WORKERS:
            _WORKERS[where] = ChunkWorker(job)
            while len(_WORKERS) > KEPT_WORKERS:
                _WORKERS.popitem(last=False)
        _WORKERS.move_to_end(where)
        return _WORKERS[where]


def chunk_task(job: ChunkJob, index: int) -> dict[str, float]:
    """One task: score train chunk `index` against every query, write its part, then its marker. Returns the work
    this did (gradients captured, flops, and any solves of an exact self-influence)."""
    with torch_threads(TASK_THREADS):  # the same arithmetic on every cluster kind, sequential included
        worker = _worker(job)
        before = worker.im.work.copy()
        job.score(worker, index)
        storage.write_bytes(job.path("done", str(index)), b"", job.options)
        return (worker.im.work - before).as_dict()


def execute(job: ChunkJob, chunks: list[int], total: int, client: Client | None, on_progress: Progress | None = None) -> Work:
    """Run the chunk tasks, on the cluster or here; report (done, total) as they finish; return the work done."""
    done, work = total - len(chunks), Work()
    if client is None:
        results: Iterator[dict[str, float]] = (chunk_task(job, index) for index in chunks)
    else:
        futures = client.map(chunk_task, [job] * len(chunks), chunks, pure=False, retries=2)
        results = (future.result() for future in as_completed(futures))
    for counted in results:
        work += Work(**counted)
        done += 1
        if on_progress:
            on_progress(done, total)
    return work
