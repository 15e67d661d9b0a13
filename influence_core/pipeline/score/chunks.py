"""Train-chunk tasks, shared by full and candidate scoring (stage 5) and the training index (stage 3b): one job type,
one worker cache, one marker scheme and one executor.

A task scores one train chunk against every query, writes its part, then leaves the marker
`{stage_url}/done/{index}`: the record (size, stamp, sha256) of every object it wrote (`integrity.py`). A chunk is
done only when its marker is there and each object it records still matches it (a deleted, truncated or
overwritten chunk is redone), so a rerun submits only the rest, and the stage's manifest takes the markers'
digests instead of reading the chunks again.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from distributed import Client

from ..store import integrity, storage
from ...batches import Batches
from ...examples import Inputs
from ...methods.scorer import Scorer
from ...self_influence import SelfInfluencePlan
from ...work import Work
from ..store.stage import MARKERS
from ..store.loading import batches_of, load_influence_model, read_factors, training_rows
from .score_input import Member, ScoringInput
from ..runtime.cluster import task_slots, throttled
from ..runtime.threads import TASK_THREADS, in_threads, torch_threads

Progress = Callable[[int, int], None]
KEPT_WORKERS = 2  # jobs whose loaded state a worker thread keeps (least recently used goes first)


class ChunkWorker:
    """What a worker process keeps between chunk tasks of one job: each ensemble member's scorer (its fitted influence
    model, query factors and self-influence plan), the training arrays, and what the job holds besides."""

    def __init__(self, job: ChunkJob) -> None:
        stage = job.stage
        self.x, self.y = training_rows(stage.data, job.options)
        train = batches_of(self.x, self.y, stage.method.batch_size)  # read once, shared by the members
        plans = [job.self_influence_plan(index) for index in range(len(stage.members))]
        self.scorers = [self._scorer(job, member, plan, train) for member, plan in zip(stage.members, plans)]
        self.held = job.hold(plans[0])

    def _scorer(self, job: ChunkJob, member: Member, plan: SelfInfluencePlan | None, train: Batches) -> Scorer:
        """One member's scorer: its influence model with its curvature, its query factors (read once for every thread
        of this process: `_FACTORS`) and its self-influence plan."""
        stage = job.stage
        im = load_influence_model(stage.method, member.model, stage.data, member.preconditioner, job.options, stage.compute.torch_device, train)
        factors = _FACTORS.get(f"{member.factors.url}#{member.factors.fingerprint}", lambda: read_factors(im, member.factors.url, job.options, self.x, self.y))
        return Scorer(im, factors, plan)

    def __call__(self, x: Inputs, y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Scores and self-influences of the rows (x, y): the members' mean, summed member by member so that a chunk's
        scores are held twice at most (a single model's are its own, unchanged)."""
        scores, values = self.scorers[0](x, y)
        for scorer in self.scorers[1:]:
            more, extra = scorer(x, y)
            scores, values = _added(scores, more), _added(values, extra)
        n = len(self.scorers)
        return _divided(scores, n), _divided(values, n)

    def entries(self, x: Inputs, y: torch.Tensor, queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Scores of chosen (query, row) entries of the rows (x, y) only (`Scorer.entries`): the members' mean."""
        total = self.scorers[0].entries(x, y, queries, rows)
        for scorer in self.scorers[1:]:
            total = total + scorer.entries(x, y, queries, rows)
        return _divided(total, len(self.scorers))  # type: ignore[return-value]

    def work(self) -> Work:
        """The work every member's influence model has counted so far."""
        total = Work()
        for scorer in self.scorers:
            total += scorer.im.work
        return total


def _added(total: torch.Tensor | None, more: torch.Tensor | None) -> torch.Tensor | None:
    """A member's output added to the others' sum (None: an output that is not computed)."""
    return None if total is None or more is None else total + more


def _divided(total: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The members' sum as their mean; a single model's output as it is."""
    return total if total is None or n == 1 else total / n


@dataclass(frozen=True)
class ChunkJob(ABC):
    """Everything a chunk task needs, by reference only (the stage's input, planned): a few kilobytes, never data."""

    stage: ScoringInput

    def open(self) -> Any:
        """What a worker process loads once for this job's tasks (`work()` counts what it did): scorers by default."""
        return ChunkWorker(self)

    @property
    def key(self) -> str:
        return self.stage.call.key

    @property
    def options(self) -> dict[str, Any]:
        return self.stage.store.options

    @property
    def influence_url(self) -> str:
        return self.stage.store.influence_url

    @property
    def task_threads(self) -> int:
        """Torch threads of one task: the cluster runs at most its cores // this many at once (`task_slots`)."""
        return TASK_THREADS

    def path(self, *parts: str) -> str:
        """A file of the stage's own directory (markers, parts, plans)."""
        return storage.join(self.stage.call.location.url, *parts)

    @property
    def base_url(self) -> str:
        """The folder of the output the chunks are written into: markers name objects relative to it."""
        return self.influence_url

    def marker_url(self, index: int) -> str:
        return self.path(MARKERS, str(index))

    def pending(self, needed: list[int]) -> list[int]:
        """The chunks of `needed` not done: without a marker, or with an object that no longer matches its record."""
        names = [name for name in storage.list_names(self.path(MARKERS), self.options) if name.isdigit()]
        markers = integrity.read_markers([self.marker_url(int(name)) for name in names], self.options)
        present = storage.object_stats(self.base_url, self.options) if markers else {}
        done = {int(url.rsplit("/", 1)[-1]) for url, entries in markers.items() if entries and not integrity.problems(self.base_url, entries, self.options, present=present)}
        return [i for i in needed if i not in done]

    def mark(self, index: int) -> None:
        """Record what chunk `index` wrote (each object read back and hashed), as its marker."""
        entries = integrity.record(self.base_url, self.objects(index), self.options)
        storage.write_json(self.marker_url(index), entries, self.options)

    def self_influence_plan(self, member: int) -> SelfInfluencePlan | None:
        """The self-influence plan member `member`'s scorer applies (None: no self-influence)."""
        return None

    def hold(self, plan: SelfInfluencePlan | None) -> Any:
        """What a ChunkWorker keeps for this job's tasks besides the scorers (open output arrays, candidates)."""
        return None

    @abstractmethod
    def objects(self, index: int) -> list[str]:
        """The objects chunk `index` writes, relative to `base_url`."""

    @abstractmethod
    def score(self, worker: Any, index: int) -> None:
        """Score (or index) train chunk `index` with what `open()` loaded, and write its part."""


class _Shared:
    """Read-only values the threads of this process load once between them, kept while one of them holds a value:
    the query factors, which no scorer writes to (a worker thread's scorer holds them; when its thread ends with
    the stage, they go)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

    def get(self, key: str, load: Callable[[], Any]) -> Any:
        """The value under `key`, loaded by the first thread that asks; the others wait for it."""
        with self._lock:
            value = self._values.get(key)
            if value is None:
                value = load()
                self._values[key] = value
            return value


_FACTORS = _Shared()


class _Kept(threading.local):
    """Each thread's own loaded jobs, least recently used first: one torch module must not serve two threads at once."""

    def __init__(self) -> None:
        self.jobs: OrderedDict[str, Any] = OrderedDict()


_WORKERS = _Kept()


def _worker(job: ChunkJob) -> Any:
    """Load once per thread (a worker process's, or one of `in_threads` here) and job; later tasks of the same job
    on that thread reuse it. Keyed by the job and where it writes: two outputs of the same parameters share a key but
    never a worker's open arrays."""
    where = f"{job.key}:{job.influence_url}"
    kept = _WORKERS.jobs
    if where not in kept:
        kept[where] = job.open()
        while len(kept) > KEPT_WORKERS:
            kept.popitem(last=False)
    kept.move_to_end(where)
    return kept[where]


def chunk_task(job: ChunkJob, index: int) -> dict[str, float]:
    """One task: score train chunk `index` against every query, write its part, then its marker. Returns the work
    this did (gradients captured, flops, and any solves of an exact self-influence)."""
    with torch_threads(TASK_THREADS):  # the same arithmetic on every cluster kind, sequential included
        worker = _worker(job)
        before = worker.work()
        job.score(worker, index)
        job.mark(index)
        return (worker.work() - before).as_dict()


def execute(job: ChunkJob, chunks: list[int], total: int, client: Client | None, on_progress: Progress | None = None, threads: int = 1) -> Work:
    """Run the chunk tasks, on the cluster or here on `threads` threads; report (done, total) as they finish; return
    the work done."""
    done, work = total - len(chunks), Work()
    if client is None:
        results: Iterator[dict[str, float]] = in_threads(chunk_task, [(job, index) for index in chunks], threads)
    else:
        results = (counted for _, counted in throttled(client, chunk_task, [(job, index) for index in chunks], task_slots(client, job.task_threads)))
    for counted in results:
        work += Work(**counted)
        done += 1
        if on_progress:
            on_progress(done, total)
    return work
