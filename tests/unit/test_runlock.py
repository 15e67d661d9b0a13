"""The run lock of an output_url, locally (flock) and on the moto S3 server (conditional put and delete): one
holder at a time, released when its holder is SIGKILLed, and never taken from a holder on another host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from influence_core.pipeline.store import storage
from influence_core.pipeline.store.runlock import LOCK_NAME, exclusive_run
from influence_core.pipeline.store.run_store import RunStore

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> RunStore:
    if request.param == "local":
        return RunStore(output_url=str(tmp_path / "out"))
    endpoint, bucket = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket")
    return RunStore(output_url=f"s3://{bucket}/out", storage={"endpoint_url": endpoint})


def test_a_second_run_waits_for_the_first(store):
    events: list[str] = []
    first_in, second_waits = threading.Event(), threading.Event()

    def second() -> None:
        def waiting(message: str) -> None:
            events.append("second waits")
            second_waits.set()

        with exclusive_run(store, on_wait=waiting):
            events.append("second in")

    with exclusive_run(store, on_wait=pytest.fail):
        events.append("first in")
        first_in.set()
        thread = threading.Thread(target=second)
        thread.start()
        assert second_waits.wait(60)
        events.append("first out")
    thread.join(60)
    assert events == ["first in", "second waits", "first out", "second in"]


def test_a_killed_holder_does_not_keep_the_lock(store):
    script = (
        "import sys, time; from influence_core.pipeline.store.runlock import exclusive_run; from influence_core.pipeline.store.run_store import RunStore; "
        "store = RunStore.model_validate_json(sys.argv[1])\n"
        "with exclusive_run(store, on_wait=print):\n    print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", script, store.model_dump_json()], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"  # type: ignore[union-attr]
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert storage.exists(store.url(LOCK_NAME), store.options)  # the lock object (or file) is still there
    waited: list[str] = []
    with exclusive_run(store, on_wait=waited.append):
        pass
    assert waited == []  # taken at once: the dead holder's lock was released or broken


def test_a_holder_on_another_host_is_never_presumed_dead(s3_endpoint, s3_bucket):
    store = RunStore(output_url=f"s3://{s3_bucket}/out", storage={"endpoint_url": s3_endpoint})
    lock_url = store.url(LOCK_NAME)
    storage.write_bytes(lock_url, json.dumps({"host": "another-host", "pid": 1, "started": 0.0}).encode(), store.options)
    told, acquired = threading.Event(), threading.Event()
    messages: list[str] = []

    def take() -> None:
        with exclusive_run(store, on_wait=lambda m: (messages.append(m), told.set())):
            acquired.set()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    assert told.wait(60)
    assert "another-host" in messages[0] and lock_url in messages[0]  # it says whom it waits for and what to delete
    assert not acquired.is_set()
    storage.remove(lock_url, store.options)  # what an operator does once that run is known to be gone
    assert acquired.wait(60)
    thread.join(60)
    assert not storage.exists(lock_url, store.options)  # released on exit
