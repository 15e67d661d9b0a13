"""Deployments as code against a real server and worker: trigger, schedule, schema enforcement, artifacts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from influence_core import storage
from influence_core.pipeline.store import RunStore
from influence_core.specs import StorageSpec
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
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters={"params": params.model_dump(mode="json")})
        final = wait_final(client, flow_run.id)
        assert final.state.is_completed(), f"{final.state}: {open(deployed['WORKER_LOG']).read()[-4000:]}"
        artifacts = {a.key: a for a in client.read_artifacts() if a.flow_run_id == flow_run.id}
    assert {"influence-topk", "influence-summary", "influence-progress"} <= set(artifacts)
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
            client.create_flow_run_from_deployment(deployment.id, parameters={"params": bad})
    assert info.value.response.status_code in (409, 422)
    assert "validation" in info.value.response.text.lower() or field in info.value.response.text
