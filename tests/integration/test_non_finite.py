"""NaN or infinity in a stage's output fails that stage in one line where it is computed (issue 52): full scores, scores
from the training index, FastIF's candidate scores, the index's own rows and a diverged training. The stage writes no
manifest and Prefect caches nothing, so the same parameters are refused again, never served the broken output.
(Method magic's overflow: test_magic_pipeline.py.) Every run here goes through the flow on a real Prefect API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flows.influence_run import influence_run
from influence_core.errors import ConfigError
from tests.helpers import latest_task_runs, small_params

pytestmark = pytest.mark.usefixtures("prefect_api")

def npz(tmp_path: Path, x_train: np.ndarray, x_test: np.ndarray) -> dict[str, Any]:
    """An .npz dataset of those features (labels 0..9 in turn) as the dataset section."""
    np.savez(tmp_path / "data.npz", x_train=x_train, y_train=np.arange(len(x_train)) % 10, x_test=x_test, y_test=np.arange(len(x_test)) % 10)
    return {"source": "npz", "path": str(tmp_path / "data.npz"), "n_train": len(x_train), "chunk_rows": 32}


def zero_query(tmp_path: Path) -> dict[str, Any]:
    """Features in [0, 1), but query 3 all zero: tests.plugin_models:root_of_layer's gradient is infinite there."""
    rng = np.random.default_rng(0)
    x_test = rng.random((12, 64), dtype=np.float32)
    x_test[3] = 0
    return npz(tmp_path, rng.random((120, 64), dtype=np.float32), x_test)


def refused_twice(params: Any, stage: str) -> ConfigError:
    """The run is refused in one line naming `stage`, twice (the second time not served from any cache), with no
    manifest of `stage` and its task run FAILED each time; returns the refusal."""
    root = Path(params.output_url)
    for _ in range(2):
        with pytest.raises(ConfigError) as refused:
            influence_run(**params.sections())
        assert refused.value.field == stage and "NaN or infinite" in refused.value.problem and "\n" not in str(refused.value)
        assert latest_task_runs(params.output_url, stage)[stage] == "FAILED"
        assert not list((root / "stages" / stage).glob("*/manifest.json"))
    return refused.value


@pytest.mark.parametrize("variant, words", [
    ({"compute": {"cluster": "sequential", "index_budget_gb": 0}}, "scores of train chunk 0 are"),
    ({"compute": {"cluster": "sequential"}}, "scores of train chunk 0 (from the training index) are"),
    ({"compute": {"cluster": "sequential", "index_budget_gb": 0}, "candidates": {"knn_k": 8}}, "candidate scores of train chunk"),
], ids=["full scores", "scores from the index", "candidate scores"])
def test_scores_with_nan_fail_compute_influences(tmp_path, variant, words):
    """A query where the model's gradient is infinite: before issue 52 its NaN scores were stored, compute_influences
    was recorded complete and aggregate failed on every rerun."""
    params = small_params(str(tmp_path / "run"), dataset=zero_query(tmp_path), model={"factory": "tests.plugin_models:root_of_layer"}, **variant)
    error = refused_twice(params, "compute_influences")
    assert words in error.problem and "√ or log at 0" in error.problem and "standardise the features" in error.fix
    if "candidates" not in variant:
        assert "all those of queries [3]" in error.problem  # the query whose every score is NaN


def test_index_rows_beyond_float16_fail_index_training(tmp_path):
    """A linear regression on features of scale 1e3: its gradients reach 1e6, beyond float16's 65,504, which before
    issue 52 the index stored as inf."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x_train=(rng.random((120, 64)) * 1e3).astype(np.float32), y_train=rng.standard_normal(120).astype(np.float32),
             x_test=(rng.random((12, 64)) * 1e3).astype(np.float32), y_test=rng.standard_normal(12).astype(np.float32))
    dataset = {"source": "npz", "path": str(tmp_path / "data.npz"), "n_train": 120, "chunk_rows": 32}
    settings = {"dataset": dataset, "model": {"architecture": "linear", "loss": "mse"}}
    params = small_params(str(tmp_path / "run"), compute={"cluster": "sequential", "index_dtype": "float16"}, **settings)
    error = refused_twice(params, "index_training")
    assert "index features of train chunk 0 as float16" in error.problem and "exceed float16's range" in error.problem
    assert error.fix == "set compute.index_dtype: float32, then run again"
    influence_run(**small_params(str(tmp_path / "run"), compute={"cluster": "sequential", "index_dtype": "float32"}, **settings).sections())  # float32 holds them


def test_a_training_that_diverges_fails_fit_model(tmp_path):
    """A learning rate of 1e30 makes the weights NaN: before issue 52 fit_model stored them, and the curvature's
    Cholesky refused λ for NaN eigenvalues."""
    params = small_params(str(tmp_path / "run"), training={"epochs": 2, "learning_rate": 1e30})
    error = refused_twice(params, "fit_model")
    assert "trained weights of" in error.problem and "the training diverged" in error.problem and "lower training.learning_rate" in error.fix
    assert latest_task_runs(params.output_url, "fit_model") == {"prepare_data": "COMPLETED", "fit_model": "FAILED"}
