"""`verify`: a good run passes every check; each corruption is reported by the check it concerns and by the integrity
check of the stage that wrote the bytes, and by no other."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zarr
from typer.testing import CliRunner

from flows.cli import app
from flows.influence_run import influence_run
from influence_core.pipeline.store import storage
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.report.verify import verify_run
from tests.helpers import small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
runner = CliRunner()
CHECKS = [
    "status", "attributes", "summary.json", "scores", "topk_helpful_indices", "topk_helpful_scores", "topk_harmful_indices", "topk_harmful_scores",
    "argmax", "train_totals", "self_influence", "fingerprints",
    *(f"stage {name}" for name in ("prepare_data", "fit_model", "fit_preconditioner", "index_training", "compute_test_factors", "compute_influences", "aggregate")),
    "scores complete", "top-k helpful", "top-k harmful", "argmax", "train_totals", "self_influence finite",
]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory, prefect_api: None) -> Path:
    root = tmp_path_factory.mktemp("verify") / "run"
    influence_run(**small_params(str(root)).sections())
    return root


@pytest.fixture
def run_copy(good_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(good_run, copy)
    return copy


def failed(store: RunStore) -> list[str]:
    return [check.name for check in verify_run(store) if not check.ok]


def group_of(root: Path) -> zarr.Group:
    return storage.open_group(str(root / "influence.zarr"), {}, mode="a")


def test_a_good_run_passes_every_check(good_run: Path) -> None:
    checks = verify_run(RunStore(output_url=str(good_run)))
    assert [c.name for c in checks] == CHECKS
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    result = runner.invoke(app, ["verify", str(good_run)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert f"All {len(CHECKS)} checks passed." in result.output


def swap_top_entry(group: zarr.Group) -> None:
    indices = np.asarray(group["topk_helpful_indices"][...])
    outside = next(i for i in range(group["scores"].shape[1]) if i not in indices[0])
    indices[0, 1] = outside  # a training example that is not among the top k of query 0
    group["topk_helpful_indices"][...] = indices


def scores_nan(group: zarr.Group) -> None:
    group["scores"][3, 100] = np.nan


def totals_off(group: zarr.Group) -> None:
    group["train_totals"][7] = group["train_totals"][7] + 1.0


def argmax_off(group: zarr.Group) -> None:
    argmax = np.asarray(group["argmax"][...])
    argmax[2] = np.asarray(group["topk_helpful_indices"][2, 1])
    group["argmax"][...] = argmax


def self_influence_inf(group: zarr.Group) -> None:
    group["self_influence"][5] = np.inf


def harmful_unsorted(group: zarr.Group) -> None:
    for name in ("topk_harmful_indices", "topk_harmful_scores"):
        values = np.asarray(group[name][...])
        values[0, [0, 1]] = values[0, [1, 0]]
        group[name][...] = values


def status_running(group: zarr.Group) -> None:
    group.attrs["status"] = "running"


def stale_totals(group: zarr.Group) -> None:
    group["train_totals"].attrs["fingerprint"] = "from-another-run"


def scores_of_another_shape(group: zarr.Group) -> None:
    old = group["scores"]
    group.create_array("scores", shape=(old.shape[0], old.shape[1] - 1), dtype="float32", overwrite=True, attributes=dict(old.attrs))


@pytest.mark.parametrize(
    ("corrupt", "expected"),
    [
        (swap_top_entry, ["stage aggregate", "top-k helpful"]),
        (scores_nan, ["stage compute_influences", "scores complete", "aggregates"]),
        (totals_off, ["stage aggregate", "train_totals"]),
        (argmax_off, ["stage aggregate", "argmax"]),
        (self_influence_inf, ["stage compute_influences", "self_influence finite"]),
        (harmful_unsorted, ["stage aggregate", "top-k harmful"]),
        (status_running, ["status"]),
        (scores_of_another_shape, ["scores", "stage compute_influences", "aggregates"]),
        (stale_totals, ["fingerprints", "stage aggregate"]),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_each_corruption_is_reported(run_copy: Path, corrupt: Callable[[zarr.Group], None], expected: list[str]) -> None:
    corrupt(group_of(run_copy))
    assert failed(RunStore(output_url=str(run_copy))) == expected
    result = runner.invoke(app, ["verify", str(run_copy)], terminal_width=200)
    assert result.exit_code == 1 and f"checks failed: {', '.join(expected)}" in result.output, result.output


@pytest.mark.parametrize("name", ["topk_harmful_scores", "self_influence", "train_totals"])
def test_a_deleted_array_is_reported(run_copy: Path, name: str) -> None:
    shutil.rmtree(run_copy / "influence.zarr" / name)
    owner = "stage compute_influences" if name == "self_influence" else "stage aggregate"
    assert failed(RunStore(output_url=str(run_copy))) == [name, owner]


def test_a_missing_summary_is_reported(run_copy: Path) -> None:
    (run_copy / "summary.json").unlink()
    assert failed(RunStore(output_url=str(run_copy))) == ["summary.json"]


def test_ties_may_be_broken_either_way(run_copy: Path) -> None:
    """Five columns share query 0's highest score; any four of them, in any order, are a correct top 4."""
    group = group_of(run_copy)
    scores = np.asarray(group["scores"][...])
    tied = [3, 5, 9, 11, 20]
    scores[0, tied] = scores.max() + 1.0
    group["scores"][...] = scores
    group["topk_helpful_indices"][0] = [20, 3, 11, 9]  # not the order argtopk picks, and without 5
    group["topk_helpful_scores"][0] = scores[0, [20, 3, 11, 9]]
    group["argmax"][0] = 20
    group["train_totals"][...] = scores.sum(axis=0, dtype=np.float64).astype(np.float32)
    store = RunStore(output_url=str(run_copy))
    rewritten = ["stage compute_influences", "stage aggregate"]  # the bytes are not those the stages wrote: only that is reported
    assert failed(store) == rewritten
    below = next(i for i in np.argsort(-scores[0]) if i not in tied)  # the next best, below the tie
    group["topk_helpful_indices"][0, 3] = below
    assert failed(store) == [*rewritten, "top-k helpful"]


@pytest.mark.slow
def test_verify_on_s3(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    params = small_params(f"s3://{s3_bucket}/run", storage={"endpoint_url": s3_endpoint})
    influence_run(**params.sections())
    store = params.store()
    assert failed(store) == []
    result = runner.invoke(app, ["verify", f"s3://{s3_bucket}/run", "--endpoint-url", s3_endpoint], terminal_width=200)
    assert result.exit_code == 0, result.output
    storage.open_group(store.influence_url, store.options, mode="a")["scores"][0, 0] = np.nan
    assert failed(store) == ["stage compute_influences", "scores complete", "aggregates"]
    assert runner.invoke(app, ["verify", f"s3://{s3_bucket}/run", "--endpoint-url", s3_endpoint]).exit_code == 1
