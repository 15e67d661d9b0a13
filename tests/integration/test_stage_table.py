"""What the run tells a person about itself: the model's losses and accuracies (fit_model), what each stage cost
this run (a cached stage its seconds now, noting its first cost) and the whole run's wall time, in the CLI's stage
table, summary.json and the Prefect summary artifact."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from flows.cli import app
from influence_core.pipeline.store.run_store import RunStore
from tests.helpers import read_outputs, small_params, stored_model_and_data

pytestmark = pytest.mark.usefixtures("prefect_api")
runner = CliRunner()
LINE = re.compile(r"^  (\w+(?: run)?) +(computed|cached|found complete|wall time) +([\d.]+) s(?:   (.*))?$")


def stage_lines(output: str) -> dict[str, tuple[str, float, str]]:
    """The stage table the CLI prints after a run: stage → (outcome, seconds, note)."""
    return {m[1]: (m[2], float(m[3]), m[4] or "") for m in map(LINE.match, output.splitlines()) if m}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory, prefect_api: None) -> tuple[Path, str, dict, str, dict]:
    """The same `run` twice: the first computes every stage, the second finds them all cached."""
    root = tmp_path_factory.mktemp("table") / "run"
    config = root.parent / "run.yaml"
    config.write_text(yaml.safe_dump(small_params(str(root)).model_dump(mode="json")))
    outputs = []
    for _ in range(2):
        result = runner.invoke(app, ["run", "--config", str(config)], terminal_width=300)
        assert result.exit_code == 0, result.output
        outputs += [result.output, json.loads((root / "summary.json").read_text())]
    return root, *outputs


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The share of rows whose argmax logit is the label, computed here apart from the pipeline."""
    with torch.no_grad():
        return float((model(x).argmax(1) == y).double().mean())


def test_training_is_visible_with_losses_and_accuracies_matching_the_stored_model(two_runs):
    root, output, summary, _, _ = two_runs
    model, arrays = stored_model_and_data(RunStore(output_url=str(root)), read_outputs(RunStore(output_url=str(root)))[0])
    metrics = summary["stages"]["fit_model"]["metrics"]
    assert metrics["train_accuracy"] == pytest.approx(accuracy(model, arrays["x_train"], arrays["y_train"]), abs=1e-12)
    assert metrics["query_accuracy"] == pytest.approx(accuracy(model, arrays["x_test"], arrays["y_test"]), abs=1e-12)
    with torch.no_grad():
        for split in ("train", "test"):
            loss = float(torch.nn.functional.cross_entropy(model(arrays[f"x_{split}"]), arrays[f"y_{split}"]))
            assert metrics[f"{split.replace('test', 'query')}_loss"] == pytest.approx(loss, rel=1e-5)
    assert 0.5 < metrics["train_accuracy"] <= 1  # trained: far above chance (10 classes)
    note = stage_lines(output)["fit_model"][2]
    assert note == f"train loss {metrics['train_loss']:.4g}, train accuracy {metrics['train_accuracy']:.1%}, query loss {metrics['query_loss']:.4g}, query accuracy {metrics['query_accuracy']:.1%}"


def test_the_summary_artifact_shows_the_accuracies_and_the_wall_time(two_runs):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    _, _, _, _, summary = two_runs
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["influence-summary"])), limit=200)
    metrics = summary["stages"]["fit_model"]["metrics"]
    shown = (f"query accuracy {metrics['query_accuracy']:.1%}", f"train loss {metrics['train_loss']:.4g}", f"| **whole run** | wall time | {summary['wall_seconds']:.2f} |")
    assert any(all(text in a.data for text in shown) for a in artifacts), "no summary artifact of this run with its accuracies and wall time"


def test_cached_stages_show_what_they_cost_now_and_the_whole_run_its_wall_time(two_runs):
    _, first_output, first, output, summary = two_runs
    lines = stage_lines(output)
    stages = summary["stages"]
    assert {name: lines[name][0] for name in stages} == {name: "cached" for name in stages}
    for name, stage in stages.items():
        outcome, seconds, note = lines[name]
        assert seconds == pytest.approx(stage["wall_seconds"], abs=0.006)  # what it cost this run, not its first compute
        assert note.endswith(f"computed earlier in {first['stages'][name]['seconds']:.2f} s")
    assert stages["fit_model"]["wall_seconds"] < first["stages"]["fit_model"]["seconds"]
    for text, run in ((first_output, first), (output, summary)):
        outcome, seconds, _ = stage_lines(text)["whole run"]
        assert seconds == pytest.approx(run["wall_seconds"], abs=0.006)
        assert sum(s["wall_seconds"] for s in run["stages"].values()) <= run["wall_seconds"]
