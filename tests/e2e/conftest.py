"""A real Prefect server, the deployments of prefect.yaml and a process worker, started by the tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(os.sys.executable).parent / "prefect")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, log: Path, seconds: float = 180) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        assert process.poll() is None, f"the Prefect server exited: {log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the Prefect server did not answer in {seconds} s: {log.read_text()[-3000:]}")


def stop(process: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM, then SIGKILL to the process group after `grace` seconds. Once idle for a minute or more,
    `prefect worker start` (3.8.8) ignores the SIGINT it sends itself on SIGTERM and keeps polling (reproduced: a
    32 s teardown, the worker left running without the kill), so its shutdown must not fail or stall the suite."""
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=grace)


@pytest.fixture(scope="session")
def prefect_service(tmp_path_factory) -> Iterator[dict[str, str]]:
    """`prefect server start` on a free port of 127.0.0.1 with its own SQLite home; yields the environment."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "INFLUENCE_PIPELINE_HOME": str(REPO),
        "INFLUENCE_LOCK_DIR": str(home / "locks"),
        # the scheduler's own loop, shortened so that a run due in seconds is created in seconds
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
        "PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS": "2",
    }
    log = home / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=home, start_new_session=True)
    try:
        wait_healthy(env["PREFECT_API_URL"], server, log)
        yield env
    finally:
        stop(server)


class Webhook(BaseHTTPRequestHandler):
    """Records the JSON bodies POSTed to it: the failure notification's receiver."""

    received: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802
        self.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
        pass


@pytest.fixture(scope="session")
def webhook() -> Iterator[tuple[str, list[dict]]]:
    """An HTTP receiver on 127.0.0.1: its URL and the bodies it received."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Webhook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hook", Webhook.received
    finally:
        server.shutdown()


@pytest.fixture(scope="session")
def deployed(prefect_service: dict[str, str], webhook: tuple[str, list[dict]]) -> Iterator[dict[str, str]]:
    """What `make serve` sets up: the work pool, `prefect --no-prompt deploy --all` from the repository, the service
    defaults (`python -m flows.service`, with the webhook receiver as the failure notification), a process worker."""
    env = {**prefect_service, "INFLUENCE_FAILURE_WEBHOOK_URL": webhook[0]}
    run = lambda *args: subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)  # noqa: E731
    created = run(PREFECT, "work-pool", "create", "influence-pool", "--type", "process")
    assert created.returncode == 0, created.stdout + created.stderr
    deployed = run(PREFECT, "--no-prompt", "deploy", "--all")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    service = run(os.sys.executable, "-m", "flows.service")
    assert service.returncode == 0, service.stdout + service.stderr
    log = Path(env["PREFECT_HOME"]) / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "influence-pool", "--type", "process"], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield {**env, "WORKER_LOG": str(log)}
    finally:
        stop(worker)
