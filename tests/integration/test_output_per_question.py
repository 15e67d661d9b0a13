"""A deployment run never collides with another question's output: `{fingerprint}` in output_url (as prefect.yaml
and the Terraform stack set it) gives each set of parameters its own output, so a second "Custom run" that changes
only top_k completes without `overwrite`, and asking the first question again reuses its output."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.influence_run import influence_run
from flows.parameters import RunParameters
from tests.helpers import read_outputs, small_params

REPO = Path(__file__).resolve().parents[2]


def deployment_parameters(name: str) -> dict:
    """A deployment's parameters in prefect.yaml, as `prefect deploy` sends them."""
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    return next(d["parameters"] for d in deployments if d["name"] == name)


@pytest.mark.parametrize("name", ["nightly", "on-demand"])
def test_each_question_of_a_deployment_gets_its_own_output(name):
    """The UI form sends every section: the deployment's defaults filled in, and one field changed."""
    defaults = deployment_parameters(name)
    form = {**RunParameters().model_dump(mode="json"), **defaults}
    first, second = RunParameters.model_validate(form), RunParameters.model_validate({**form, "aggregate": {**form["aggregate"], "top_k": 3}})
    assert first.store().output_url != second.store().output_url
    assert first.store().output_url == RunParameters.model_validate(form).store().output_url
    for params in (first, second):
        assert params.store().output_url.endswith(f"runs/{name}/{params.run_fingerprint()}")
        assert params.store().cache_url.endswith("runs/stages")  # the training side is shared between questions


@pytest.mark.usefixtures("prefect_api")
def test_a_new_question_runs_without_overwrite_and_an_old_one_is_reused(tmp_path):
    template = str(tmp_path / "on-demand" / "{fingerprint}")
    cache = {"cache_url": str(tmp_path / "stages")}
    first = small_params(template, storage=cache)
    second = small_params(template, storage=cache, aggregate={"top_k": 3, "report_queries": 3})
    summaries = [influence_run(**params.sections()) for params in (first, second, first)]

    (one, _), (two, _) = read_outputs(first.store()), read_outputs(second.store())
    assert first.store().output_url == str(tmp_path / "on-demand" / first.run_fingerprint())
    assert second.store().output_url == str(tmp_path / "on-demand" / second.run_fingerprint()) != first.store().output_url
    assert one.attrs["status"] == two.attrs["status"] == "complete"
    assert one.attrs["config"]["aggregate"]["top_k"] == 4 and two.attrs["config"]["aggregate"]["top_k"] == 3
    assert [s["output_url"] for s in summaries] == [first.store().output_url, second.store().output_url, first.store().output_url]
    assert summaries[1]["stages"]["fit_model"]["outcome"] != "computed"  # the new question reused the trained model
    assert {stage["outcome"] for stage in summaries[2]["stages"].values()} <= {"cached", "found complete"}  # asked again: reused
