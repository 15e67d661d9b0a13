"""Every method runs through the staged pipeline (state stored, reloaded, scored in chunks) and gives the scores
the library computes in one go on the same stored model and data."""

from __future__ import annotations

import numpy as np
import pytest

from flows.influence_run import influence_run
from tests.helpers import read_outputs, small_params, stored_model_and_data

pytestmark = pytest.mark.usefixtures("prefect_api")

METHODS = {
    "cg": {"name": "cg", "regularization": 1e-2, "rtol": 1e-8, "preconditioner": "nystroem", "preconditioner_rank": 8},
    "lissa": {"name": "lissa", "regularization": 1e-1, "depth": 300, "lissa_batch_size": 240, "scale": 5.0, "rtol": 1e-8},
    "arnoldi": {"name": "arnoldi", "regularization": 1e-2, "rank": 12, "krylov_dim": 40},
    "arnoldi with complement": {"name": "arnoldi", "regularization": 1e-2, "rank": 12, "krylov_dim": 40, "complement": True},
    "nystroem": {"name": "nystroem", "regularization": 1e-2, "rank": 12, "block_structure": "layer_wise"},
    "datainf": {"name": "datainf", "regularization": {"1": 0.1, "3": 0.05}},
    "identity": {"name": "identity"},
    "kfac": {"name": "kfac", "regularization": 1e-2, "fisher": "exact"},
    "ekfac+logra": {"name": "ekfac", "regularization": 1e-2, "projection": {"kind": "logra", "dim": 16}},
    "trak": {"name": "direct", "regularization": 1e-2, "projection": {"kind": "gaussian", "dim": 32, "block_mb": 0.01}},
    "cg on the last layer": {"name": "cg", "regularization": 1e-2, "rtol": 1e-8, "modules": ["3"]},
}


AUTO_SKETCHED = {"cg", "lissa", "datainf"}  # exact self-influence would be a solve per example: `auto` sketches


@pytest.mark.parametrize("method", list(METHODS))
def test_method_through_pipeline_equals_library(tmp_path, method, dask_address):
    """Scores, and self-influence in the pipeline's default mode (`auto`): exact for most methods, the sketch of rank
    self_influence_rank (32) for CG, LiSSA and DataInf, computed with the training index, each equal to the library's own."""
    compute = {"cluster": "address", "address": dask_address, "train_chunk_rows": 64} if method.startswith("ekfac") else {"cluster": "sequential", "train_chunk_rows": 64}
    params = small_params(str(tmp_path / method.replace(" ", "_")), method=METHODS[method], compute=compute)
    summary = influence_run(**params.sections())
    store = params.store()
    group, arrays = read_outputs(store)
    assert group.attrs["status"] == "complete"
    model, data = stored_model_and_data(store, group)
    im = params.method.build(model, "cross_entropy").fit((data["x_train"], data["y_train"]))
    expected = im.influences(data["x_test"], data["y_test"], data["x_train"], data["y_train"]).numpy()
    np.testing.assert_allclose(arrays["scores"], expected, rtol=1e-3, atol=1e-4 * np.abs(expected).max())
    rank = params.aggregate.self_influence_rank  # written with the training index, before any query: auto's sketch is not bounded by the queries
    mode, planned = ("lowrank", {"form": "sketch", "rank": rank}) if params.method.name in AUTO_SKETCHED else ("exact", {})
    assert summary["stages"]["compute_influences"]["self_influence"].items() >= {"mode": "auto", **planned}.items()
    np.testing.assert_allclose(arrays["self_influence"], im.self_influences(data["x_train"], data["y_train"], mode=mode, rank=rank).numpy(), rtol=1e-3, atol=1e-5)
