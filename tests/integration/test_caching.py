"""Stages are cached on fingerprints and config, and the store, not Prefect's cache, decides what is complete."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from flows.influence_run import influence_run
from tests.helpers import read_outputs, small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
STAGES = ["prepare_data", "fit_model", "fit_preconditioner", "index_training", "compute_test_factors", "compute_influences", "aggregate"]


def outcomes(summary):
    return {name: stage["outcome"] for name, stage in summary["stages"].items()}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    params = small_params(str(tmp_path_factory.mktemp("cache") / "run"))
    summary = influence_run(**params.sections())
    return params, summary


def test_first_run_computes_every_stage(first_run):
    _, summary = first_run
    assert outcomes(summary) == dict.fromkeys(STAGES, "computed")


def test_same_parameters_recompute_nothing(first_run):
    params, first = first_run
    _, before = read_outputs(params.store())
    second = influence_run(**params.sections())
    assert set(outcomes(second).values()) <= {"cached", "found complete"}
    assert all(second["stages"][s]["fingerprint"] == first["stages"][s]["fingerprint"] for s in STAGES)
    _, after = read_outputs(params.store())
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


def test_changing_top_k_reruns_only_aggregate(first_run):
    params, _ = first_run
    changed = params.model_copy(update={"aggregate": params.aggregate.model_copy(update={"top_k": 2}), "overwrite": True})  # other parameters, same output
    summary = influence_run(**changed.sections())
    got = outcomes(summary)
    assert got.pop("aggregate") == "computed"
    assert set(got.values()) <= {"cached", "found complete"}
    group, arrays = read_outputs(changed.store())
    assert arrays["topk_helpful_indices"].shape == (12, 2)
    np.testing.assert_array_equal(arrays["topk_helpful_indices"], np.argsort(-arrays["scores"], axis=1, kind="stable")[:, :2])
    assert group.attrs["status"] == "complete"


def test_deleted_outputs_are_recomputed_despite_prefect_cache(tmp_path):
    params = small_params(str(tmp_path / "run"))
    influence_run(**params.sections())
    _, before = read_outputs(params.store())
    shutil.rmtree(tmp_path / "run")
    summary = influence_run(**params.sections())  # Prefect still holds cached refs that point at deleted files
    assert outcomes(summary) == dict.fromkeys(STAGES, "computed")
    _, after = read_outputs(params.store())
    np.testing.assert_allclose(after["scores"], before["scores"], rtol=1e-5, atol=1e-6)


def test_deleted_scores_only_recompute_scores_and_aggregate(tmp_path):
    params = small_params(str(tmp_path / "run"))
    influence_run(**params.sections())
    shutil.rmtree(tmp_path / "run" / "influence.zarr")
    got = outcomes(influence_run(**params.sections()))
    assert got["compute_influences"] == "computed" and got["aggregate"] == "computed"
    assert {got[s] for s in STAGES[:4]} <= {"cached", "found complete"}


def test_local_cluster_kind_gives_identical_scores(first_run, tmp_path):
    params, _ = first_run
    _, sequential = read_outputs(params.store())
    local = params.model_copy(update={"output_url": str(tmp_path / "local"), "compute": params.compute.model_copy(update={"cluster": "local", "n_workers": 2})})
    influence_run(**local.sections())
    _, arrays = read_outputs(local.store())
    np.testing.assert_array_equal(arrays["scores"], sequential["scores"])



def test_results_need_no_block_per_output_url(tmp_path):
    """Prefect's results go to its default result storage, not to a block saved per output: runs to two output URLs
    save no block, write no Prefect record into either output, and a rerun is served from Prefect's cache (Cached)
    because the store still holds every stage."""
    import os
    from pathlib import Path

    from prefect import get_client

    first, second = (small_params(str(tmp_path / name)) for name in ("a", "b"))
    records = Path(os.environ["PREFECT_LOCAL_STORAGE_PATH"])
    with get_client(sync_client=True) as client:
        blocks = {block.id for block in client.read_block_documents()}
    summary = influence_run(**first.sections())
    assert set(outcomes(summary).values()) <= {"computed", "cached", "found complete"}
    assert outcomes(influence_run(**second.sections())) == dict.fromkeys(STAGES, "computed")  # b's store was empty: never served from a's cache
    with get_client(sync_client=True) as client:
        assert {block.id for block in client.read_block_documents()} == blocks
    assert not [p for p in tmp_path.rglob("*") if "prefect-results" in str(p)]
    keys = {stage: key.name for stage in STAGES for key in (tmp_path / "a" / "stages" / stage).iterdir()}
    assert all((records / key).is_file() for key in keys.values()), keys  # Prefect's record of each stage, by its key
    assert outcomes(influence_run(**first.sections())) == dict.fromkeys(STAGES, "cached")
