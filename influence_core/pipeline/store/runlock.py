"""One run at a time per output_url: an exclusive lock object beside the outputs, held for the whole run.

Locally it is `fcntl.flock` on `{output_url}/run.lock` (an empty file): the kernel releases it when the holder exits, even on
SIGKILL. On S3 it is an object created with a conditional put (If-None-Match: *) that records the holder's host,
pid and process start time; a holder on this host that no longer runs is broken with a conditional delete
(If-Match: its ETag), so a run resumed after SIGKILL does not wait for its dead predecessor. A holder on another
host is never presumed dead: a run killed there leaves the object, which the waiting run names so that it can be
deleted by hand.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec.asyn
import psutil

from . import storage
from .run_store import RunStore

LOCK_NAME = "run.lock"
POLL_SECONDS = (0.5, 10.0)  # first and longest wait between two attempts at a held S3 lock

Notify = Callable[[str], None]


@contextmanager
def exclusive_run(store: RunStore, on_wait: Notify) -> Iterator[None]:
    """Hold the output's run lock for the block; `on_wait` is told once when another run holds it."""
    url = store.url(LOCK_NAME)
    lock = _held_s3 if storage.is_remote(url) else _held_file
    with lock(url, store.options, on_wait):
        yield


@contextmanager
def _held_file(url: str, options: dict[str, Any], on_wait: Notify) -> Iterator[None]:
    path = Path(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait(f"another run is writing to {path.parent}; waiting for it to finish (lock {path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time()}


def _gone(holder: dict[str, Any]) -> bool:
    """The holder ran on this host and that process no longer exists (a reused pid has another start time)."""
    if holder.get("host") != socket.gethostname():
        return False
    try:
        return psutil.Process(holder["pid"]).create_time() != holder.get("started")
    except (psutil.NoSuchProcess, KeyError, TypeError):
        return True


@contextmanager
def _held_s3(url: str, options: dict[str, Any], on_wait: Notify) -> Iterator[None]:
    fs, path = storage.filesystem(url, options)
    bucket, key = path.split("/", 1)
    wait, told = POLL_SECONDS[0], False
    while True:
        try:
            etag = fs.pipe_file(path, json.dumps(_me()).encode(), mode="create")["ETag"]
            break
        except FileExistsError:
            pass
        try:
            body, held = fsspec.asyn.sync(fs.loop, _get, fs, bucket, key)
        except FileNotFoundError:
            continue  # released meanwhile
        if not body:  # a local output's empty flock file, copied here with the output (`aws s3 sync`): no run holds it
            _delete(fs, bucket, key, held)
            continue
        try:
            holder = json.loads(body)
        except ValueError:
            holder = {}  # written by something else than this module: never presumed dead
        if _gone(holder):
            _delete(fs, bucket, key, held)
            continue
        if not told:
            on_wait(f"another run (host {holder.get('host')}, pid {holder.get('pid')}) is writing to {url.rsplit('/', 1)[0]}; "
                    f"waiting for it to finish (if that run is gone, delete {url})")
            told = True
        time.sleep(wait)
        wait = min(2 * wait, POLL_SECONDS[1])
    try:
        yield
    finally:
        _delete(fs, bucket, key, etag)


async def _get(fs: Any, bucket: str, key: str) -> tuple[bytes, str]:
    """Body and ETag from one GET, so that they belong to the same version of the object."""
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    try:
        return await response["Body"].read(), response["ETag"]
    finally:
        response["Body"].close()


def _delete(fs: Any, bucket: str, key: str, etag: str) -> None:
    """Delete the lock object only if it is still the version `etag`: never another holder's lock."""
    try:
        fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=etag)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # s3fs reports 412 Precondition Failed as EINVAL
            raise
