"""A full disk: before compute_influences the free space is checked against the scores' known size (a warning
when short); a write that finds the disk full fails the run at once, in one line naming output_url and the space
needed, without retries, and the run never looks complete. The disk is a real 1 MB tmpfs (needs root to mount)."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import Result
from typer.testing import CliRunner

from flows.cli import app
from influence_core.pipeline.store import storage
from influence_core.pipeline.score.scoring import space_warning
from influence_core.pipeline.store.refs import DataRef
from tests.helpers import read_outputs, small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
N_TRAIN, N_TEST = 1400, 200  # scores of 1.12 MB: more than the disk holds (digits has 1,437 training rows)


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


def fill(path: Path) -> None:
    """Take every free block of the disk that holds `path`."""
    try:
        with path.open("wb") as out:
            while True:
                out.write(b"\0" * 4096)
                out.flush()
    except OSError as exc:
        assert exc.errno == errno.ENOSPC


@pytest.mark.slow
def test_a_full_disk_while_publishing_fails_in_one_line_and_the_run_stays_running(small_disk: Path, tmp_path: Path) -> None:
    """The closing writes (report.png, summary.json, the group's attributes) get the same one line as the stages:
    a finished run on the small disk, its report and summary gone and the disk then filled, reruns with every stage
    found complete and fails at publish, its scores untouched; once there is room again, the same command completes it."""
    params = small_params(str(small_disk / "run"), storage={"cache_url": str(tmp_path / "cache")}, compute={"cluster": "sequential"})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(params.model_dump(mode="json")))

    def run() -> Result:
        return CliRunner().invoke(app, ["run", "--config", str(config)], terminal_width=400)

    assert run().exit_code == 0
    _, before = read_outputs(params.store())
    for name in ("report.png", "summary.json"):
        (small_disk / "run" / name).unlink()
    filler = small_disk / "filler"
    fill(filler)

    result = run()
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output, result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("output_url: ")]
    assert f"the disk under {small_disk / 'run'} is full" in line and "while publish wrote" in line and "for report.png and summary.json" in line, line
    assert not (small_disk / "run" / "summary.json").exists()
    _, after = read_outputs(params.store())  # what was written before is neither lost nor damaged
    for name, array in before.items():
        np.testing.assert_array_equal(after[name], array)

    filler.unlink()
    assert run().exit_code == 0
    assert storage.open_group(params.store().influence_url, {}, mode="r").attrs["status"] == "complete"
