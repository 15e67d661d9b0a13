"""SIGTERM, SIGINT and SIGHUP sent to a CLI run mid-stage: the command exits non-zero, nothing it started (the
temporary Prefect server, the Dask scheduler's nannies and workers) is alive 15 s later (polled: the test goes on as soon as all are gone), and the next run resumes
to the bits of an uninterrupted run. The runs use Prefect's ephemeral server, as a user's first run does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

from tests.helpers import read_outputs
from tests.integration.test_engine import REPO, slow_params

pytestmark = pytest.mark.slow
ALIVE_AFTER_SECONDS = 15
# 25 chunks of 32 rows, 5.0 s of scoring on 2 workers: a signalled run finishes the 2-3 chunks in flight, so three
# runs leave work to resume (400 rows, 13 chunks in 3.6 s since workers run without MALLOC_TRIM_THRESHOLD_: a fresh
# clone's run once finished them all before the signal took effect)
N_TRAIN = 800


def start(config: Path, env: dict[str, str]) -> subprocess.Popen:
    """The CLI in a session of its own (as a service manager would start it), its output kept for the assertions."""
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", "--config", str(config)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def descendants(pid: int) -> set[psutil.Process]:
    try:
        return set(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return set()


def interrupt_mid_scoring(config: Path, env: dict[str, str], output: Path, signum: int) -> tuple[int, str, dict[psutil.Process, str]]:
    """Start a run, send `signum` once it has finished a score chunk but not all, and return its exit code, output and
    every process it had started (collected while it ran: the server, the Dask processes)."""
    proc = start(config, env)
    seen: set[psutil.Process] = set()
    deadline = time.time() + 300
    marker_count = lambda: len(list(output.glob("stages/compute_influences/*/done/*")))  # noqa: E731
    before = marker_count()
    while marker_count() <= before:
        assert proc.poll() is None, f"the run ended before it could be interrupted: {proc.stdout.read()[-3000:]}"  # type: ignore[union-attr]
        assert time.time() < deadline, "no score chunk finished in 300 s"
        seen |= descendants(proc.pid)
        time.sleep(0.05)
    seen |= descendants(proc.pid)
    commands = {p: " ".join(_cmdline(p)) for p in seen}
    os.kill(proc.pid, signum)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out, commands


def test_each_signal_stops_everything_and_the_run_resumes_bit_identically(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}  # no API: the CLI starts its own temporary server
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(REPO), "INFLUENCE_LOCK_DIR": str(tmp_path / "locks")}
    configs = {}
    for name in ("reference", "run"):
        configs[name] = tmp_path / f"{name}.yaml"
        # no training index (index_budget_gb 0): every attempt's compute_influences runs on the Dask workers, where an
        # index found complete by the second attempt would let a small run score in the flow's process, with no worker to stop
        configs[name].write_text(yaml.safe_dump(slow_params(str(tmp_path / name), cluster="local", n_train=N_TRAIN, n_workers=2, index_budget_gb=0).model_dump(mode="json")))
    reference = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", str(configs["reference"])], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        code, out, started = interrupt_mid_scoring(configs["run"], env, tmp_path / "run", signum)
        name = signal.Signals(signum).name
        assert code == 128 + signum, f"{name}: exit {code}\n{out[-3000:]}"
        assert f"run: interrupted by {name}" in out.strip().splitlines()[-1], out[-3000:]  # the last word is the one-line reason
        assert any("uvicorn" in c for c in started.values()) and len(started) >= 3, f"expected the server and the Dask processes: {started}"
        deadline = time.time() + ALIVE_AFTER_SECONDS
        while any(_alive(p) for p in started) and time.time() < deadline:
            time.sleep(0.2)
        alive = [f"{p.pid} {command[:120]}" for p, command in started.items() if _alive(p)]
        assert not alive, f"{name}: still alive {ALIVE_AFTER_SECONDS} s later: {alive}"
        group, _ = read_outputs(slow_params(str(tmp_path / "run"), n_train=N_TRAIN).store())
        assert group.attrs["status"] == "running"  # an interrupted run never looks complete

    resumed = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", str(configs["run"])], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    group, arrays = read_outputs(slow_params(str(tmp_path / "run"), n_train=N_TRAIN).store())
    _, expected = read_outputs(slow_params(str(tmp_path / "reference"), n_train=N_TRAIN).store())
    assert group.attrs["status"] == "complete"
    assert arrays.keys() == expected.keys() >= {"scores", "self_influence", "topk_helpful_indices", "train_totals"}
    for name, values in expected.items():
        np.testing.assert_array_equal(arrays[name], values, err_msg=name)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def test_sigkill_of_the_cli_takes_its_temporary_server_along(tmp_path):
    """`kill -9` runs no atexit: the temporary Prefect server the CLI started must still go (issue 35, item 9)."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(slow_params(str(tmp_path / "run"), n_train=N_TRAIN).model_dump(mode="json")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}  # no API: the CLI starts its own temporary server
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(REPO), "INFLUENCE_LOCK_DIR": str(tmp_path / "locks")}
    proc = start(config, env)
    deadline = time.time() + 300
    servers: list[psutil.Process] = []
    while not any(p.name().startswith("python") and "prefect.server.api.server:create_app" in " ".join(_cmdline(p)) and p.is_running() for p in servers) or not list((tmp_path / "run").glob("stages/*")):
        assert proc.poll() is None and time.time() < deadline, "the run ended (or took 300 s) before its server and first stage"
        servers = [p for p in descendants(proc.pid) if "uvicorn" in " ".join(_cmdline(p))]
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(servers, timeout=ALIVE_AFTER_SECONDS)
    for orphan in alive:  # not left behind by a failing test
        orphan.kill()
    assert not alive, f"the temporary server outlived the CLI: {[p.pid for p in alive]}"
