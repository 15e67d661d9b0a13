"""The index knows how good it is (issue 53): the compressed index's side follows the budget, and its own pass checks
it on probe rows against the exact scores."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from influence_core import examples
from influence_core.pipeline.runtime.cluster import dask_client
from influence_core.pipeline.stages import index
from influence_core.pipeline.store import storage
from influence_core.pipeline.store.loading import index_projection, load_influence_model, open_data
from tests.helpers import small_params
from tests.integration.test_engine import upstream

EKFAC = {"name": "ekfac", "regularization": 1e-2}


def _compute(**compute):
    return {"cluster": "sequential", "train_chunk_rows": 64, **compute}


def _index(tmp_path, name: str, **compute):
    """The training index of the small EK-FAC problem (MLP 64-32-10, 240 rows) under `compute`, with its inputs."""
    params = small_params(str(tmp_path / name), method=EKFAC, model={"hidden": [32]}, compute=_compute(**compute))
    store, data, model, curvature, _ = upstream(params)
    ref = index.run(index.IndexInput(params.method, params.aggregate, model, data, curvature, store, params.compute), lambda: dask_client(params.compute, False))
    return params, store, data, model, curvature, ref


def test_the_side_follows_the_budget(tmp_path):
    """index_side auto takes the largest side whose float16 rows fit the budget (the cuts 32 × 65 and 10 × 33 at side
    s hold min(s, 32)·s + 10·s numbers up to s = 32: side 20 holds 600, 288,000 bytes for 240 rows, side 21 would
    need 312,480); a number fixes the side. The ref records each layer's sides and the bytes."""
    *_, auto = _index(tmp_path, "auto", index_budget_gb=2.9e-4)
    assert auto.compression == "logra" and auto.side == 20 and auto.sides == {"1": [20, 20], "3": [10, 20]}
    assert auto.dim == 600 and auto.total_bytes == 240 * 600 * 2 and auto.exact_dim == 64 * 32 + 32 + 33 * 10
    *_, fixed = _index(tmp_path, "fixed", index_budget_gb=2.9e-4, index_side=12)
    assert fixed.side == 12 and fixed.sides == {"1": [12, 12], "3": [10, 12]} and fixed.dim == 144 + 120


def _recall(got: np.ndarray, want: np.ndarray, k: int = 10) -> float:
    """Mean share of each row's top k of `want` in its top k of `got` (ties to the lower index)."""
    top = lambda s: np.argsort(-s, axis=1, kind="stable")[:, :k]  # noqa: E731
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(top(got), top(want))]))


def test_the_probe_check_matches_the_two_score_matrices(tmp_path):
    """A forced small side (8) reports, from its own pass, the recall@10 and Pearson that its probe rows' scores give
    when computed independently: the library's exact scores of those rows against every training row, and their
    factors in the index's coordinates against the stored float16 rows, each probe row left out of its own ranking.
    Below 0.8 the probe warns, naming the fixes; its cost is counted."""
    params, store, data, model, curvature, ref = _index(tmp_path, "side8", index_budget_gb=1.5e-3, index_side=8)
    probe = ref.probe
    rows = np.array(probe["row_indices"])
    assert probe["rows"] == len(rows) == 16 and probe["k"] == 10 and 0 < probe["share"] < 1
    im = load_influence_model(params.method, model, data, curvature, store.options)
    arrays = open_data(data, store.options)
    x, y = examples.read(arrays["x_train"]), examples.read(arrays["y_train"])
    xp, yp = examples.read(arrays["x_train"], rows), examples.read(arrays["y_train"], rows)
    exact = im.influences(xp, yp, x, y).double().numpy()
    features = torch.from_numpy(np.asarray(storage.open_array(ref.array("features"), store.options)[:])).double()
    compressed = (index_projection(im, data, store.options, 8, ref.whitening_url).queries(im, xp, yp).double() @ features.T).numpy()
    others = np.ones_like(exact, dtype=bool)
    others[np.arange(len(rows)), rows] = False
    exact_others, compressed_others = exact[others].reshape(len(rows), -1), compressed[others].reshape(len(rows), -1)
    assert probe["recall_at_10"]["helpful"] == pytest.approx(_recall(compressed_others, exact_others), abs=1e-4)
    assert probe["recall_at_10"]["harmful"] == pytest.approx(_recall(-compressed_others, -exact_others), abs=1e-4)
    assert probe["pearson"] == pytest.approx(np.corrcoef(exact_others.ravel(), compressed_others.ravel())[0, 1], abs=1e-3)
    assert min(probe["recall_at_10"].values()) < 0.8 and "raise compute.index_budget_gb" in probe["warning"] and "re-ranking" in probe["warning"]
