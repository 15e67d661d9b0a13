"""Tasks of several torch threads never oversubscribe a machine's cores: `task_slots` counts what fits per machine,
and `throttled` never runs more than that at once (a real LocalCluster of 2 single-threaded workers)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from dask.system import CPU_COUNT
from distributed import Client

from influence_core.pipeline.runtime.cluster import task_slots, throttled


def _interval(i: int) -> tuple[int, float, float]:
    """Task i: its number and when it ran (sleeping long enough that two at once overlap)."""
    start = time.time()
    time.sleep(0.3)
    return i, start, time.time()


@pytest.fixture(scope="module")
def client(dask_address: str) -> Iterator[Client]:
    with Client(dask_address) as c:
        yield c


@pytest.mark.parametrize("threads", [1, 2, 64])
def test_slots_are_the_machines_cores_over_the_tasks_threads_at_most_its_workers(client: Client, threads: int) -> None:
    assert task_slots(client, threads) == min(2, max(1, CPU_COUNT // threads))


@pytest.mark.parametrize("slots", [1, 2])
def test_throttled_runs_at_most_slots_tasks_at_once_and_returns_each_result_by_its_call(client: Client, slots: int) -> None:
    results = dict(throttled(client, _interval, [(i,) for i in range(6)], slots))
    assert sorted(results) == list(range(6)) and all(results[i][0] == i for i in results)
    events = sorted([(start, 1) for _, start, _ in results.values()] + [(end, -1) for _, _, end in results.values()])
    running, most = 0, 0
    for _, step in events:
        running += step
        most = max(most, running)
    assert most == slots  # 2 workers: with slots 2 both run at once, with 1 never
