"""Reproducible across processes: the same parameters give bit-identical stage outputs (model, curvature state,
query factors, scores) in a process started with OMP_NUM_THREADS=1 on a sequential cluster and in one started with
OMP_NUM_THREADS=2 on a local Dask cluster."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from influence_core.pipeline.store import storage
from influence_core.pipeline.store.run_store import RunStore
from tests.helpers import small_params

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.slow]


def run_in_process(output: Path, method: dict, cluster: str, omp_threads: int) -> dict:
    """One whole run through the CLI in a fresh interpreter with the given OpenMP/MKL thread environment."""
    from prefect.settings import PREFECT_API_URL

    params = small_params(
        str(output),
        dataset={"n_train": 600, "n_test": 16, "chunk_rows": 128},
        model={"hidden": [32, 16]},
        training={"epochs": 8},
        method=method,
        compute={"cluster": cluster, "n_workers": 2, "train_chunk_rows": 128},
    )
    config = output.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    threads = str(omp_threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", str(config)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((output / "summary.json").read_text())
    store = RunStore(output_url=str(output))  # summary.json records locations relative to the output's root
    return {**summary, "influence": store.resolve(summary["influence"]), "stages": {name: {**stage, "url": store.resolve(stage["url"])} for name, stage in summary["stages"].items()}}


def stage_outputs(summary: dict) -> dict[str, np.ndarray]:
    """Every tensor a stage wrote: the state dicts of fit_model and fit_preconditioner, the factor and score arrays."""
    stages = summary["stages"]
    found: dict[str, np.ndarray] = {}
    for stage in ("fit_model", "fit_preconditioner"):
        state = torch.load(io.BytesIO(storage.read_bytes(stages[stage]["url"], {})), weights_only=True)
        found.update({f"{stage}/{key}": value.numpy() for key, value in state.items()})
    found["compute_test_factors"] = np.asarray(storage.open_array(stages["compute_test_factors"]["url"], {})[...])
    group = storage.open_group(summary["influence"], {}, mode="r")
    for name in ("scores", "self_influence"):
        found[name] = np.asarray(group[name][...])
    return found


@pytest.mark.parametrize(
    "method",
    [
        {"name": "ekfac", "regularization": 1e-3},
        {"name": "cg", "regularization": 1e-3, "rtol": 1e-5, "preconditioner": "nystroem", "preconditioner_rank": 8},
    ],
    ids=["ekfac", "cg-nystroem"],
)
def test_one_or_two_threads_and_any_cluster_give_identical_bits(tmp_path, method):
    one = stage_outputs(run_in_process(tmp_path / "one", method, "sequential", omp_threads=1))
    two = stage_outputs(run_in_process(tmp_path / "two", method, "local", omp_threads=2))
    assert one.keys() == two.keys() and len(one) >= 6
    for name, values in one.items():
        assert values.tobytes() == two[name].tobytes(), f"{name} differs between the two processes"
    assert np.isfinite(one["scores"]).all() and np.abs(one["scores"]).max() > 0
