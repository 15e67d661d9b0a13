"""The index knows how good it is (issue 53): the compressed index's side follows the budget, its own pass checks it
on probe rows against the exact scores, and re-ranking gives each query's exact top-k from its candidates, in a run
and in a question alike."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from typer.testing import CliRunner

from flows.cli import app
from flows.influence_run import influence_run
from influence_core import examples
from influence_core.pipeline.runtime.cluster import dask_client
from influence_core.pipeline.score.query import answer, query_arrays
from influence_core.pipeline.stages import index
from influence_core.pipeline.store import storage
from influence_core.pipeline.store.loading import index_projection, load_influence_model, open_data
from tests.helpers import read_outputs, small_params
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


def _digits_npz(path, queries: slice) -> str:
    """The same 300 training rows of digits in every file, the queries from `queries` of the rest."""
    x, y = load_digits(return_X_y=True)
    np.savez(path, x_train=x[:300].astype(np.float32), y_train=y[:300], x_test=x[300:][queries].astype(np.float32), y_test=y[300:][queries])
    return str(path)


def _run(tmp_path, name: str, queries: slice, **compute):
    """A whole run of EK-FAC on the digits npz (300 rows, MLP 64-32-10, top 5), in a stage cache shared by the runs."""
    params = small_params(
        str(tmp_path / name), dataset={"source": "npz", "path": _digits_npz(tmp_path / f"{name}.npz", queries), "chunk_rows": 64}, method=EKFAC,
        model={"hidden": [32]}, compute=_compute(**compute), aggregate={"top_k": 5, "report_queries": 3}, storage={"cache_url": str(tmp_path / "cache")},
    )
    summary = influence_run(**params.sections())
    return params, summary, read_outputs(params.store())[1]


COMPRESSED = {"index_budget_gb": 1.5e-3, "index_side": 16}


def test_reranked_top_k_are_the_exact_ones(tmp_path, prefect_api):
    """Over an index compressed to side 16, re-ranking scores each query's 40 candidates a side exactly: equal to the
    scores of a run without an index there (rtol 1e-5); wherever the candidates hold a query's exact top 5, its
    re-ranked top 5 are those (indices, and scores to round-off). summary.json says what is exact."""
    _, summary, got = _run(tmp_path, "compressed", slice(0, 12), **COMPRESSED)
    _, _, exact = _run(tmp_path, "exact", slice(0, 12), index_budget_gb=0)
    stage = summary["stages"]["rerank"]
    assert stage["candidates"]["per_side"] == 40 and got["reranked_indices"].shape == (12, 80) and stage["gradient_rows"] == len(np.unique(got["reranked_indices"]))
    assert summary["exactness"]["from_compressed_index"] == ["scores", "train_totals"] and "topk_helpful_scores" in summary["exactness"]["exact"]
    scale = np.abs(exact["scores"]).max()
    at = np.take_along_axis(exact["scores"], got["reranked_indices"], 1)
    np.testing.assert_allclose(got["reranked_scores"], at, rtol=1e-5, atol=1e-6 * scale)
    held = 0
    for kind in ("helpful", "harmful"):
        for q in range(12):
            if set(exact[f"topk_{kind}_indices"][q]) <= set(got["reranked_indices"][q]):
                held += 1
                np.testing.assert_array_equal(got[f"topk_{kind}_indices"][q], exact[f"topk_{kind}_indices"][q])
                np.testing.assert_allclose(got[f"topk_{kind}_scores"][q], exact[f"topk_{kind}_scores"][q], rtol=1e-5, atol=1e-6 * scale)
    compressed_top = np.argsort(-got["scores"], axis=1, kind="stable")[:, :5]
    assert held >= 20 and not np.array_equal(compressed_top, exact["topk_helpful_indices"])  # side 16 alone gets some wrong


def test_query_and_run_give_the_same_reranked_top_k(tmp_path, prefect_api):
    """`query` against run A's compressed index re-ranks as a run does: its top-k for new queries are those of a run
    with those queries (same indices, scores to rtol 1e-5), and the candidates' gradient rows are counted; --rerank 0
    gives the compressed scores' top-k, and fewer candidates than --top is refused in one line."""
    run_a, _, _ = _run(tmp_path, "a", slice(0, 10), **COMPRESSED)
    _, summary, expected = _run(tmp_path, "full", slice(10, 25), **COMPRESSED)
    assert summary["stages"]["index_training"]["outcome"] in ("cached", "found complete")
    x, y = load_digits(return_X_y=True)
    np.savez(tmp_path / "new.npz", x_test=x[300:][10:25].astype(np.float32), y_test=y[300:][10:25])
    found = answer(run_a.store(), *query_arrays(str(tmp_path / "new.npz"), {}), top_k=5)
    rerank = found.search["rerank"]
    assert rerank["per_side"] == 40 and found.work.gradient_rows == 2 * 15 + rerank["rows"]  # the queries' twice (index coordinates, exact), then the candidates'
    for kind in ("helpful", "harmful"):
        np.testing.assert_array_equal(found.arrays[f"topk_{kind}_indices"], expected[f"topk_{kind}_indices"], err_msg=kind)
        np.testing.assert_allclose(found.arrays[f"topk_{kind}_scores"], expected[f"topk_{kind}_scores"], rtol=1e-5, atol=1e-6 * np.abs(expected["scores"]).max(), err_msg=kind)
    plain = answer(run_a.store(), *query_arrays(str(tmp_path / "new.npz"), {}), top_k=5, rerank=0)
    np.testing.assert_array_equal(plain.arrays["topk_helpful_indices"], np.argsort(-expected["scores"], axis=1, kind="stable")[:, :5])
    assert "rerank" not in plain.search and plain.work.gradient_rows == 15
    done = CliRunner().invoke(app, ["query", run_a.output_url, "--queries", str(tmp_path / "new.npz"), "--top", "5", "--rerank", "3"])
    assert done.exit_code == 1 and done.output.strip().splitlines() == ["--rerank: 3 candidates a side cannot hold --top 5. Fix: give --rerank 5 or more, or 0 to take the top-k from the compressed scores"]
    done = CliRunner().invoke(app, ["query", run_a.output_url, "--queries", str(tmp_path / "new.npz"), "--top", "5", "--output-url", str(tmp_path / "answer")])
    assert done.exit_code == 0, done.output
    assert "each query's 40 most helpful and most harmful re-ranked exactly" in done.output
    written = json.loads((tmp_path / "answer" / "influence.zarr" / "zarr.json").read_text())["attributes"]
    assert written["search"]["rerank"]["per_side"] == 40
