"""The command-line interface, in process, against the real Prefect API and moto S3."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tests.helpers import read_outputs, small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
runner = CliRunner()


def test_every_command_has_help():
    for command in ([], ["run"], ["demo"], ["show"]):
        result = runner.invoke(app, [*command, "--help"])
        assert result.exit_code == 0, result.output
        assert "Usage" in result.output


def test_run_with_config_and_overrides_then_show_from_s3(tmp_path, s3_endpoint, s3_bucket):
    params = small_params(f"s3://{s3_bucket}/cli", storage={"endpoint_url": s3_endpoint})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    result = runner.invoke(app, ["run", "--config", str(config), "--set", "method.name=cg", "--set", "method.rtol=1e-8", "--set", "aggregate.top_k=3"])
    assert result.exit_code == 0, result.output
    group, arrays = read_outputs(small_params(f"s3://{s3_bucket}/cli", storage={"endpoint_url": s3_endpoint}).store())
    assert group.attrs["config"]["method"]["name"] == "cg"
    assert arrays["topk_helpful_indices"].shape == (12, 3)
    np.testing.assert_array_equal(arrays["argmax"], arrays["scores"].argmax(1))
    assert "most helpful" in result.output and f"s3://{s3_bucket}/cli/report.png" in result.output

    shown = runner.invoke(app, ["show", f"s3://{s3_bucket}/cli", "--endpoint-url", s3_endpoint, "--queries", "2"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    first = arrays["topk_helpful_indices"][0, 0]
    assert f"#{first} " in shown.output and "method=cg" in shown.output


def test_bad_override_is_reported_by_field(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"output_url": str(tmp_path / "out")}))
    result = runner.invoke(app, ["run", "--config", str(config), "--set", "method.name=newton"])
    assert result.exit_code == 2
    assert "method:" in result.output and "'direct'" in result.output


def test_show_refuses_an_incomplete_run(tmp_path):
    from influence_core.pipeline import storage

    group = storage.open_group(str(tmp_path / "influence.zarr"), {}, mode="w")
    group.attrs["status"] = "running"
    result = runner.invoke(app, ["show", str(tmp_path)])
    assert result.exit_code == 1
    assert "not complete" in " ".join(result.output.split())
