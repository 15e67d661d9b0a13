"""Retries only for transient failures, and two concurrent runs that share inputs compute each stage once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prefect import flow, task

from influence_core import ConfigError
from tasks.policy import is_transient
from tests.helpers import small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
REPO = Path(__file__).resolve().parents[2]
STAGES = ["prepare_data", "fit_model", "fit_preconditioner", "index_training", "compute_test_factors", "compute_influences", "aggregate"]
ATTEMPTS: dict[str, int] = {}


@task(retries=2, retry_delay_seconds=0, retry_condition_fn=is_transient)
def flaky(kind: str) -> str:
    """Fails on its first attempt with a connection error (transient) or a bad-input error (not)."""
    ATTEMPTS[kind] = ATTEMPTS.get(kind, 0) + 1
    if ATTEMPTS[kind] == 1:
        if kind == "user code":
            raise IndexError("index out of range in self")  # what a forward pass raises on token ids beyond its vocabulary
        raise ConnectionError("S3 endpoint reset the connection") if kind == "network" else ConfigError("aggregate.top_k", "top_k=0", "use top_k >= 1")
    return "ok"


@flow
def attempt(kind: str) -> str:
    return flaky(kind)


def test_transient_errors_are_retried():
    assert attempt("network") == "ok"
    assert ATTEMPTS["network"] == 2


def test_validation_errors_fail_at_once_without_retry():
    with pytest.raises(ConfigError, match="aggregate.top_k"):
        attempt("validation")
    assert ATTEMPTS["validation"] == 1


def test_errors_of_the_users_code_fail_at_once_without_retry():
    with pytest.raises(IndexError):
        attempt("user code")
    assert ATTEMPTS["user code"] == 1


def test_a_stage_with_bad_input_fails_the_run_at_once(tmp_path):
    """A model whose outputs do not fit the labels: fit_model fails once, with the message, no retries."""
    from prefect.client.orchestration import get_client

    from flows.influence_run import influence_run

    params = small_params(str(tmp_path / "run"), model={"hidden": [4], "output_dim": 3})
    state = influence_run(**params.sections(), return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match="model.output_dim"):
        state.result()
    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_task_runs() if r.flow_run_id == state.state_details.flow_run_id and r.name.startswith("fit_model")]
    assert len(runs) == 1 and runs[0].run_count == 1


@pytest.mark.slow
def test_two_concurrent_runs_compute_each_stage_once(tmp_path):
    from prefect.settings import PREFECT_API_URL

    params = small_params(str(tmp_path / "run"), training={"epochs": 200})
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO), "INFLUENCE_LOCK_DIR": str(tmp_path / "locks")}
    script = (
        "import json, sys; from flows.influence_run import influence_run; from flows.parameters import RunParameters; "
        "s = influence_run(**RunParameters.model_validate_json(sys.argv[1]).sections()); "
        "print('OUTCOMES=' + json.dumps({k: v['outcome'] for k, v in s['stages'].items()}))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, params.model_dump_json()], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outcomes = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        outcomes.append(json.loads(next(line for line in out.splitlines() if line.startswith("OUTCOMES="))[len("OUTCOMES=") :]))
    for stage in STAGES:
        seen = sorted(o[stage] for o in outcomes)
        assert seen.count("computed") == 1, f"{stage}: {seen}"
