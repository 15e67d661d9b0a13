"""Deployments as code against a real server and worker: trigger, schedule, schema enforcement, artifacts."""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

from influence_core.pipeline.store import storage
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.specs import StorageSpec
from tests.e2e.conftest import PREFECT, REPO
from tests.helpers import small_params

pytestmark = pytest.mark.e2e


def client_for(env: dict[str, str]):  # type: ignore[no-untyped-def]
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(api=env["PREFECT_API_URL"])


def wait_final(client, flow_run_id, seconds: float = 600):  # type: ignore[no-untyped-def]
    deadline = time.time() + seconds
    while time.time() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        time.sleep(1)
    raise TimeoutError(f"flow run {flow_run_id} did not finish in {seconds} s")


def test_on_demand_run_through_the_worker_writes_to_s3(deployed, s3_endpoint, s3_bucket):
    params = small_params(f"s3://{s3_bucket}/e2e", storage={"endpoint_url": s3_endpoint})
    with client_for(deployed) as client:
        deployment = client.read_deployment_by_name("influence-run/on-demand")
        assert deployment.enforce_parameter_schema
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=params.model_dump(mode="json"))
        final = wait_final(client, flow_run.id)
        assert final.state.is_completed(), f"{final.state}: {open(deployed['WORKER_LOG']).read()[-4000:]}"
        artifacts = {a.key: a for a in client.read_artifacts() if a.flow_run_id == flow_run.id}
    assert {"influence-topk", "influence-summary", "influence-progress", "influence-report"} <= set(artifacts)
    assert artifacts["influence-report"].type == "image" and artifacts["influence-report"].data.startswith("data:image/png;base64,")
    assert artifacts["influence-topk"].type == "table" and artifacts["influence-summary"].type == "markdown"
    assert artifacts["influence-progress"].data == 100.0
    assert "compute_influences" in artifacts["influence-summary"].data and s3_endpoint not in str(artifacts["influence-topk"].data)
    store = RunStore(output_url=f"s3://{s3_bucket}/e2e", storage=StorageSpec(endpoint_url=s3_endpoint))
    group = storage.open_group(store.influence_url, store.options, mode="r")
    assert group.attrs["status"] == "complete"
    scores = np.asarray(group["scores"][...])
    np.testing.assert_array_equal(np.asarray(group["argmax"][...]), scores.argmax(1))


def test_nightly_carries_its_schedule(deployed):
    with client_for(deployed) as client:
        nightly = client.read_deployment_by_name("influence-run/nightly")
        schedules = client.read_deployment_schedules(nightly.id)
    assert [s.schedule.cron for s in schedules] == ["0 2 * * *"]
    assert all(s.active for s in schedules)
    assert nightly.work_pool_name == "influence-pool"


@pytest.mark.parametrize(
    "bad, field",
    [({"aggregate": {"top_k": 0}}, "top_k"), ({"method": {"name": "newton"}}, "method"), ({"compute": {"cluster": "mainframe"}}, "cluster")],
)
def test_out_of_range_parameters_are_refused_by_the_api(deployed, bad, field):
    from prefect.exceptions import PrefectHTTPStatusError

    with client_for(deployed) as client:
        deployment = client.read_deployment_by_name("influence-run/on-demand")
        with pytest.raises(PrefectHTTPStatusError) as info:
            client.create_flow_run_from_deployment(deployment.id, parameters=bad)
    assert info.value.response.status_code in (409, 422)
    assert "validation" in info.value.response.text.lower() or field in info.value.response.text


def verified_output(output_url: str) -> dict:
    """The complete run at `output_url`, its argmax checked against its own scores; returns its config."""
    group = storage.open_group(f"{output_url}/influence.zarr", {}, mode="r")
    assert group.attrs["status"] == "complete"
    scores = np.asarray(group["scores"][...])
    np.testing.assert_array_equal(np.asarray(group["argmax"][...]), scores.argmax(1))
    return dict(group.attrs["config"])


def make_deployment(client, name: str, params, schedules: list | None = None):  # type: ignore[no-untyped-def]
    """A deployment of the flow on the pool with `params` as its defaults, made through the API as `prefect deploy`
    makes them (test-only). Empty settings are left out: the server checks a deployment's defaults against the
    schema without allowing null for them (a run's parameters may hold nulls)."""
    parameters = params.model_dump(mode="json", exclude_none=True)
    flow_id = client.read_flow_by_name("influence-run").id
    pull = [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
    deployment_id = client.create_deployment(
        flow_id=flow_id, name=name, entrypoint="flows/influence_run.py:influence_run", work_pool_name="influence-pool",
        parameters=parameters, pull_steps=pull, schedules=schedules or [], enforce_parameter_schema=True,
        parameter_openapi_schema=client.read_deployment_by_name("influence-run/on-demand").parameter_openapi_schema,
    )
    return client.read_deployment(deployment_id)


def runs_of(client, deployment_id):  # type: ignore[no-untyped-def]
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def test_a_schedule_creates_a_run_that_the_worker_completes(deployed, tmp_path):
    """The server's own scheduler (SQLAlchemy < 2.1: with 2.1 it fails on every loop) creates the run; nobody triggers it."""
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import IntervalSchedule

    output = tmp_path / "scheduled"
    due = datetime.now(timezone.utc) + timedelta(seconds=20)
    schedule = DeploymentScheduleCreate(schedule=IntervalSchedule(interval=timedelta(hours=1), anchor_date=due), active=True)
    with client_for(deployed) as client:
        deployment = make_deployment(client, "scheduled-e2e", small_params(str(output)), [schedule])
        deadline = time.time() + 120
        while not (runs := runs_of(client, deployment.id)):
            assert time.time() < deadline, "the scheduler created no run in 120 s"
            time.sleep(1)
        first = min(runs, key=lambda r: r.expected_start_time)
        assert first.auto_scheduled and abs(first.expected_start_time - due) < timedelta(seconds=1)
        final = wait_final(client, first.id)
    assert final.state.is_completed(), f"{final.state}: {open(deployed['WORKER_LOG']).read()[-4000:]}"
    verified_output(str(output))


def test_a_partial_override_keeps_the_deployment_defaults(deployed, tmp_path):
    """`prefect deployment run --param method=...` replaces the method section only: output_url, dataset and the
    rest stay the deployment's."""
    output = tmp_path / "override"
    params = small_params(str(output))
    defaults = params.model_dump(mode="json")
    with client_for(deployed) as client:
        deployment = make_deployment(client, "override-e2e", params)
    cg = {"name": "cg", "regularization": 1e-3, "rtol": 1e-8}
    ran = subprocess.run(
        [PREFECT, "deployment", "run", "influence-run/override-e2e", "--param", f"method={json.dumps(cg)}"],
        env=deployed, cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    with client_for(deployed) as client:
        (flow_run,) = runs_of(client, deployment.id)
        assert flow_run.parameters["output_url"] == str(output) and flow_run.parameters["method"]["name"] == "cg"
        final = wait_final(client, flow_run.id)
    assert final.state.is_completed(), f"{final.state}: {open(deployed['WORKER_LOG']).read()[-4000:]}"
    config = verified_output(str(output))
    assert config["method"]["name"] == "cg" and config["method"]["rtol"] == 1e-8
    assert config["dataset"] == defaults["dataset"] and config["aggregate"] == defaults["aggregate"]


def refused_run_logs_one_line(env: dict[str, str], deployment: str, output: Path):  # type: ignore[no-untyped-def]
    """Start a run with top_k above n_train (refused at run time, after prepare_data) through run_deployment; the
    run fails, and its logs, read through the API as the UI shows them, hold the one line and no traceback."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    params = small_params(str(output), aggregate={"top_k": 500})
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        flow_run = run_deployment(deployment, parameters=params.model_dump(mode="json"), timeout=0)
    with client_for(env) as client:
        final = wait_final(client, flow_run.id)
        by_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id]))
        deadline = time.time() + 60  # the run's logs reach the API in batches, after its final state
        while True:
            messages = [log.message for log in client.read_logs(log_filter=by_run)]
            if any(m.startswith("aggregate.top_k: ") for m in messages):
                break
            assert time.time() < deadline, messages
            time.sleep(1)
    assert final.state.is_failed() and final.state.message.count("aggregate.top_k: ") == 1, final.state
    line = next(m for m in messages if m.startswith("aggregate.top_k: "))
    assert "Fix: " in line and "\n" not in line
    assert not [m for m in messages if "Traceback" in m], messages
    return final


def test_a_refusal_logs_one_line_and_notifies(deployed, webhook, tmp_path):
    """Through the worker: the one line, no traceback, and the failure automation posts the run to the webhook."""
    final = refused_run_logs_one_line(deployed, "influence-run/on-demand", tmp_path / "refused")
    deadline = time.time() + 60
    while not [body for body in webhook[1] if str(final.id) in body["body"]]:
        assert time.time() < deadline, f"no notification for the failed run: {webhook[1]}"
        time.sleep(1)
    (body,) = [body for body in webhook[1] if str(final.id) in body["body"]]
    assert body["subject"] == f"influence-run failed: {final.name}" and "aggregate.top_k: " in body["body"]


def test_a_refusal_under_serve_logs_one_line(deployed, tmp_path):
    """Through `influence_run.serve()`, the other way Prefect users run a flow as a service."""
    from tests.e2e.conftest import stop

    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [os.sys.executable, "-c", "from flows.influence_run import influence_run; influence_run.serve(name='serve-e2e')"],
            env=deployed, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        with client_for(deployed) as client:
            deadline = time.time() + 120
            while not [d for d in client.read_deployments() if d.name == "serve-e2e"]:
                assert server.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                time.sleep(1)
        refused_run_logs_one_line(deployed, "influence-run/serve-e2e", tmp_path / "refused")
    finally:
        stop(server)


def test_deployments_and_pool_carry_concurrency_limits(deployed):
    with client_for(deployed) as client:
        limits = {name: client.read_deployment_by_name(f"influence-run/{name}").global_concurrency_limit for name in ("nightly", "on-demand")}
        pool = client.read_work_pool("influence-pool")
    assert {name: limit.limit for name, limit in limits.items()} == {"nightly": 1, "on-demand": 2}
    assert pool.concurrency_limit == 2


def test_question_deployment_answers_new_queries_from_a_runs_index(deployed, tmp_path):
    """The `question` deployment takes only a run and a file of queries: its answer (written under the run) equals
    the library-level answer from that run's index, and it evaluates the queries' gradients alone."""
    from sklearn.datasets import load_digits

    from influence_core.pipeline.score.query import answer, query_arrays

    params = small_params(str(tmp_path / "base"))
    x, y = load_digits(return_X_y=True)
    np.savez(tmp_path / "new.npz", x=(x[-9:] / 16.0).astype(np.float32), y=y[-9:])
    with client_for(deployed) as client:
        base = client.create_flow_run_from_deployment(client.read_deployment_by_name("influence-run/on-demand").id, parameters=params.model_dump(mode="json"))
        final = wait_final(client, base.id)
        assert final.state.is_completed(), f"{final.state}: {open(deployed['WORKER_LOG']).read()[-4000:]}"
        question = client.read_deployment_by_name("influence-question/question")
        assert question.enforce_parameter_schema and set(question.parameter_openapi_schema["properties"]) == {"run_url", "queries", "top_k", "search", "output_url", "storage", "rerank"}
        asked = client.create_flow_run_from_deployment(question.id, parameters={"run_url": params.output_url, "queries": str(tmp_path / "new.npz"), "top_k": 3})
        final = wait_final(client, asked.id)
        assert final.state.is_completed(), f"{final.state}: {open(deployed['WORKER_LOG']).read()[-4000:]}"
        artifacts = {a.key for a in client.read_artifacts() if a.flow_run_id == asked.id}
    assert "influence-question" in artifacts
    store = params.store()
    expected = answer(store, *query_arrays(str(tmp_path / "new.npz"), {}), top_k=3)
    written = storage.open_group(str(tmp_path / "base" / "questions" / final.name / "influence.zarr"), {}, mode="r")  # where the flow writes it
    assert written.attrs["work"]["gradient_rows"] == 9 and written.attrs["status"] == "complete" and written.attrs["kind"] == "answer"
    np.testing.assert_array_equal(np.asarray(written["topk_helpful_indices"][...]), expected.arrays["topk_helpful_indices"])


def test_question_deployment_needs_a_run_and_names_the_runs_of_a_folder(deployed, tmp_path):
    """Issue 52, item 16: the question deployment's run_url had the default runs/on-demand, which never holds a run
    (on-demand writes runs/on-demand/{fingerprint}), so "Run" with the defaults failed. Now the server refuses a run
    without run_url (409/422: the form asks for it), and a folder of runs given as run_url fails the flow run with
    the one line naming the run below it."""
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from sklearn.datasets import load_digits

    from flows.influence_run import influence_run

    params = small_params(str(tmp_path / "on-demand" / "3f9a"))
    with temporary_settings({PREFECT_API_URL: deployed["PREFECT_API_URL"]}):
        influence_run(**params.sections())  # in this process, against the same server
    x, y = load_digits(return_X_y=True)
    np.savez(tmp_path / "new.npz", x=(x[-4:] / 16.0).astype(np.float32), y=y[-4:])
    with client_for(deployed) as client:
        question = client.read_deployment_by_name("influence-question/question")
        assert "run_url" in question.parameter_openapi_schema["required"]
        with pytest.raises(PrefectHTTPStatusError) as info:
            client.create_flow_run_from_deployment(question.id, parameters={"queries": str(tmp_path / "new.npz")})
        assert info.value.response.status_code in (409, 422) and "run_url" in info.value.response.text
        asked = client.create_flow_run_from_deployment(question.id, parameters={"run_url": str(tmp_path / "on-demand"), "queries": str(tmp_path / "new.npz")})
        final = wait_final(client, asked.id)
    assert final.state.is_failed(), final.state
    line = f"run: '{tmp_path / 'on-demand'}' holds no run itself but 1 run below it: '{params.output_url}'. Fix: give one of them as run"
    assert line in final.state.message and "Traceback" not in final.state.message, final.state.message
    assert not (tmp_path / "on-demand" / "questions").exists()
