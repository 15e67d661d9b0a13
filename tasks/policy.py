"""Cache and retry policy shared by every stage task."""

from __future__ import annotations

import errno
import functools
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import psutil
from distributed import KilledWorker
from prefect import Task, task as prefect_task
from prefect.cache_policies import CachePolicy
from prefect.client.schemas.objects import State, TaskRun
from prefect.context import TaskRunContext
from prefect.locking.filesystem import FileSystemLockManager, _LockInfo
from prefect.settings import PREFECT_HOME

from influence_core.pipeline.store.stage import StageInput
from influence_core.pipeline.store.refs import StageRef

from .progress import library_logs

R = TypeVar("R", bound=StageRef)
S = TypeVar("S", bound=StageInput[Any])


@dataclass
class StagePolicy(CachePolicy):
    """Cache key = the stage key of the task's one input (its planned call): input fingerprints, the stage's own
    config and the code version. Never the tensors: tasks only receive refs and specs."""

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> Optional[str]:
        stage: StageInput[Any] = inputs["stage"]
        return stage.call.key


_WAITED: set[str] = set()  # stage keys whose lock was last taken after waiting for another holder
_WAITED_LOCK = threading.Lock()


class CrashSafeLockManager(FileSystemLockManager):
    """File locks that a killed process cannot keep: each lock file also records the host and pid that took it,
    and a lock whose process on this host no longer exists is broken, so a run resumed after SIGKILL does not wait
    forever for its dead predecessor. (Prefect's holders are opaque ids, so the pid is added here.) It also notes
    which locks were taken after another holder let go (`waited`): that holder may have just written the output.
    Prefect creates a lock file empty and writes its record after; a reader in between sees a held lock whose record
    is not there yet, never a JSON error (one still empty after 10 s is a killed holder's, and broken), and the pid
    is added by an atomic replace, so the record is never empty."""

    def acquire_lock(self, key: str, holder: str, acquire_timeout: Optional[float] = None, hold_timeout: Optional[float] = None) -> bool:
        held = self.is_locked(key)
        acquired = super().acquire_lock(key, holder, acquire_timeout, hold_timeout)
        if acquired:
            path = self._lock_path_for_key(key)
            record = json.loads(path.read_bytes())
            partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
            partial.write_text(json.dumps({**record, "host": socket.gethostname(), "pid": os.getpid()}))
            os.replace(partial, path)
            with _WAITED_LOCK:
                (_WAITED.add if held else _WAITED.discard)(key)
        return acquired

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        path = self._lock_path_for_key(key)
        try:
            record = json.loads(path.read_bytes())
        except (FileNotFoundError, ValueError):
            record = {}
        if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int) and not psutil.pid_exists(record["pid"]):
            path.unlink(missing_ok=True)
            self._locks.pop(key, None)
            return False
        return super().is_locked(key, use_cache)

    def _get_lock_info(self, key: str, use_cache: bool = True) -> Optional[_LockInfo]:
        for _ in range(_RECORD_WAITS):
            try:
                return super()._get_lock_info(key, use_cache)
            except ValueError:  # created, its record not yet written
                time.sleep(0.01)
        path = self._lock_path_for_key(key)
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return None
        if age > _ABANDONED_SECONDS:  # its holder died between creating the file and writing its record
            path.unlink(missing_ok=True)
            return None
        return {"holder": "", "expiration": None, "path": path}  # held; holder unknown


_RECORD_WAITS = 20  # 0.2 s for a lock's holder to write its record, which it does at once
_ABANDONED_SECONDS = 10.0  # a lock file still without its record this long after it was created has no live holder


def waited(key: str) -> bool:
    """Whether this process last took the lock of stage `key` after waiting for another holder."""
    with _WAITED_LOCK:
        return key in _WAITED


def stage_policy() -> CachePolicy:
    """A stage's cache policy with SERIALIZABLE isolation: of two runs that need the same stage at once, one
    computes it while the other waits on the lock, then finds the output complete. Locks are files under
    $INFLUENCE_LOCK_DIR (default: PREFECT_HOME/locks), shared by every run on one host; across hosts, configure
    a shared lock manager such as prefect-redis's."""
    lock_dir = Path(os.environ.get("INFLUENCE_LOCK_DIR") or Path(PREFECT_HOME.value()) / "locks")
    return StagePolicy().configure(isolation_level="SERIALIZABLE", lock_manager=CrashSafeLockManager(lock_dir))


def stage_task(name: str) -> Callable[[Callable[[S], R]], Task[[S], R]]:
    """A stage's Prefect task around a body taking the stage's one input, with the stage cache policy and options.

    The flow's existence check already read the manifest; the body reads it again only when the stage's lock was
    taken after another run held it (that run may have written the output). The ref comes back with URLs relative
    to the output's root: Prefect persists it beside the outputs, which may be moved or copied elsewhere; the flow
    resolves it against the output where it is now (`RunStore.resolve`)."""

    def make(stage_fn: Callable[[S], R]) -> Task[[S], R]:
        @functools.wraps(stage_fn)
        def body(stage: S) -> R:
            call = stage.call
            if waited(call.key):
                call.existing(recheck=True)
            with library_logs():
                return stage_fn(stage).moved(call.store.relative)

        body.__name__ = body.__qualname__ = name  # Prefect's task key: unique although several bodies are an engine's `run`
        return prefect_task(name=name, cache_policy=stage_policy(), **STAGE_OPTIONS)(body)

    return make


def is_transient(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry what a second attempt can cure: connection and I/O errors (timeouts included) and lost workers. Never bad
    input, numerical failures, or an error raised by the user's code or data (an IndexError in a forward pass, a
    factory that raises), which fail at once."""
    try:
        state.result(raise_on_failure=True)
    except OSError as exc:
        return exc.errno != errno.ENOSPC  # a full disk stays full: retrying only rewrites what fits
    except KilledWorker:
        return True
    except Exception:
        return False
    return False


STAGE_OPTIONS: dict[str, Any] = {
    "retries": 2,
    "retry_delay_seconds": [2, 10],
    "retry_condition_fn": is_transient,
    "persist_result": True,
    "result_serializer": "json",
}
