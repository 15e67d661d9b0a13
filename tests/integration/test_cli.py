"""The command-line interface, in process, against the real Prefect API and moto S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import typer
import yaml
from typer.testing import CliRunner

from flows.cli import app
from influence_core.pipeline.store.run_store import RunStore
from influence_core.version import CODE_VERSION
from tests.helpers import read_outputs, shown_indices, small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


EXE = Path(sys.executable).with_name("influence-pipeline")  # the installed entry point of this virtual environment
HEAVY = ("torch", "prefect", "zarr", "dask")
COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def test_every_command_is_covered():
    assert COMMANDS == ["demo", "query", "repair", "run", "show", "verify"]  # a new command joins the help tests below


@pytest.mark.parametrize("command", [[], *([name] for name in COMMANDS)], ids=lambda c: " ".join(c) or "top")
def test_every_command_has_help(command):
    """The installed command's help, in a process of its own; its summary line is the command's docstring."""
    done = subprocess.run([str(EXE), *command, "--help"], capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert f"Usage: influence-pipeline {' '.join(command)}".rstrip() in done.stdout
    callback = typer.main.get_command(app).commands[command[0]].callback if command else None  # type: ignore[attr-defined]
    summary = (callback.__doc__ if callback else "Influence functions for PyTorch models at scale").splitlines()[0][:60]
    assert summary in " ".join(done.stdout.split())


def test_help_imports_no_heavy_module():
    """The non-timing check that --help and --version are quick: neither importing the CLI nor rendering every
    command's help nor the version loads torch, Prefect, zarr or Dask (each seconds to import); commands import them
    when they run."""
    imported = "import flows.cli, sys; print(sorted(m for m in ('torch','prefect','zarr','dask') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", imported], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.strip() == "[]", done.stderr
    helps = f"""
import sys
from flows.cli import app
for command in ([], *([name] for name in {COMMANDS!r}), ["--version"]):
    try:
        app([*command, "--help"] if command != ["--version"] else command)
    except SystemExit as exc:
        assert exc.code == 0, (command, exc.code)
print(sorted(m for m in {HEAVY!r} if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", helps], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_version_prints_package_version_and_commit():
    """`--version` and summary.json's `commit` (tested with a run below) name this checkout's HEAD."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    done = subprocess.run([str(EXE), "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"influence-pipeline {version('influence-pipeline')} (commit {head})"


@pytest.mark.slow
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
    from influence_core.pipeline.store import storage

    group = storage.open_group(str(tmp_path / "influence.zarr"), {}, mode="w")
    group.attrs["status"] = "running"
    result = runner.invoke(app, ["show", str(tmp_path)])
    assert result.exit_code == 1
    assert "not complete" in " ".join(result.output.split())


@pytest.fixture(scope="module")
def stored_run(tmp_path_factory: pytest.TempPathFactory, prefect_api: None) -> Path:
    """A finished local run with top_k = 4 (small_params), made by `run`."""
    root = tmp_path_factory.mktemp("show") / "run"
    config = root.parent / "run.yaml"
    config.write_text(yaml.safe_dump(small_params(str(root)).model_dump(mode="json")))
    result = runner.invoke(app, ["run", "--config", str(config)])
    assert result.exit_code == 0, result.output
    return root


@pytest.mark.parametrize("top", [None, 1, 4])
def test_show_top_shows_that_many_of_the_stored_examples(stored_run, top):
    """`show --top K` prints the K most helpful and most harmful examples per query, ranked as the scores rank them
    (the reference: argsort of the stored scores); without --top, all top_k = 4 the run stored."""
    _, arrays = read_outputs(RunStore(output_url=str(stored_run)))
    k = top or 4
    option = [] if top is None else ["--top", str(top)]
    result = runner.invoke(app, ["show", str(stored_run), "--queries", "3", *option], terminal_width=200)
    assert result.exit_code == 0, result.output
    scores = arrays["scores"][:3]
    assert shown_indices(result.output, 2) == np.argsort(-scores, axis=1, kind="stable")[:, :k].tolist()
    assert shown_indices(result.output, 3) == np.argsort(scores, axis=1, kind="stable")[:, :k].tolist()


def test_show_refuses_more_than_the_stored_top_k(stored_run):
    result = runner.invoke(app, ["show", str(stored_run), "--top", "5"], terminal_width=300)
    assert result.exit_code == 1
    line = " ".join(result.output.split())
    assert line.startswith("--top: 5 is more than the 4 examples per query the run stores (its top_k). Fix: give --top 4 or less"), line
    assert "Traceback" not in result.output


def test_summary_records_the_commit(stored_run):
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    summary = json.loads((stored_run / "summary.json").read_text())
    assert summary["commit"] == head
    assert summary["code_version"] == CODE_VERSION  # what stage keys hold stays beside it


def test_summary_states_the_resolved_task(stored_run):
    """Issue 35, item 1: model.task left at auto is recorded as the task that ran (the loss's), never as auto."""
    summary = json.loads((stored_run / "summary.json").read_text())
    assert summary["task"] == "classification" and summary["config"]["model"]["task"] == "auto"


def test_summary_records_only_the_sources_fields(stored_run):
    """The digits run's recorded config holds the digits' own settings, no synthetic ones (n_classes, n_features,
    noise), in summary.json and in the group's attributes."""
    summary = json.loads((stored_run / "summary.json").read_text())
    group, _ = read_outputs(RunStore(output_url=str(stored_run)))
    for config in (summary["config"], group.attrs["config"]):
        assert config["dataset"] == {"source": "digits", "n_train": 240, "n_test": 12, "seed": 0, "chunk_rows": 64, "query_offset": 0, "test_fraction": 0.2}
