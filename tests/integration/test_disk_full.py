"""A full disk: before compute_influences the free space is checked against the scores' known size (a warning
when short); a write that finds the disk full fails the run at once, in one line naming output_url and the space
needed, without retries, and the run never looks complete. The disk is a real 1 MB tmpfs (needs root to mount)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from influence_core.pipeline import storage
from influence_core.pipeline.scoring import space_warning
from influence_core.pipeline.refs import DataRef
from tests.helpers import small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
N_TRAIN, N_TEST = 1500, 200  # scores of 1.15 MB: more than the disk holds


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_fails_in_one_line_naming_output_url_and_the_space_needed(small_disk: Path, tmp_path: Path) -> None:
    params = small_params(
        str(small_disk / "run"), dataset={"n_train": N_TRAIN, "n_test": N_TEST, "chunk_rows": 256}, storage={"cache_url": str(tmp_path / "cache")},
        compute={"cluster": "sequential", "train_chunk_rows": 128},
    )
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["run", "--config", str(config)], terminal_width=400)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output, result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("output_url: ")]
    [manifest] = (tmp_path / "cache" / "prepare_data").glob("*/manifest.json")
    data = DataRef.model_validate(storage.read_json(str(manifest), {})["output"]).moved(params.store().resolve)
    needed = 4 * data.n_test * data.n_train + 4 * data.n_train  # float32 scores and self-influences
    assert f"the disk under {small_disk / 'run'} is full" in line and f"free at least {storage.megabytes(needed)} for compute_influences's output" in line, line
    group = storage.open_group(params.store().influence_url, {}, mode="r")
    assert group.attrs["status"] == "running"  # a run that could not finish never looks complete

    # the check before compute_influences saw it coming
    warning = space_warning(params.store(), data, params.aggregate)
    assert warning is not None and warning.startswith("output_url: ") and storage.megabytes(needed) in warning
    assert space_warning(small_params(str(tmp_path / "roomy")).store(), data, params.aggregate) is None
