"""TRAK-style ensembles (`training.ensemble: n`): member m is the model trained with seed + m, each member's model,
curvature and query factors are stages of their own, and the scores and self-influences are the members' mean."""

from __future__ import annotations

import numpy as np
import pytest
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName

from flows.influence_run import influence_run
from influence_core import DirectInfluence
from influence_core.pipeline.store.loading import load_model
from influence_core.pipeline.store.publish import stored_refs
from influence_core.pipeline.store.refs import ModelRef
from influence_core.pipeline.report.verify import verify_run
from tests.helpers import read_outputs, small_params, stored_model_and_data

pytestmark = pytest.mark.usefixtures("prefect_api")
MEMBER_STAGES = ("fit_model", "fit_preconditioner", "index_training", "compute_test_factors")
N_TRAIN = 240


def member_names(index: int) -> list[str]:
    """The summary's names of member `index`'s stages."""
    return [f"{stage}[{index}]" if index else stage for stage in MEMBER_STAGES]


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    """The reference: two single-model runs, seeds 0 and 1, each at its own output (and so its own stage cache)."""
    root = tmp_path_factory.mktemp("singles")
    runs = []
    for seed in (0, 1):
        params = small_params(str(root / f"seed{seed}"), training__seed=seed)
        runs.append((influence_run(**params.sections()), read_outputs(params.store())[1]))
    return runs


@pytest.fixture(scope="module")
def pair(tmp_path_factory, dask_address):
    """An ensemble of two (seed 0) scored on the shared LocalCluster: its parameters, summary and arrays."""
    compute = {"cluster": "address", "address": dask_address, "train_chunk_rows": 64}
    params = small_params(str(tmp_path_factory.mktemp("ensemble") / "run"), training__ensemble=2, compute=compute)
    summary = influence_run(**params.sections())
    return params, summary, read_outputs(params.store())[1]


def test_scores_and_self_influence_are_the_mean_of_single_runs(singles, pair):
    _, _, arrays = pair
    first, second = (outputs for _, outputs in singles)
    assert not np.allclose(first["scores"], second["scores"], rtol=0.1)  # the members really differ
    for name in ("scores", "self_influence"):
        expected = (first[name].astype(np.float64) + second[name]) / 2
        np.testing.assert_allclose(arrays[name], expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max(), err_msg=name)
    scores = arrays["scores"]  # the aggregates are the ensemble's
    np.testing.assert_array_equal(arrays["argmax"], scores.argmax(1))
    np.testing.assert_array_equal(arrays["topk_helpful_indices"], np.argsort(-scores, axis=1, kind="stable")[:, :4])
    np.testing.assert_allclose(arrays["train_totals"], scores.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)


def test_each_member_is_its_own_stage_and_its_work_is_counted(singles, pair):
    params, summary, _ = pair
    stages = summary["stages"]
    assert list(stages) == ["prepare_data", *member_names(0), *member_names(1), "compute_influences", "aggregate"]
    assert {stage["outcome"] for stage in stages.values()} == {"computed"}
    for index, (single, _) in enumerate(singles):  # member m is the single model of seed + m: the same stage keys
        for name, stage in zip(member_names(index), MEMBER_STAGES):
            assert stages[name]["fingerprint"] == single["stages"][stage]["fingerprint"], name
    work = stages["compute_influences"]["work"]
    assert work == {key: sum(single["stages"]["compute_influences"]["work"][key] for single, _ in singles) for key in work}
    assert stages["compute_influences"]["gradient_rows"] == 0 and work["index_rows"] == 2 * N_TRAIN  # each member's index read once
    assert [stages[name]["gradient_rows"] for name in ("index_training", "index_training[1]")] == [N_TRAIN, N_TRAIN]
    assert all(check.ok for check in verify_run(params.store())), verify_run(params.store())


def test_member_task_runs_are_named_for_their_member(pair):
    """In the Prefect UI, member 1's task runs read fit_model[1] etc., in the same flow run as member 0's stages."""
    with get_client(sync_client=True) as client:
        run = max(client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=["fit_model[1]"]))), key=lambda t: t.created)
        names = {t.name for t in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.flow_run_id])))}
    assert set(member_names(1)) <= names and not any(name.startswith("fit_model[") and name != "fit_model[1]" for name in names)
    assert any(name.startswith("fit_model-") for name in names)  # member 0 keeps Prefect's own naming


def test_growing_the_ensemble_trains_only_the_new_member(pair, dask_address):
    """A rerun with three members at the same output (other parameters: overwrite) finds members 0 and 1 and computes
    member 2; the scores are the mean of the library's scores on the three stored models."""
    params, _, _ = pair
    grown = small_params(params.output_url, training__ensemble=3, compute=params.compute.model_dump(), overwrite=True)
    summary = influence_run(**grown.sections())
    outcomes = {name: stage["outcome"] for name, stage in summary["stages"].items()}
    assert {outcomes[name] for name in member_names(0) + member_names(1)} <= {"cached", "found complete"}
    assert {outcomes[name] for name in member_names(2)} == {"computed"}
    assert outcomes["compute_influences"] == "computed" and summary["stages"]["compute_influences"]["work"]["index_rows"] == 3 * N_TRAIN
    assert summary["stages"]["index_training[2]"]["gradient_rows"] == N_TRAIN and summary["stages"]["compute_influences"]["gradient_rows"] == 0
    store = grown.store()
    group, arrays = read_outputs(store)
    refs = stored_refs(store, group.attrs)
    _, data = stored_model_and_data(store, group)
    expected = np.mean([library_scores(load_model(refs[name], store.options), data, grown) for name in ("fit_model", "fit_model[1]", "fit_model[2]")], axis=0)
    assert isinstance(refs["fit_model[2]"], ModelRef)
    np.testing.assert_allclose(arrays["scores"], expected, rtol=1e-3, atol=1e-4 * np.abs(expected).max())


def library_scores(model, data, params) -> np.ndarray:  # type: ignore[no-untyped-def]
    """One model's scores computed by the library in one go, outside the pipeline."""
    im = DirectInfluence(model, "cross_entropy", params.method.regularization, second_order_mode="gauss_newton").fit((data["x_train"], data["y_train"]))
    return im.influences(data["x_test"], data["y_test"], data["x_train"], data["y_train"]).numpy()
