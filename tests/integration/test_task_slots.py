"""How work is placed on a cluster: tasks of several torch threads never oversubscribe a machine's cores (`task_slots`
counts what fits per machine, `throttled` never runs more than that at once; a real LocalCluster of 2 single-threaded
workers), and small work (a small index's products, factor passes, an index pass) stays in the flow's process, on as
many threads as the local cluster has workers, up to a bound that depends on whether the cluster would have to start."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from dask.system import CPU_COUNT
from distributed import Client

from influence_core.pipeline.runtime.cluster import dask_client, in_process_flops, in_process_threads, is_running, ran_here, runs_here, shared_clusters, task_slots, throttled
from influence_core.pipeline.specs import ComputeSpec


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


@pytest.mark.parametrize(
    ("cluster", "workers", "expected"),
    [("local", 2, 3.0 / 0.2 * 85e9 * 2), ("local", 16, 3.0 / 0.2 * 85e9 * 16), ("local", 1, float("inf")), ("sequential", 2, 1e11), ("address", 2, 1e11)],
)
def test_a_cold_local_cluster_leaves_more_work_to_the_flows_process(cluster: str, workers: int, expected: float) -> None:
    """What w single-threaded workers do in 5× the 3 s start they would need first (so the start costs at most 20%),
    at 85 GFLOP/s a core; only a local cluster's work moves here, on as many threads as it has workers."""
    address = {"address": "tcp://127.0.0.1:8786"} if cluster == "address" else {}
    spec = ComputeSpec(cluster=cluster, n_workers=workers, **address)
    assert in_process_flops(spec) == pytest.approx(expected)
    assert in_process_threads(spec) == (workers if cluster == "local" else 1)
    assert runs_here(spec, min(0.99 * expected, 1e15)) == (cluster == "local")
    assert not runs_here(spec, 1.01 * expected)


@pytest.mark.parametrize("gflop", [0.0, 7.5])
def test_compute_in_process_gflop_sets_the_bound_whatever_the_cluster(gflop: float) -> None:
    for spec in (ComputeSpec(cluster="local", n_workers=2, in_process_gflop=gflop), ComputeSpec(cluster="sequential", in_process_gflop=gflop)):
        assert in_process_flops(spec) == gflop * 1e9
    assert runs_here(ComputeSpec(cluster="local", in_process_gflop=gflop), 7e9) == (gflop > 7)  # 0: every task on the workers


def test_a_running_shared_cluster_keeps_the_warm_bound() -> None:
    spec = ComputeSpec(cluster="local", n_workers=2)
    with shared_clusters():
        assert not is_running(spec) and in_process_flops(spec) == pytest.approx(2.55e12)
        with dask_client(spec, thread_safe=True) as client:
            assert client is not None and is_running(spec)
            assert in_process_flops(spec) == 1e11
    assert not is_running(spec)  # closed with the session


def test_the_summary_says_on_how_many_threads_and_under_which_bound_the_work_ran_here() -> None:
    two, one = ComputeSpec(cluster="local", n_workers=2), ComputeSpec(cluster="local", n_workers=1)
    assert ran_here(two, 44.2e9, 2.55e12) == "in the flow's process on 2 threads (44.2 GFLOP of at most 2,550: no workers started)"
    assert ran_here(one, 1e12, float("inf")) == "in the flow's process on 1 thread (1,000.0 GFLOP; one worker would be no faster: no workers started)"
