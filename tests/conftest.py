"""Real parts for tests: a moto S3 server on 127.0.0.1, a Prefect API on a temporary database, a Dask LocalCluster."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator

import pytest

# Credentials for the local S3 server come from the environment, as in production; they are dummies here. Stage locks
# are this test process's own: xdist workers running the same small run at once would otherwise wait on each other's
# locks (tests of concurrent runs give their subprocesses a lock folder of their own).
os.environ.update(
    {
        "INFLUENCE_LOCK_DIR": tempfile.mkdtemp(prefix="influence-locks-"),
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "PREFECT_LOCAL_STORAGE_PATH": tempfile.mkdtemp(prefix="prefect-results-"),
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
)


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker's torch gets its share of the cores for intra-op threads: two workers of 2
    threads each on 2 cores spin on each other (five unit-test files: 211 s, against 45 s at 1 thread each)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch
        from dask.system import CPU_COUNT  # the cores as the pipeline counts them: affinity and cgroup limits included

        torch.set_num_threads(max(1, CPU_COUNT // workers))


_share_the_cores()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on a free port of 127.0.0.1; s3fs reaches it through endpoint_url."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket per test."""
    import s3fs

    name = f"test-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).mkdir(name)
    return name


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    """A real Prefect API on a temporary SQLite database, for the whole session. Flow runs in this process send no
    heartbeats: the engine joins its heartbeat thread, which sleeps in 1 s steps, at every flow run's end (0.5 s a run
    on average; a deployment's runs, in their own processes, keep theirs)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120), temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


@pytest.fixture(scope="session")
def dask_address(s3_endpoint: str) -> Iterator[str]:
    """A real LocalCluster with 2 single-threaded worker processes, reached by address as an existing cluster."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        yield cluster.scheduler_address
