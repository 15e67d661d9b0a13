"""One input per stage, planned once: a run computes each stage's key once and reads each manifest once, and a
stage whose lock was held by another run reads its manifest again, finding that run's output."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import pytest

from flows.influence_run import influence_run
from influence_core.pipeline.stages import prepare
from influence_core.pipeline.store import stage as stage_module
from influence_core.pipeline.specs import DigitsDataset
from influence_core.pipeline.store.run_store import RunStore
from tasks.policy import CrashSafeLockManager, waited
from tasks.stages import prepare_data
from tests.helpers import small_params


@pytest.mark.usefixtures("prefect_api")
def test_a_run_computes_each_key_and_reads_each_manifest_once(tmp_path, monkeypatch):
    reads: Counter[str] = Counter()
    keys: Counter[str] = Counter()
    read, key = stage_module.StageLocation.read, stage_module.stage_key

    def counted_read(location, ref_type):  # type: ignore[no-untyped-def]
        reads[location.stage] += 1
        return read(location, ref_type)

    def counted_key(stage, config, inputs):  # type: ignore[no-untyped-def]
        keys[stage] += 1
        return key(stage, config, inputs)

    monkeypatch.setattr(stage_module.StageLocation, "read", counted_read)
    monkeypatch.setattr(stage_module, "stage_key", counted_key)
    params = small_params(str(tmp_path / "run"), validation={"subsets": 3, "fraction": 0.5, "queries": 3})
    for expected in ("computed", "cached"):  # a fresh run, then one that finds every stage complete
        reads.clear()
        keys.clear()
        summary = influence_run(**params.sections())
        assert {stage["outcome"] for stage in summary["stages"].values()} == {expected}
        once = Counter(dict.fromkeys(summary["stages"], 1))
        assert len(once) == 8 and reads == once and keys == once  # the training index is a stage of its own


def test_a_stage_whose_lock_was_held_by_another_run_reads_its_manifest_again(tmp_path):
    locks = CrashSafeLockManager(tmp_path / "locks")
    store = RunStore(output_url=str(tmp_path / "run"))
    mine = prepare.PrepareInput(DigitsDataset(n_train=50, n_test=5), store)
    assert mine.call.existing() is None  # the flow's check, before the other run finished the stage
    key = mine.call.key
    assert locks.acquire_lock(key, "other run")
    theirs = prepare.run(prepare.PrepareInput(DigitsDataset(n_train=50, n_test=5), store))
    threading.Timer(0.2, locks.release_lock, (key, "other run")).start()
    assert locks.acquire_lock(key, "this run", acquire_timeout=10) and waited(key)
    found = prepare_data.fn(mine)  # the task's body
    assert found.created_at == theirs.created_at  # found complete, not computed again
    locks.release_lock(key, "this run")
    assert locks.acquire_lock(key, "this run") and not waited(key)  # taken at once: the check is trusted
    locks.release_lock(key, "this run")


def test_a_lock_file_whose_record_is_not_yet_written_is_a_held_lock(tmp_path):
    locks = CrashSafeLockManager(tmp_path / "locks")
    path = tmp_path / "locks" / "k.lock"
    path.parent.mkdir()
    path.touch()  # Prefect's acquire creates the file, then writes its record
    threading.Timer(0.05, path.write_text, ('{"holder": "other run", "expiration": null}',)).start()
    assert locks.is_locked("k") and not locks.is_lock_holder("k", "this run")
    assert not locks.acquire_lock("k", "this run", acquire_timeout=0.3)
    path.unlink()  # the other holder let go
    assert locks.acquire_lock("k", "this run") and locks.is_lock_holder("k", "this run")
    assert sorted(p.name for p in path.parent.iterdir()) == ["k.lock"]  # the pid was added in place
    locks.release_lock("k", "this run")


def test_a_lock_file_left_without_its_record_by_a_killed_holder_is_broken(tmp_path):
    locks = CrashSafeLockManager(tmp_path / "locks")
    path = tmp_path / "locks" / "k.lock"
    path.parent.mkdir()
    path.touch()
    os.utime(path, (time.time() - 60, time.time() - 60))  # created a minute ago, by a process killed before its write
    assert not locks.is_locked("k")
    assert locks.acquire_lock("k", "this run", acquire_timeout=0.3) and locks.is_lock_holder("k", "this run")
    locks.release_lock("k", "this run")
