"""The optional validate stage: the run's own LDS from retrainings on random subsets (Dask tasks, resumed per
subset), checked against an independent computation: the models retrained here, their query losses by
F.cross_entropy, and scipy's Spearman correlation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dask.system import CPU_COUNT
from prefect import get_client
from pydantic import ValidationError
from scipy.stats import spearmanr

from flows.influence_run import influence_run
from influence_core.pipeline.store import storage
from influence_core.pipeline.model.models import build_model, train
from influence_core.pipeline.store.loading import open_data
from influence_core.pipeline.stages.validation import subset_mask
from influence_core.pipeline.store.refs import DataRef
from tests.helpers import read_outputs, small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
VALIDATE = {"subsets": 6, "fraction": 0.5, "queries": 5, "seed": 3}


def params(output: Path, **overrides):  # type: ignore[no-untyped-def]
    """Logistic regression, exact influence, validated on 6 subsets."""
    sections = {"model": {"architecture": "linear"}, "training": {"epochs": 10}, "method": {"name": "direct", "regularization": 1e-2}, "validation": VALIDATE}
    return small_params(str(output), **{**sections, **overrides})


@pytest.fixture(scope="module")
def validated(tmp_path_factory):  # type: ignore[no-untyped-def]
    run = params(tmp_path_factory.mktemp("validate") / "run")
    return run, influence_run(**run.sections())


def independent_lds(run) -> list[float]:  # type: ignore[no-untyped-def]
    """Per query, the LDS of the run's stored scores, from models retrained here with the run's recipe (base seed)."""
    store = run.store()
    [manifest] = Path(store.cache_url, "prepare_data").glob("*/manifest.json")
    data = DataRef.model_validate(storage.read_json(str(manifest), {})["output"]).moved(store.resolve)
    arrays = {name: np.asarray(a[...]) for name, a in open_data(data, {}).items()}
    spec = run.validation
    masks = [subset_mask(spec, i, data.n_train) for i in range(spec.subsets)]
    assert all(mask.sum() == round(0.5 * data.n_train) for mask in masks) and not np.array_equal(masks[0], masks[1])
    measured = []
    for mask in masks:  # retrain with the run's recipe, measure the query losses independently
        torch.manual_seed(run.training.seed)
        model = build_model(run.model, data)
        train(model, run.model, run.training, arrays["x_train"][mask], arrays["y_train"][mask])
        with torch.no_grad():
            logits = model(torch.from_numpy(arrays["x_test"][: spec.queries]))
        measured.append(F.cross_entropy(logits, torch.from_numpy(arrays["y_test"][: spec.queries]).long(), reduction="none").numpy())
    scores = read_outputs(store)[1]["scores"][: spec.queries].astype(np.float64)
    predicted = -(np.stack(masks).astype(np.float64) @ scores.T)
    return [spearmanr(predicted[:, q], np.stack(measured)[:, q]).statistic for q in range(spec.queries)]


def test_lds_equals_an_independent_computation(validated) -> None:
    run, summary = validated
    spec = run.validation
    expected = independent_lds(run)
    validation = summary["validation"]
    np.testing.assert_allclose(validation["lds_per_query"], expected, rtol=1e-9, atol=1e-9)
    assert validation["lds_mean"] == pytest.approx(np.mean(expected))
    assert validation["lds_stderr"] == pytest.approx(np.std(expected, ddof=1) / np.sqrt(spec.queries))
    assert validation["subsets_computed"] == spec.subsets and validation["queries"] == spec.queries
    assert validation["concurrent_retrainings"] == 1  # the sequential cluster: one after another here
    assert validation["lds_mean"] > 0.3  # exact influence on logistic regression predicts its retrainings
    stored = json.loads(Path(run.output_url, "summary.json").read_text())["validation"]
    assert stored["lds_per_query"] == validation["lds_per_query"]
    assert summary["stages"]["validate"]["outcome"] == "computed"


def test_the_lds_is_published_as_an_artifact(validated) -> None:
    _, summary = validated
    with get_client(sync_client=True) as client:
        [artifact] = [a for a in client.read_latest_artifacts() if a.key == "influence-validation"]
    assert f"LDS {summary['validation']['lds_mean']:.3f}" in str(artifact.data)


@pytest.mark.slow
def test_a_stopped_validation_retrains_only_the_missing_subsets_on_a_dask_cluster(validated) -> None:
    sequential, first = validated
    run = sequential.model_copy(update={"compute": sequential.compute.model_copy(update={"cluster": "local", "n_workers": 2})})
    [stage] = Path(run.store().cache_url, "validate").iterdir()
    for name in ("manifest.json", "validation.json", "subsets/1.json", "subsets/4.json"):
        (stage / name).unlink()
    (stage / "subsets" / "2.json").write_text('{"index": 2, "measu')  # cut short: retrained, never read
    again = influence_run(**run.sections())
    assert again["stages"]["validate"]["outcome"] == "computed"
    assert again["validation"]["subsets_computed"] == 3
    assert again["validation"]["concurrent_retrainings"] == min(2, max(1, CPU_COUNT // run.compute.torch_threads))  # never more threads than cores
    assert again["validation"]["lds_per_query"] == first["validation"]["lds_per_query"]


def test_validation_that_cannot_retrain_is_refused_naming_the_field(tmp_path) -> None:
    with pytest.raises(ValidationError, match=r"validation.subsets: the model comes from model.checkpoint"):
        params(tmp_path / "ckpt", model={"architecture": "linear", "checkpoint": str(tmp_path / "model.pt")})
    with pytest.raises(ValidationError, match=r"validation.subsets: 2 subsets give no rank correlation"):
        small_params(str(tmp_path / "two"), validation={"subsets": 2})


def test_show_prints_the_lds(validated) -> None:
    from typer.testing import CliRunner

    from flows.cli import app

    run, summary = validated
    shown = CliRunner().invoke(app, ["show", run.output_url, "--queries", "1"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert f"LDS {summary['validation']['lds_mean']:.3f} ± {summary['validation']['lds_stderr']:.3f} over 6 retrainings on 50% subsets, 5 queries" in shown.output


def test_an_ensemble_is_validated_on_its_mean_scores(tmp_path) -> None:
    """With training.ensemble, the subsets are retrained with the base seed and ranked against the members' mean scores."""
    run = params(tmp_path / "run", training={"epochs": 10, "ensemble": 2})
    summary = influence_run(**run.sections())
    assert "fit_model[1]" in summary["stages"] and summary["stages"]["validate"]["outcome"] == "computed"
    np.testing.assert_allclose(summary["validation"]["lds_per_query"], independent_lds(run), rtol=1e-9, atol=1e-9)
