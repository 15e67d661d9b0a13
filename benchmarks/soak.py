"""Soak: a small run, then 20 cached re-runs of it in one process, must not grow its memory or its open files.

    .venv/bin/python benchmarks/soak.py [runs]

Runs against a Prefect test-harness API (a temporary database) with a local Dask cluster for the first run.
After each run (and a garbage collection) it samples the process's RSS, open file descriptors and threads,
prints a table, and the growth from run 2 (the first cached one) to the last.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time

import psutil

from flows.parameters import RunParameters

CONFIG = {
    "dataset": {"n_train": 480, "n_test": 16, "chunk_rows": 128},
    "model": {"hidden": [16]},
    "training": {"epochs": 10},
    "method": {"name": "direct", "regularization": 1e-3},
    "compute": {"cluster": "local", "n_workers": 2, "train_chunk_rows": 128},
    "aggregate": {"top_k": 5, "report_queries": 3},
}


def sample(process: psutil.Process) -> tuple[float, int, int]:
    gc.collect()
    return process.memory_info().rss / 2**20, process.num_fds(), process.num_threads()


def main() -> None:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # before prefect is imported: the table, not 21 runs of logs
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry writes racing the runs for the SQLite lock
    from prefect.testing.utilities import prefect_test_harness

    from flows.influence_run import influence_run

    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    params = RunParameters.model_validate({"output_url": tempfile.mkdtemp(prefix="soak-"), **CONFIG})
    process = psutil.Process()
    rows = []
    with prefect_test_harness(server_startup_timeout=120):
        for i in range(1, runs + 1):
            start = time.perf_counter()
            summary = influence_run(**params.sections())
            seconds = time.perf_counter() - start
            outcomes = {s["outcome"] for s in summary["stages"].values()}
            rows.append((i, seconds, *sample(process), "+".join(sorted(outcomes))))
    print(f"{'run':>4} {'seconds':>8} {'RSS MB':>8} {'fds':>5} {'threads':>8}  stages")
    for i, seconds, rss, fds, threads, outcomes in rows:
        print(f"{i:>4} {seconds:>8.2f} {rss:>8.1f} {fds:>5} {threads:>8}  {outcomes}")
    second, last = rows[1], rows[-1]
    print(f"growth run 2 -> run {last[0]}: RSS {last[2] - second[2]:+.1f} MB, open files {last[3] - second[3]:+d}, threads {last[4] - second[4]:+d}")


if __name__ == "__main__":
    main()
