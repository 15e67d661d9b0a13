"""Stage 4: the query factors (C + λI)⁻¹ ∇ℓ(z_test), computed once per run and stored; given a compressed training
index, a whitened method's factors are taken straight into its coordinates (`IndexProjection.queries`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zarr

from ..store import storage
from ... import examples
from ...errors import ConfigError
from ...methods import LissaInfluence
from ...index_projection import IndexProjection
from ...methods.influence_model import InfluenceFunctionModel
from ...reduction import summed_tasks
from ..store.refs import DataRef, FactorsRef, IndexRef, ModelRef, StageRef
from ..specs import ComputeSpec, MethodSpec
from ..runtime.threads import TASK_THREADS, torch_threads
from ...work import Work
from ..score.layout import MIN_TASKS
from ..store.loading import index_projection, load_influence_model, open_data
from ..runtime.worker_logs import driver_logging, forwarded_library_logs, worker_library_logs
from ..store.stage import StageCall, StageInput, StageLocation
from ..store.run_store import RunStore


@dataclass(frozen=True)
class QueryFactorsInput(StageInput[FactorsRef]):
    """The method and its fitted curvature, the model, the data, the torch threads, where LiSSA's repeats run
    (`compute`'s cluster; None: here), and the compressed training index whose coordinates the factors may take."""

    method: MethodSpec
    model: ModelRef
    data: DataRef
    preconditioner: StageRef
    store: RunStore
    threads: int
    compute: ComputeSpec | None = None
    index: IndexRef | None = None

    @property
    def device(self) -> str:
        """The torch device the factors are computed on (`compute.device`; the CPU without a compute spec)."""
        return "cpu" if self.compute is None else self.compute.torch_device

    def plan(self) -> StageCall[FactorsRef]:
        """The stage's key (the index's only when given); where LiSSA's repeats run (compute) is not part of it: every
        cluster kind gives the same bits."""
        # "curvature" names the preconditioner in stage keys and manifests already written: kept, so they still match
        inputs: dict[str, Any] = {"model": self.model, "data": self.data, "curvature": self.preconditioner}
        if self.index is not None:
            inputs["index"] = self.index
        return StageCall("compute_test_factors", FactorsRef, {"method": self.method.model_dump(mode="json")}, inputs, self.store, self.threads)


FACTOR_CHUNK_BYTES = 16 * 2**20  # stored chunks of query rows: small enough that writer and readers reuse their buffers


def chunk_rows(block: int, row_bytes: int) -> int:
    """Query rows per stored chunk: the most that fit FACTOR_CHUNK_BYTES and divide the solve block, so each block
    writes whole chunks (at least one row per chunk)."""
    limit = max(1, min(block, FACTOR_CHUNK_BYTES // row_bytes))
    return max(d for d in range(1, limit + 1) if block % d == 0)


def write_rows(array: zarr.Array, lo: int, rows: np.ndarray) -> None:
    """Rows lo.. of a row-chunked array, one stored chunk per call: zarr then encodes each chunk as given, where a
    write spanning chunks first copies every chunk into a fresh buffer filled with the fill value."""
    step = array.chunks[0]
    for start in range(0, len(rows), step):
        array[lo + start : lo + start + step] = rows[start : start + step]


def lissa_repeat(method: MethodSpec, model: ModelRef, data: DataRef, preconditioner: StageRef, options: dict[str, Any], device: str, index: int) -> tuple[np.ndarray, dict[str, float]]:
    """One LiSSA repeat's term of the dense query factors, for every query, and the work it did: one Dask task."""
    with torch_threads(TASK_THREADS):  # the same arithmetic on any cluster kind, sequential included
        im = load_influence_model(method, model, data, preconditioner, options, device)
        assert isinstance(im, LissaInfluence)
        arrays = open_data(data, options)
        x, y = examples.read(arrays["x_test"]), examples.read(arrays["y_test"])
        return im.repeat_factors(x, y, index).cpu().numpy(), im.work.as_dict()


def _add_terms(a: tuple[np.ndarray, dict[str, float]], b: tuple[np.ndarray, dict[str, float]]) -> tuple[np.ndarray, dict[str, float]]:
    """Two partial sums of repeat terms, with the work they counted."""
    return a[0] + b[0], {name: a[1][name] + b[1][name] for name in a[1]}


def _lissa_dense(method: MethodSpec, model: ModelRef, data: DataRef, preconditioner: StageRef, options: dict[str, Any], device: str, client_factory: Callable[[], Any] | None) -> tuple[np.ndarray, Work]:
    """FastIF's parallel s_test: the T repeats as tasks with their own seeds, added in the pairwise tree of the
    library's own sum (`reduction.py`), so every cluster kind and the library give the same bits."""
    calls = [(method, model, data, preconditioner, options, device, index) for index in range(getattr(method, "repeats"))]
    with client_factory() if client_factory is not None else nullcontext() as client:
        total, counted = summed_tasks(client, lissa_repeat, calls, _add_terms)
    return total, Work(**counted)


CG_BLOCK_ROWS = 16  # the fewest queries a block of a data-pass solver (CG) solves together: they share its Krylov space
LOG_POLL_SECONDS = 0.5  # while blocks run on workers, their log lines are re-emitted here at least this often


def solve_rows(n_test: int, im: InfluenceFunctionModel, width: int | None = None) -> int:
    """Queries per solve block: as many as fit the method's memory budget at `width` numbers a row (the factors'; an
    index's coordinates when the queries are projected from their captures); a method whose solve passes over the
    training data (CG) splits them further into MIN_TASKS blocks, each of at least CG_BLOCK_ROWS, so a cluster's
    workers share them. A function of the data and the method only: every cluster kind solves the same blocks."""
    rows = max(1, min(n_test, im.solve_block_bytes // (8 * (width or im.objective.space.dim))))
    return min(rows, max(CG_BLOCK_ROWS, math.ceil(n_test / MIN_TASKS))) if im.solves_on_data else rows


def factor_block(method: MethodSpec, model: ModelRef, data: DataRef, preconditioner: StageRef, options: dict[str, Any], device: str, lo: int, hi: int, logs: tuple[int, float]) -> tuple[np.ndarray, dict[str, float]] | ConfigError:
    """Queries lo..hi's factors and the work they took, logging as the driver does (`logs`): one Dask task. A
    refusal (CG at its cap names method.maxiter) is returned, not raised, so Dask does not retry it."""
    with torch_threads(TASK_THREADS), worker_library_logs(*logs):  # the same arithmetic on any cluster kind, sequential included
        im = load_influence_model(method, model, data, preconditioner, options, device)
        arrays = open_data(data, options)
        x, y = examples.read(arrays["x_test"], slice(lo, hi)), examples.read(arrays["y_test"], slice(lo, hi))
        try:
            return im.influence_factors(x, y).cpu().numpy(), im.work.as_dict()
        except ConfigError as refusal:
            return refusal


def _blocks_on_cluster(stage: QueryFactorsInput, spans: list[tuple[int, int]], client_factory: Callable[[], Any] | None) -> Iterator[tuple[int, np.ndarray, Work]]:
    """(first row, factors, work) of each block as it is solved: Dask tasks spread over the cluster's workers, whose
    progress lines reach this process's logs, or one block after another here."""
    common = (stage.method, stage.model, stage.data, stage.preconditioner, stage.store.options, stage.device)
    with client_factory() if client_factory is not None else nullcontext() as client, forwarded_library_logs(client) as drain:
        if client is None:
            solved: Iterable[tuple[int, Any]] = ((lo, factor_block(*common, lo, hi, driver_logging())) for lo, hi in spans)
        else:
            futures = {client.submit(factor_block, *common, lo, hi, driver_logging(), pure=False, retries=2): lo for lo, hi in spans}
            solved = ((futures[future], result) for future, result in _as_solved(futures, drain))
        for lo, result in solved:
            if isinstance(result, ConfigError):
                raise result
            yield lo, result[0], Work(**result[1])


def _as_solved(futures: dict[Any, int], drain: Callable[[], None]) -> Iterator[tuple[Any, Any]]:
    """(future, result) as each finishes, re-emitting the workers' log lines at least every LOG_POLL_SECONDS meanwhile."""
    from distributed import wait

    pending = set(futures)
    try:
        while pending:
            try:
                done, pending = wait(pending, timeout=LOG_POLL_SECONDS, return_when="FIRST_COMPLETED")
            except TimeoutError:  # none finished yet: pass on the lines that came meanwhile
                done = set()
            drain()
            for future in done:
                yield future, future.result()
    finally:
        for future in pending:
            future.cancel()


def _blocks_here(im: InfluenceFunctionModel, x_test: Any, y_test: Any, spans: list[tuple[int, int]], dense: np.ndarray | None) -> Iterator[tuple[int, np.ndarray, Work]]:
    """(first row, factors, work) of each block, solved in this process: cheap solves, or LiSSA's summed repeats finished."""
    for lo, hi in spans:
        x, y = examples.read(x_test, slice(lo, hi)), examples.read(y_test, slice(lo, hi))
        f = im.influence_factors(x, y) if dense is None else im.finish_factors(torch.from_numpy(dense[lo:hi]), x, y)
        yield lo, f.cpu().numpy(), Work()


def _projected_here(im: InfluenceFunctionModel, projection: IndexProjection, x_test: Any, y_test: Any, spans: list[tuple[int, int]]) -> Iterator[tuple[int, np.ndarray, Work]]:
    """(first row, factors in the index's coordinates, work) of each block, projected from the queries' captures."""
    for lo, hi in spans:
        yield lo, projection.queries(im, examples.read(x_test, slice(lo, hi)), examples.read(y_test, slice(lo, hi))).cpu().numpy(), Work()


def _compute(stage: QueryFactorsInput, loc: StageLocation, client_factory: Callable[[], Any] | None) -> dict[str, Any]:
    method, model, data, preconditioner, store = stage.method, stage.model, stage.data, stage.preconditioner, stage.store
    im = load_influence_model(method, model, data, preconditioner, store.options, stage.device)
    arrays = open_data(data, store.options)
    x_test, y_test = arrays["x_test"], arrays["y_test"]
    n_test = y_test.shape[0]
    work = Work()
    dense = None
    projection = None if stage.index is None else index_projection(im, data, store.options, stage.index.side or 0, stage.index.whitening_url)
    taken = projection is not None and projection.from_captures(im)  # else solved as without an index; scoring projects them
    if method.name == "lissa":
        dense, work = _lissa_dense(method, model, data, preconditioner, store.options, stage.device, client_factory)
    block = solve_rows(n_test, im, projection.dim if projection is not None and taken else None)
    spans = [(lo, min(lo + block, n_test)) for lo in range(0, n_test, block)]
    if taken:
        assert projection is not None
        blocks = _projected_here(im, projection, x_test, y_test, spans)
    else:
        blocks = _blocks_on_cluster(stage, spans, client_factory) if im.solves_on_data else _blocks_here(im, x_test, y_test, spans, dense)
    url = loc.path("factors.zarr")
    out = None
    with ThreadPoolExecutor(max_workers=1) as writer:  # a block is written while the next one is solved
        pending: Future | None = None
        for lo, f, done in blocks:
            work += done
            if out is None:
                group = storage.open_group(url, store.options, mode="w")
                # uncompressed: solved factors are dense floats that zstd shrinks by ~15% but slows every worker's read 3×
                out = storage.create_array(group, "factors", shape=(n_test, f.shape[1]), chunks=(chunk_rows(block, f.shape[1] * f.itemsize), f.shape[1]), dtype=str(f.dtype), compressors=None)
            if pending is not None:
                pending.result()  # one block in flight at most; a failed write fails the stage here
            pending = writer.submit(write_rows, out, lo, f)
        if pending is not None:
            pending.result()
    assert out is not None
    out.attrs["fingerprint"] = loc.key
    work += im.work
    return {"url": storage.join(url, "factors"), "fingerprint": loc.key, "shape": out.shape, "dtype": str(out.dtype), "work": work.as_dict(), "coordinates": "index" if taken else "parameters"}


def run(stage: QueryFactorsInput, client_factory: Callable[[], Any] | None = None) -> FactorsRef:
    """Solve for the query factors with `stage.threads` torch threads, or return the stored ones. LiSSA's repeats
    run as tasks on the cluster of `client_factory()` (a context manager yielding a Dask client or None), else here."""
    return stage.call.run(lambda loc: _compute(stage, loc, client_factory))
