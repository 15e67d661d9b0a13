"""Run one side (or a reference, the GEMM probe, the pipeline) as a subprocess and read its one JSON line.

Each run is its own process, so peak RSS is per side; it gets its own session, so a timeout kills it with all
its children (Dask workers included). Failures and timeouts are results, never exceptions: the report shows them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any


def run_json(cmd: list[str], timeout: float, log: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd`, stderr to `log`; the parsed last stdout line plus `wall` seconds, or why there is none."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True, env={**os.environ, **(env or {})})
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"timed_out": True, "wall": time.perf_counter() - start, "timeout": timeout, "log": str(log)}
        except BaseException:  # interrupted or terminated: take the side (and its workers) down too
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    wall = time.perf_counter() - start
    lines = [line for line in out.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        tail = log.read_text().strip().splitlines()[-3:]
        return {"failed": True, "returncode": proc.returncode, "error": " | ".join(tail)[-600:], "wall": wall, "log": str(log)}
    return {**json.loads(lines[-1]), "wall": wall, "log": str(log)}


def ok(result: dict[str, Any]) -> bool:
    """A run that finished and printed its result."""
    return not result.get("timed_out") and not result.get("failed")


def outcome(result: dict[str, Any]) -> str:
    """A short word on a run that did not finish: 'timed out after N s' or 'failed: <last log line>'."""
    if result.get("timed_out"):
        return f"timed out after {result['timeout']:.0f} s"
    if result.get("failed"):
        return f"failed ({result['error'][-200:]})"
    return "ok"
