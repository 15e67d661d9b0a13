"""The temporary Prefect server goes with the CLI that started it, even after `kill -9` (which runs no `atexit`).

`python -m flows.watchdog PARENT CHILD` waits while both live; when PARENT is gone it ends CHILD (SIGTERM, then
SIGKILL after GRACE_SECONDS). Each is named by pid and start time, so a reused pid is never mistaken for it.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

POLL_SECONDS = 0.5
GRACE_SECONDS = 5.0


def watch(child_pid: int) -> subprocess.Popen[bytes]:
    """Start a watchdog that ends process `child_pid` when this process dies."""
    me, child = psutil.Process(), psutil.Process(child_pid)
    args = [sys.executable, "-m", "flows.watchdog", f"{me.pid}:{me.create_time()}", f"{child.pid}:{child.create_time()}"]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _process(named: str) -> psutil.Process | None:
    """The process `pid:create_time` names, or None once it is gone (or its pid belongs to another)."""
    pid, created = named.split(":")
    try:
        process = psutil.Process(int(pid))
        return process if process.create_time() == float(created) and process.status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None


def main(parent: str, child: str) -> None:
    """Wait while both processes live; end the child when the parent is gone first."""
    while _process(parent) is not None:
        if _process(child) is None:
            return
        time.sleep(POLL_SECONDS)
    orphan = _process(child)
    if orphan is None:
        return
    orphan.terminate()
    try:
        orphan.wait(GRACE_SECONDS)
    except psutil.TimeoutExpired:
        orphan.kill()


if __name__ == "__main__":
    main(*sys.argv[1:3])
