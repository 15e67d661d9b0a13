"""Dask clusters by kind: local processes, one worker per GPU, an existing scheduler, or none."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import dask
import torch
from dask.system import CPU_COUNT
from distributed import Client, LocalCluster, as_completed
from distributed.comm.addressing import get_address_host, parse_address, parse_host_port

from ...errors import ConfigError
from ..specs import ClusterKind, ComputeSpec

IN_PROCESS_FLOPS = 1e11  # with the cluster up: ~1.2 s of one core (85 GFLOP/s on the 2-core CI machine)
CORE_FLOPS, CLUSTER_START_SECONDS = 85e9, 3.0  # one core's GEMM rate; a local cluster's start with its workers' imports
OVERHEAD_SHARE = 0.2  # the most of a stage's time a cluster's start may take (the project's 1.2x overhead budget)
WORKER_EXIT_SECONDS = 60.0  # a worker process exits in seconds; one still alive after this is killed
PROBE_TIMEOUT = 3.0  # seconds: an unreachable scheduler is reported at once, not after the client's 20 s timeout


class _Shared:
    """Clusters kept open by `shared_clusters()` sessions, keyed by what starts them; closed by the last session."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions = 0
        self.clusters: dict[tuple[str, int], tuple[LocalCluster, Client]] = {}

    def client(self, kind: ClusterKind, spec: ComputeSpec) -> Client:
        key = (kind.value, spec.n_workers)
        with self.lock:
            held = self.clusters.get(key)
            if held is not None and held[1].status != "running":  # a cluster that died since: start another
                self._close(self.clusters.pop(key))
                held = None
            if held is None:
                cluster = _start_cluster(kind, spec)
                held = self.clusters[key] = (cluster, Client(cluster))
            return held[1]

    def enter(self) -> None:
        with self.lock:
            self.sessions += 1

    def exit(self) -> None:
        with self.lock:
            self.sessions -= 1
            if self.sessions == 0:
                for held in self.clusters.values():
                    self._close(held)
                self.clusters.clear()

    @staticmethod
    def _close(held: tuple[LocalCluster, Client]) -> None:
        cluster, client = held
        client.close()
        close_cluster(cluster)


_SHARED = _Shared()


def is_running(spec: ComputeSpec) -> bool:
    """Whether a `shared_clusters()` session already holds a running cluster of this spec (no start to pay)."""
    with _SHARED.lock:
        held = _SHARED.clusters.get((ClusterKind(spec.cluster).value, spec.n_workers))
        return held is not None and held[1].status == "running"


def in_process_flops(compute: ComputeSpec) -> float:
    """The most work (FLOPs) of a stage's tasks that runs in this process (`in_process_threads`) rather than on the
    cluster: compute.in_process_gflop when set; else IN_PROCESS_FLOPS when the cluster is up or is not local, and
    when a local cluster would have to start, what its w workers do in OVERHEAD_SHARE⁻¹ times that start (2,550 GFLOP
    for 2), so the start never costs more than the project's 20% overhead budget; with one worker, any (one thread
    here is no slower than one worker). Threads here do the work as fast as the workers (W3's factor passes 1.45 s
    on 2 threads, 1.46 s in the library); larger work goes to the workers, whose processes bound its memory and
    outlive a crash."""
    if compute.in_process_gflop is not None:
        return compute.in_process_gflop * 1e9
    if compute.cluster != ClusterKind.local or is_running(compute):
        return IN_PROCESS_FLOPS
    workers = compute.n_workers
    return math.inf if workers == 1 else max(IN_PROCESS_FLOPS, CLUSTER_START_SECONDS / OVERHEAD_SHARE * CORE_FLOPS * workers)


def in_process_threads(compute: ComputeSpec) -> int:
    """Threads that run a stage's tasks in this process: a local cluster's workers (each single-threaded) if it were
    started, so the same tasks run as many at once; one for every other kind (sequential asks for one at a time)."""
    return compute.n_workers if compute.cluster == ClusterKind.local else 1


def runs_here(compute: ComputeSpec, flops: float, eligible: bool | None = None) -> bool:
    """Whether a stage's tasks of `flops` FLOPs in all run in this process instead of on the cluster's workers: work
    that may (`eligible`; by default a local cluster's) under `in_process_flops`."""
    may = compute.cluster == ClusterKind.local if eligible is None else eligible
    return may and flops < in_process_flops(compute)


def ran_here(compute: ComputeSpec, flops: float, bound: float) -> str:
    """Where a summary says a stage's tasks ran, when in this process: on how many threads, their work and its bound."""
    threads = in_process_threads(compute)
    limit = "; one worker would be no faster" if math.isinf(bound) else f" of at most {bound / 1e9:,.0f}"
    return f"in the flow's process on {threads} thread{'s' if threads > 1 else ''} ({flops / 1e9:,.1f} GFLOP{limit}: no workers started)"


@dataclass(frozen=True)
class Placement:
    """Where a stage's tasks run, decided once before they start: here on `threads` threads, or on the cluster."""

    compute: ComputeSpec
    flops: float
    bound: float
    here: bool

    @property
    def threads(self) -> int:
        return in_process_threads(self.compute)

    def client(self, factory: Callable[[], AbstractContextManager[Client | None]]) -> AbstractContextManager[Client | None]:
        """No client when the tasks run here; else the one `factory` opens (None for a sequential cluster)."""
        return nullcontext() if self.here else factory()

    @property
    def ran(self) -> str:
        """What the stage's summary says under `ran`."""
        return ran_here(self.compute, self.flops, self.bound) if self.here else ClusterKind(self.compute.cluster).value


def place(compute: ComputeSpec, flops: float, eligible: bool | None = None) -> Placement:
    """Where tasks of `flops` FLOPs in all run (`runs_here`)."""
    return Placement(compute, flops, in_process_flops(compute), runs_here(compute, flops, eligible))


@contextmanager
def shared_clusters() -> Iterator[None]:
    """Within it, the clusters `dask_client` starts stay up for later stages (of any thread of this process) and are
    closed when the last such session ends: a run pays a cluster's start and its workers' imports once, not per stage."""
    _SHARED.enter()
    try:
        yield
    finally:
        _SHARED.exit()


@contextmanager
def dask_client(spec: ComputeSpec, thread_safe: bool) -> Iterator[Client | None]:
    """A client for the configured cluster (None for sequential); a cluster started here is closed on exit, unless
    a `shared_clusters()` session keeps it for the next stage."""
    kind = ClusterKind(spec.cluster)
    if kind is ClusterKind.sequential:
        yield None
    elif kind is ClusterKind.address:
        with Client(spec.address, timeout="20s") as client:
            _check_threads(client, spec, thread_safe)
            yield client
    else:
        logging.getLogger("distributed").setLevel(logging.WARNING)  # the in-process scheduler's chatter
        if _SHARED.sessions:
            yield _SHARED.client(kind, spec)
            return
        cluster = _start_cluster(kind, spec)
        try:
            with Client(cluster) as client:
                yield client
        finally:
            close_cluster(cluster)


def _machine_cores() -> int:
    """The cores of the machine this runs on, as Dask counts them (cgroup and affinity limits included)."""
    return CPU_COUNT


def task_slots(client: Client, threads: int) -> int:
    """How many tasks of `threads` torch threads each may run at once: per machine of the cluster, its cores //
    threads (at least 1), at most its workers' threads. More oversubscribe the cores: on 2 cores, two retrainings of
    2 threads each at once took 80-200 s each, where one alone takes 37 s."""
    cores, nthreads = client.run(_machine_cores), client.nthreads()
    hosts: dict[str, list[str]] = {}
    for address in cores:
        hosts.setdefault(get_address_host(address), []).append(address)
    return sum(min(sum(nthreads[a] for a in workers), max(1, cores[workers[0]] // threads)) for workers in hosts.values())


def throttled(client: Client, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], slots: int) -> Iterator[tuple[int, Any]]:
    """(i, fn(*calls[i])) as each finishes, with at most `slots` tasks submitted at once (each retried twice on a
    lost worker); the rest wait here, not on the workers."""
    queue = iter(range(len(calls)))
    futures = {client.submit(fn, *calls[i], pure=False, retries=2): i for i in (next(queue) for _ in range(min(slots, len(calls))))}
    running = as_completed(list(futures))
    try:
        for future in running:
            following = next(queue, None)
            if following is not None:
                submitted = client.submit(fn, *calls[following], pure=False, retries=2)
                futures[submitted] = following
                running.add(submitted)
            yield futures[future], future.result()
    finally:
        for future in futures:
            future.cancel()  # a failed or abandoned run leaves nothing running


def close_cluster(cluster: LocalCluster) -> None:
    """Close the workers, giving each process WORKER_EXIT_SECONDS to exit (a nanny's own 4 s run out while a worker
    that imported torch and zarr exits on a busy machine, and it then kills it with a warning), then the cluster."""

    async def close_workers() -> None:
        await asyncio.gather(*(worker.close(timeout=WORKER_EXIT_SECONDS) for worker in list(cluster.workers.values())))

    cluster.sync(close_workers)
    cluster.close()


def check_scheduler(spec: ComputeSpec) -> None:
    """For cluster=address, fail within PROBE_TIMEOUT seconds, naming compute.address, when nothing answers there."""
    if spec.cluster != ClusterKind.address.value or spec.address is None:
        return
    try:
        protocol, location = parse_address(spec.address)
        host, port = parse_host_port(location) if protocol in ("tcp", "tls") else (None, None)
    except ValueError as exc:
        raise ConfigError("compute.address", f"{spec.address!r} is not a scheduler address ({exc})", "give it as tcp://host:port, e.g. tcp://127.0.0.1:8786") from None
    if host is None:
        return  # other transports (ucx, inproc, ws) are left to the client's own handshake
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT).close()
    except OSError as exc:
        raise ConfigError(
            "compute.address", f"no Dask scheduler answers at {spec.address} ({exc.strerror or exc})", "start the scheduler (dask scheduler) or correct compute.address"
        ) from None


def check_local_workers(spec: ComputeSpec) -> None:
    """For cluster=local, at most one worker process per core: more, each with a memory limit of total/n, pause and
    restart in a loop instead of computing."""
    if spec.cluster == ClusterKind.local.value and spec.n_workers > CPU_COUNT:
        raise ConfigError(
            "compute.n_workers", f"{spec.n_workers} worker processes on the {CPU_COUNT} cores here would each get 1/{spec.n_workers} of the memory and stall",
            f"set compute.n_workers to at most {CPU_COUNT} (one single-threaded worker per core)",
        )


def _worker_environ() -> dict[str, object]:
    """Dask's environment for new worker processes less MALLOC_TRIM_THRESHOLD_: setting it turns off glibc's dynamic
    mmap threshold, so every large tensor a task allocates is a fresh mapping whose pages fault in again (W4's
    covariance pass took 18.3 s in a worker with it, 11.9 s without, 11.7 s in-process; one thread each)."""
    return {k: v for k, v in dask.config.get("distributed.nanny.pre-spawn-environ").items() if k != "MALLOC_TRIM_THRESHOLD_"}


def _start_cluster(kind: ClusterKind, spec: ComputeSpec) -> LocalCluster:
    """One single-threaded worker process per slot: torch parallelises inside each task. Each nanny reads the
    workers' environment once, when it is made, so a restarted worker gets the same."""
    os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)  # left by an earlier cluster's nannies, it would be inherited
    with dask.config.set({"distributed.nanny.pre-spawn-environ": _worker_environ()}):
        return _new_cluster(kind, spec)


def _new_cluster(kind: ClusterKind, spec: ComputeSpec) -> LocalCluster:
    if kind is ClusterKind.local:
        return LocalCluster(n_workers=spec.n_workers, threads_per_worker=1, processes=True, dashboard_address=":0")
    if not torch.cuda.is_available():
        raise ConfigError("compute.cluster", "cluster=cuda but no CUDA device is visible to torch", "use cluster=local on CPU machines, or run on a GPU host")
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError:
        raise ConfigError("compute.cluster", "cluster=cuda needs dask-cuda", "install the gpu extra: pip install 'influence-pipeline[gpu]'") from None
    return LocalCUDACluster(threads_per_worker=1, dashboard_address=":0")


def _check_threads(client: Client, spec: ComputeSpec, thread_safe: bool) -> None:
    """Refuse multi-threaded workers for a model that is not thread-safe, unless explicitly allowed."""
    threads = client.nthreads()
    crowded = {worker: n for worker, n in threads.items() if n > 1}
    if crowded and not thread_safe and not spec.allow_multithreaded_workers:
        raise ConfigError(
            "compute.address",
            f"workers {sorted(crowded)} run {max(crowded.values())} threads each, and this method is not thread-safe",
            "start workers with --nthreads 1, or set compute.allow_multithreaded_workers=true to accept the risk",
        )
