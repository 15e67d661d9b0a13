"""FastIF's candidate prefilter through the flow (real Prefect API, a real LocalCluster or sequential): with k =
n_train it gives exactly the full top-k; with small k only the candidates' gradients are taken, their scores are the
library's, `verify` accepts the layout, and a run that lost a chunk's part resumes with that chunk alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flows.influence_run import influence_run
from influence_core.pipeline.stages import query_factors
from influence_core.pipeline.store import storage
from influence_core.pipeline.score.knn_prefilter import knn_candidates
from influence_core.pipeline.runtime.cluster import dask_client
from influence_core.pipeline.store.publish import stored_refs
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.report.verify import verify_run
from influence_core.pipeline.store.refs import DataRef, ModelRef
from influence_core.pipeline.specs import ComputeSpec
from tests.helpers import read_outputs, small_params, stored_model_and_data

pytestmark = pytest.mark.usefixtures("prefect_api")

TOPK = ("topk_helpful_indices", "topk_helpful_scores", "topk_harmful_indices", "topk_harmful_scores", "argmax")


def failed(store) -> list[str]:
    return [check.name for check in verify_run(store) if not check.ok]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> dict[str, np.ndarray]:
    # without a training index: the candidates' scores contract the same captured gradients, so equal bit for bit
    params = small_params(str(tmp_path_factory.mktemp("full") / "run"), compute={"cluster": "sequential", "train_chunk_rows": 64, "index_budget_gb": 0})
    influence_run(**params.sections())
    return read_outputs(params.store())[1]


def test_k_equal_to_n_train_gives_exactly_the_full_topk(tmp_path, full_run, dask_address):
    """On a LocalCluster, against the full run computed sequentially (the small-k test below runs sequentially)."""
    compute = {"cluster": "address", "address": dask_address, "train_chunk_rows": 64}
    params = small_params(str(tmp_path / "run"), compute=compute, candidates={"knn_k": 240})
    summary = influence_run(**params.sections())
    store = params.store()
    group, arrays = read_outputs(store)
    assert "scores" not in arrays and "self_influence" not in arrays
    for name in TOPK:
        np.testing.assert_array_equal(arrays[name], full_run[name], err_msg=name)
    rows = np.arange(12)[:, None]
    np.testing.assert_array_equal(arrays["candidate_scores"], full_run["scores"][rows, arrays["candidate_indices"]])
    np.testing.assert_allclose(arrays["train_totals"], full_run["train_totals"], rtol=1e-5, atol=1e-5 * np.abs(full_run["train_totals"]).max())
    assert summary["stages"]["compute_influences"]["candidates"]["scored_rows"] == 240
    assert failed(store) == []


def test_small_k_scores_only_the_candidates_and_resumes_a_lost_chunk(tmp_path):
    params = small_params(str(tmp_path / "run"), candidates={"knn_k": 6, "index": "hnsw"})
    summary = influence_run(**params.sections())
    store = params.store()
    group, arrays = read_outputs(store)
    model, data = stored_model_and_data(store, group)
    indices = arrays["candidate_indices"]
    assert indices.shape == (12, 6) and all(len(set(row)) == 6 for row in indices.tolist())
    assert ((indices >= 0) & (indices < 240)).all()
    np.testing.assert_array_equal(indices, knn_candidates(model, data["x_train"], data["x_test"], 6, index="hnsw"))
    im = params.method.build(model, "cross_entropy").fit((data["x_train"], data["y_train"]))
    full = im.influences(data["x_test"], data["y_test"], data["x_train"], data["y_train"])
    expected = torch.gather(full, 1, torch.from_numpy(indices)).numpy()
    np.testing.assert_allclose(arrays["candidate_scores"], expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    np.testing.assert_array_equal(arrays["argmax"], indices[np.arange(12), np.argmax(arrays["candidate_scores"], axis=1)])
    stage = summary["stages"]["compute_influences"]
    assert stage["gradient_rows"] == stage["candidates"]["scored_rows"] == len(np.unique(indices)) < 240
    assert failed(store) == []

    # lose the candidate arrays, one chunk's part and the stage's manifest, as a run killed mid-stage would
    location = storage.join(store.cache_url, "compute_influences", stage["fingerprint"])
    first = sorted(set((indices // 64).ravel().tolist()))[0]
    storage.remove(storage.join(location, "parts", f"{first}.npy"), store.options)
    storage.remove(storage.join(location, "manifest.json"), store.options)
    g = storage.open_group(store.influence_url, store.options, mode="a")
    del g["candidate_scores"]
    g.attrs["status"] = "running"
    assert "candidate_scores" in failed(store) and "status" in failed(store)  # a partial run never looks complete
    again = influence_run(**params.sections())["stages"]["compute_influences"]
    assert again["outcome"] == "computed" and again["chunks_computed"] == 1
    assert again["gradient_rows"] == len(np.unique(indices[indices // 64 == first]))  # that chunk's candidates only
    _, resumed = read_outputs(store)
    for name in ("candidate_indices", "candidate_scores", *TOPK, "train_totals"):
        np.testing.assert_array_equal(resumed[name], arrays[name], err_msg=name)
    assert failed(store) == []


FAST_LISSA = {"name": "lissa", "regularization": 0.1, "depth": 20, "repeats": 4, "lissa_batch_size": 1, "scale": 50.0, "rtol": 1e-12}


def test_parallel_lissa_repeats_give_the_same_factors_on_any_cluster(tmp_path, dask_address):
    """FastIF's parallel s_test: T = 4 repeats of B = 1 as Dask tasks, summed by the driver: the same bits on a
    LocalCluster as sequentially (the flow's run), and the library's factors."""
    params = small_params(str(tmp_path / "run"), method=FAST_LISSA, aggregate={"top_k": 4, "self_influence": "off"})
    summary = influence_run(**params.sections())
    stage = summary["stages"]["compute_test_factors"]
    assert stage["outcome"] == "computed" and stage["work"]["solves"] == 12 and stage["work"]["solver_iterations"] == 4 * 20
    sequential = np.asarray(storage.open_array(stage["url"], {})[...])
    group, _ = read_outputs(params.store())
    refs = stored_refs(params.store(), group.attrs)
    model_ref, data_ref, curvature = refs["fit_model"], refs["prepare_data"], refs["fit_preconditioner"]
    assert isinstance(model_ref, ModelRef) and isinstance(data_ref, DataRef)
    elsewhere = RunStore(output_url=str(tmp_path / "other"))  # a fresh stage cache: computed again, on the cluster
    on_cluster = ComputeSpec(cluster="address", address=dask_address)
    stage = query_factors.QueryFactorsInput(params.method, model_ref, data_ref, curvature, elsewhere, params.compute.torch_threads)
    ref = query_factors.run(stage, client_factory=lambda: dask_client(on_cluster, False))
    np.testing.assert_array_equal(np.asarray(storage.open_array(ref.url, {})[...]), sequential)
    model, data = stored_model_and_data(params.store(), group)
    im = params.method.build(model, "cross_entropy").fit((data["x_train"], data["y_train"]))
    np.testing.assert_allclose(sequential, im.influence_factors(data["x_test"], data["y_test"]).numpy(), rtol=1e-4, atol=1e-6)
