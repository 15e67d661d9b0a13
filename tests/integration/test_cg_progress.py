"""A long CG solve is never silent: its progress (iteration, worst residual, an estimate) reaches the CLI and the
run's Prefect logs at the set cadence, and a solve that reaches the default cap fails naming method.maxiter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tests.helpers import small_params

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
PROGRESS = re.compile(r"^(\d\d:\d\d:\d\d\.\d+) \| INFO .*block CG: iteration (\d+) of at most (\d+) \(method\.maxiter\), \d+ of 12 systems above tolerance, worst relative residual (\S+) \(rtol 1e-12\), (\S+) s per iteration; ")


def flow_run_logs(output_url: str) -> list[str]:
    """The messages the Prefect API holds for the flow run that wrote `output_url`."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        run = next(r for r in client.read_flow_runs(limit=50) if r.parameters.get("output_url") == output_url)
        return [log.message for log in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))]


CADENCE = 0.1  # seconds between progress lines (INFLUENCE_PROGRESS_SECONDS; 30 by default): the solve takes 0.5 s (CI) to 2 s (here)


@pytest.mark.parametrize("cluster", ["sequential", "local"])
def test_an_unpreconditioned_cg_solve_reports_progress_and_stops_at_a_cap_naming_it(tmp_path, cluster):
    """p = 30 unknowns in float32, λ = 1e-7, rtol 1e-12 and no preconditioner: the solve cannot reach its tolerance.
    Every CADENCE brings a line, from the flow's process or (local) from the worker solving the block; at the cap
    (min(10·p, 1000) = 300) the run fails in one line naming the cap's option and the fixes."""
    from prefect.settings import PREFECT_API_URL

    output_url = str(tmp_path / "out")
    dataset = {"source": "synthetic_classification", "n_features": 4, "n_train": 64, "n_test": 12, "chunk_rows": 64}
    compute = {"cluster": cluster, "n_workers": 2, "train_chunk_rows": 64}
    config = small_params(output_url, dataset=dataset, model__hidden=[4], method={"name": "cg", "regularization": 1e-7, "rtol": 1e-12}, compute=compute).model_dump(mode="json")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_LOGGING_LEVEL": "INFO", "INFLUENCE_PROGRESS_SECONDS": str(CADENCE), "PYTHONPATH": str(REPO), "COLUMNS": "400"}
    done = subprocess.run([str(Path(sys.executable).parent / "influence-pipeline"), "run", "--config", str(tmp_path / "run.yaml")], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    progress = [m for m in map(PROGRESS.match, done.stderr.splitlines()) if m]  # Prefect's console handler writes to stderr
    assert len(progress) >= 2, done.stderr
    times = [datetime.strptime(m[1], "%H:%M:%S.%f") for m in progress]
    pace = max(float(m[5]) for m in progress)  # a line comes after the iteration that passes the CADENCE mark
    assert max((b - a).total_seconds() for a, b in zip(times, times[1:])) < CADENCE + 3 * pace + 0.5, done.stderr
    assert {m[3] for m in progress} == {"300"}
    assert [int(m[2]) for m in progress] == sorted(int(m[2]) for m in progress)
    assert "at this rate the cap comes first" in done.stderr
    refusal = "method.regularization: CG did not converge in 300 iterations (method.maxiter unset: min(10·p, 1000); worst relative residual "
    assert refusal in done.stdout and "or set method.preconditioner: nystroem" in done.stdout
    logged = [line for line in flow_run_logs(output_url) if line.startswith("block CG: iteration ")]
    assert len(logged) == len(progress)  # the same lines are in the run's Prefect logs
