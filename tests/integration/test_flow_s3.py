"""The flow end to end against a moto S3 server, a real Prefect API and a real Dask LocalCluster."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flows.influence_run import influence_run
from influence_core import ConfigError, DirectInfluence
from tests.helpers import read_outputs, small_params, stored_model_and_data

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture(scope="module")
def s3_run(s3_endpoint, dask_address):
    """One run writing to s3://<bucket>/run on the shared cluster, reached by address."""
    import s3fs

    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).mkdir("flow-results")
    params = small_params(
        "s3://flow-results/run",
        storage={"endpoint_url": s3_endpoint},
        compute={"cluster": "address", "address": dask_address, "train_chunk_rows": 64},
    )
    summary = influence_run(**params.sections())
    store = params.store()
    group, arrays = read_outputs(store)
    return params, summary, store, group, arrays


def test_output_layout_and_status(s3_run):
    params, summary, store, group, arrays = s3_run
    n_test, n_train, k = 12, 240, params.aggregate.top_k
    assert group.attrs["status"] == "complete"
    assert group.attrs["schema_version"] == 1
    expected = {
        "scores": ((n_test, n_train), np.float32),
        "topk_helpful_indices": ((n_test, k), np.int64),
        "topk_helpful_scores": ((n_test, k), np.float32),
        "topk_harmful_indices": ((n_test, k), np.int64),
        "topk_harmful_scores": ((n_test, k), np.float32),
        "argmax": ((n_test,), np.int64),
        "self_influence": ((n_train,), np.float32),
        "train_totals": ((n_train,), np.float32),
    }
    assert {name: (a.shape, a.dtype.type) for name, a in arrays.items()} == expected
    assert not np.isnan(arrays["scores"]).any()
    assert summary["report"] == "s3://flow-results/run/report.png"
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": params.storage.endpoint_url})
    assert fs.cat_file("flow-results/run/report.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert '"status": "complete"' in fs.cat_file("flow-results/run/summary.json").decode()


def test_aggregates_agree_with_scores(s3_run):
    *_, arrays = s3_run
    scores = arrays["scores"]
    np.testing.assert_array_equal(arrays["argmax"], scores.argmax(1))
    k = arrays["topk_helpful_indices"].shape[1]
    np.testing.assert_array_equal(arrays["topk_helpful_indices"], np.argsort(-scores, axis=1, kind="stable")[:, :k])
    np.testing.assert_array_equal(arrays["topk_harmful_indices"], np.argsort(scores, axis=1, kind="stable")[:, :k])
    np.testing.assert_array_equal(arrays["topk_helpful_scores"], np.take_along_axis(scores, arrays["topk_helpful_indices"], 1))
    np.testing.assert_array_equal(arrays["topk_harmful_scores"], np.take_along_axis(scores, arrays["topk_harmful_indices"], 1))
    np.testing.assert_allclose(arrays["train_totals"], scores.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)


def test_scores_and_self_influence_match_the_library(s3_run):
    """Recompute with DirectInfluence on the stored model and data, outside the pipeline."""
    params, _, store, group, arrays = s3_run
    model, data = stored_model_and_data(store, group)
    im = DirectInfluence(model, "cross_entropy", params.method.regularization, second_order_mode="gauss_newton").fit((data["x_train"], data["y_train"]))
    expected_scores = im.influences(data["x_test"], data["y_test"], data["x_train"], data["y_train"]).numpy()
    expected_self = im.self_influences(data["x_train"], data["y_train"]).numpy()
    np.testing.assert_allclose(arrays["scores"], expected_scores, rtol=1e-3, atol=1e-4 * np.abs(expected_scores).max())
    np.testing.assert_allclose(arrays["self_influence"], expected_self, rtol=1e-3, atol=1e-6)
    assert data["y_train"].dtype == torch.int64  # labels keep their integer dtype


def test_attrs_carry_config_without_secrets(s3_run):
    params, _, _, group, _ = s3_run
    attrs = dict(group.attrs)
    assert attrs["config"]["storage"]["endpoint_url"] == params.storage.endpoint_url
    assert set(attrs["fingerprints"]) == {"prepare_data", "fit_model", "fit_preconditioner", "index_training", "compute_test_factors", "compute_influences", "aggregate"}
    assert "torch" in attrs["versions"] and "zarr" in attrs["versions"]
    assert "testing" not in str(attrs)  # the (dummy) AWS credentials of the environment


def test_missing_bucket_names_bucket_and_endpoint(s3_endpoint):
    params = small_params("s3://no-such-bucket/run", storage={"endpoint_url": s3_endpoint})
    with pytest.raises(ConfigError, match=rf"output_url: S3 bucket 'no-such-bucket' does not exist at {s3_endpoint}"):
        influence_run(**params.sections())


def test_top_k_above_n_train_fails_before_training(tmp_path):
    params = small_params(str(tmp_path / "run"), dataset={"n_train": 30, "n_test": 5}, aggregate={"top_k": 31})
    with pytest.raises(ConfigError, match="aggregate.top_k"):
        influence_run(**params.sections())
    assert not (tmp_path / "run" / "stages" / "fit_model").exists()


def test_artifacts_show_the_report_and_every_top_k_column(s3_run):
    """The image artifact is report.png itself, inline (the browser needs no access to the bucket), and the table
    has top_k helpful and harmful columns whose cells are the stored top-k."""
    import base64
    import json

    import s3fs
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    params, summary, store, group, arrays = s3_run
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": params.storage.endpoint_url})
    inline = "data:image/png;base64," + base64.b64encode(fs.cat_file("flow-results/run/report.png")).decode()
    with get_client(sync_client=True) as client:  # this module's run: the last completed one into its output_url
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.COMPLETED]))), sort=FlowRunSort.END_TIME_DESC)
        flow_run = next(r for r in runs if r.parameters.get("output_url") == params.output_url)
        artifacts = {a.key: a for a in client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))}
    report, table = artifacts["influence-report"], artifacts["influence-topk"]
    assert report.type == "image" and report.data == inline
    rows = json.loads(table.data)
    k = params.aggregate.top_k
    assert list(rows[0]) == ["query", "label", *[f"helpful_{i}" for i in range(1, k + 1)], *[f"harmful_{i}" for i in range(1, k + 1)]]
    assert [int(rows[q][f"harmful_{k}"].split()[0][1:]) for q in range(len(rows))] == arrays["topk_harmful_indices"][: len(rows), k - 1].tolist()
    assert f"The {k} most helpful and {k} most harmful" in table.description
