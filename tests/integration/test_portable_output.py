"""An output is portable and self-describing: moved on disk or copied to S3 (as `aws s3 sync` would), it still
shows, verifies and reruns without recomputing anything; plain-zarr readers find each axis named and the score
convention in the group attributes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import s3fs
import torch
import zarr
from typer.testing import CliRunner

from flows.cli import app
from flows.influence_run import influence_run
from influence_core.pipeline.score.layout import DIMENSIONS
from tests.helpers import assert_same_outputs, read_outputs, small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
runner = CliRunner()


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("portable") / "run"
    params = small_params(str(root))
    influence_run(**params.sections())
    _, arrays = read_outputs(params.store())
    return root, arrays


def _unchanged(summary: dict) -> dict[str, str]:
    return {name: stage["outcome"] for name, stage in summary["stages"].items() if stage["outcome"] not in ("cached", "found complete")}


def test_a_moved_output_shows_verifies_and_reruns_without_computing(finished: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    original, expected = finished
    moved = tmp_path / "elsewhere" / "out2"
    moved.parent.mkdir()
    shutil.copytree(original, moved)  # `mv` to another directory, keeping the original for the other tests
    holding_old_path = [str(p.relative_to(moved)) for p in moved.rglob("*") if p.is_file() and str(original).encode() in p.read_bytes()]
    assert holding_old_path == []  # every reference inside the output is relative to its root
    shown = runner.invoke(app, ["show", str(moved), "--queries", "2"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    verified = runner.invoke(app, ["verify", str(moved)])
    assert verified.exit_code == 0, verified.output
    summary = influence_run(**small_params(str(moved)).sections())
    assert _unchanged(summary) == {}  # the stage keys do not depend on where the output lives
    assert_same_outputs(small_params(str(moved)).store(), expected)


def test_an_output_copied_to_s3_shows_verifies_and_reruns_without_computing(finished: tuple[Path, dict[str, np.ndarray]], s3_endpoint: str, s3_bucket: str) -> None:
    original, expected = finished
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    fs.put(str(original), f"{s3_bucket}/copied", recursive=True)  # what `aws s3 sync` does: the same keys under the prefix
    url = f"s3://{s3_bucket}/copied"
    shown = runner.invoke(app, ["show", url, "--endpoint-url", s3_endpoint, "--queries", "2"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    verified = runner.invoke(app, ["verify", url, "--endpoint-url", s3_endpoint])
    assert verified.exit_code == 0, verified.output
    params = small_params(url, storage={"endpoint_url": s3_endpoint})
    assert _unchanged(influence_run(**params.sections())) == {}
    assert_same_outputs(params.store(), expected)


def test_arrays_name_their_axes_and_the_group_states_the_convention(finished: tuple[Path, dict[str, np.ndarray]]) -> None:
    original, expected = finished
    group = zarr.open_group(str(original / "influence.zarr"), mode="r")  # plain zarr, no pipeline code
    named = {name: group[name].metadata.dimension_names for name in expected}
    assert named == {name: DIMENSIONS[name] for name in expected}
    assert named["scores"] == ("query", "train") and named["topk_helpful_indices"] == ("query", "k") and named["self_influence"] == ("train",)
    assert "positive = helpful" in group.attrs["score_sign"]
    assert "(H + lambda I)^-1" in group.attrs["score_convention"] and "n_train" in group.attrs["score_units"]
    refs = group.attrs["refs"]
    assert refs["compute_influences"]["url"] == "influence.zarr/scores" and refs["fit_model"]["url"].startswith("stages/fit_model/")


def test_summary_lists_the_parameters_attributed(finished: tuple[Path, dict[str, np.ndarray]]) -> None:
    """summary.json says which parameters the scores are over, with counts equal to the stored model's."""
    original, _ = finished
    summary = json.loads((original / "summary.json").read_text())
    state = torch.load(next(original.glob("stages/fit_model/*/model.pt")), weights_only=True)
    assert summary["parameters"]["included"]["names"] == list(state)  # every trainable tensor of the MLP, none frozen
    assert summary["parameters"]["included"]["elements"] == sum(t.numel() for t in state.values()) == 64 * 8 + 8 + 8 * 10 + 10
    assert summary["parameters"]["frozen"]["tensors"] == summary["parameters"]["excluded"]["tensors"] == 0
