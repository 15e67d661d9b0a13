"""Dask clusters by kind: local processes, one worker per GPU, an existing scheduler, or none."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from distributed import Client, LocalCluster

from .errors import ConfigError
from .specs import ClusterKind, ComputeSpec


@contextmanager
def dask_client(spec: ComputeSpec, thread_safe: bool) -> Iterator[Client | None]:
    """A client for the configured cluster (None for sequential); clusters started here are closed on exit."""
    kind = ClusterKind(spec.cluster)
    if kind is ClusterKind.sequential:
        yield None
    elif kind is ClusterKind.address:
        with Client(spec.address, timeout="20s") as client:
            _check_threads(client, spec, thread_safe)
            yield client
    else:
        logging.getLogger("distributed").setLevel(logging.WARNING)  # the in-process scheduler's chatter
        with _start_cluster(kind, spec) as cluster, Client(cluster) as client:
            yield client


def _start_cluster(kind: ClusterKind, spec: ComputeSpec) -> LocalCluster:
    """One single-threaded worker process per slot: torch parallelises inside each task."""
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
