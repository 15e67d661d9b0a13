"""An unknown method or dataset source sent to a deployment is refused by Prefect's server naming the valid ones,
as the CLI names them: in `prefect deployment run` / the API (the run is refused) and in the UI's form check."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from flows.cli import app

pytestmark = pytest.mark.usefixtures("prefect_api")
EXPECTED = re.compile(r"does not match any of the expected tags: ('[a-z_]+'(?:, '[a-z_]+')*)")


def cli_tags(section: str, tag: str, tmp_path) -> str:  # type: ignore[no-untyped-def]
    """The valid tags the CLI lists for an unknown `section.tag`."""
    config = tmp_path / "run.yaml"
    config.write_text(f"output_url: {tmp_path / 'out'}\n")
    result = CliRunner().invoke(app, ["run", "--config", str(config), "--set", f"{section}.{tag}=nope"], terminal_width=400)
    assert result.exit_code == 2, result.output
    return EXPECTED.search(result.output)[1]


@pytest.fixture(scope="module")
def deployment(prefect_api: None):  # type: ignore[no-untyped-def]
    """A deployment of the flow with its parameter schema enforced, as prefect.yaml deploys it."""
    from prefect import get_client
    from prefect.utilities.callables import parameter_schema

    from flows.influence_run import influence_run

    schema = parameter_schema(influence_run).model_dump_for_openapi()
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("influence-run")
        deployment_id = client.create_deployment(flow_id=flow_id, name="form-refusals", entrypoint="flows/influence_run.py:influence_run", parameter_openapi_schema=schema, enforce_parameter_schema=True)
    return deployment_id, schema


@pytest.mark.parametrize(("section", "tag"), [("method", "name"), ("dataset", "source")])
def test_an_unknown_tag_is_refused_naming_the_valid_ones(deployment, section, tag, tmp_path):
    from prefect import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    deployment_id, schema = deployment
    listed = cli_tags(section, tag, tmp_path)
    assert listed.count("'") >= 18  # every method (9) or source (10)
    with get_client(sync_client=True) as client:
        with pytest.raises(PrefectHTTPStatusError) as refused:
            client.create_flow_run_from_deployment(deployment_id, parameters={section: {tag: "nope"}})
        checked = client._client.post("/ui/schemas/validate", json={"schema": schema, "values": {section: {tag: "nope"}}}).json()
    detail = refused.value.response.json()["detail"]
    assert f"Validation failed for field '{section}'" in detail and EXPECTED.search(detail)[1] == listed, detail
    messages = [message for error in checked["errors"] if error["property"] == section for message in error["errors"]]
    assert not checked["valid"] and any(EXPECTED.search(m) and EXPECTED.search(m)[1] == listed for m in messages), messages


def test_valid_tags_pass_the_servers_check(deployment):
    from prefect import get_client

    deployment_id, _ = deployment
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(deployment_id, parameters={"method": {"name": "cg", "rtol": 1e-8}, "dataset": {"n_train": 100}})
        client.delete_flow_run(run.id)
    assert run.parameters["method"]["name"] == "cg"
