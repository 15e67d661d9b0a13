"""Index once, query many: the training index gives today's scores without a training gradient, and a run with new
queries reuses every training-side stage (model, curvature, index, validation's retrainings)."""

from __future__ import annotations

import json

import numpy as np
import torch
import zarr
import pytest
from sklearn.datasets import load_digits

from flows.influence_run import influence_run
from influence_core.pipeline.stages import index, query_factors
from influence_core.pipeline.score import scoring
from influence_core.pipeline.store import storage
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.specs import StorageSpec
from influence_core.pipeline.runtime.cluster import dask_client
from influence_core.pipeline.runtime.threads import torch_threads
from influence_core.pipeline.score.score_input import ScoringInput
from influence_core.errors import ConfigError
from influence_core.pipeline.score.query import answer, query_arrays
from influence_core.pipeline.store.loading import index_projection, load_influence_model
from tests.helpers import assert_same_outputs, read_outputs, small_params
from tests.integration.test_engine import upstream

METHODS = {
    "direct": {"name": "direct", "regularization": 1e-3},
    "cg": {"name": "cg", "regularization": 1e-2, "rtol": 1e-8},
    "kfac": {"name": "kfac", "regularization": 1e-2},
    "ekfac": {"name": "ekfac", "regularization": 1e-2},
    "ekfac+logra": {"name": "ekfac", "regularization": 1e-2, "projection": {"kind": "logra", "dim": 16}},
    "trak": {"name": "direct", "regularization": 1e-2, "projection": {"kind": "gaussian", "dim": 32, "block_mb": 0.01}},
    "arnoldi": {"name": "arnoldi", "regularization": 1e-2, "rank": 20},
}


def _scores(params, with_index: bool):
    """The engine's scores and self-influences of `params`, from the training index or from training gradients."""
    store, data, model, curvature, factors = upstream(params)
    factory = lambda: dask_client(params.compute, False)  # noqa: E731
    train_index = index.run(index.IndexInput(params.method, params.aggregate, model, data, curvature, store, params.compute), factory) if with_index else None
    ref = scoring.run(ScoringInput(params.compute, params.method, params.aggregate, model, data, curvature, factors, store, index=train_index), factory)
    _, arrays = read_outputs(store)
    return ref, train_index, arrays


@pytest.mark.parametrize("method", sorted(METHODS))
def test_index_scores_equal_the_gradient_path(tmp_path, method):
    """Scores and self-influences from the index equal those contracted from training gradients (rtol 1e-5), and
    scoring over the index evaluates no training gradient; the index pass evaluates each training row's once."""
    overrides = {"method": METHODS[method], "aggregate": {"top_k": 4, "report_queries": 3, "self_influence": "exact" if method != "cg" else "lowrank"}}
    ref, _, expected = _scores(small_params(str(tmp_path / "gradients"), **overrides), with_index=False)
    got, train_index, actual = _scores(small_params(str(tmp_path / "index"), **overrides), with_index=True)
    assert ref.gradient_rows == 240 and got.gradient_rows == 0
    assert train_index is not None and train_index.compression == "none" and train_index.gradient_rows == 240
    assert got.work["index_rows"] == 240
    for name in ("scores", "self_influence"):
        scale = np.abs(expected[name]).max()
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def test_an_index_over_budget_is_skipped_with_the_reason(tmp_path):
    """An index larger than compute.index_budget_gb is not written: the stage says so, and scoring takes the gradient
    path (its scores are the ones without an index)."""
    params = small_params(str(tmp_path / "run"), compute={"cluster": "sequential", "train_chunk_rows": 64, "index_budget_gb": 1e-6})
    ref, train_index, _ = _scores(params, with_index=True)
    assert train_index is not None and not train_index.usable and "exceeds compute.index_budget_gb=1e-06" in (train_index.skipped or "")
    assert ref.gradient_rows == 240


def _digits_npz(path, queries: slice) -> str:
    """Digits as an npz: the same 300 training rows in every file, the queries taken from `queries` of the rest."""
    x, y = load_digits(return_X_y=True)
    np.savez(path, x_train=x[:300].astype(np.float32), y_train=y[:300], x_test=x[300:][queries].astype(np.float32), y_test=y[300:][queries])
    return str(path)


def _run(tmp_path, name: str, queries: slice, cache: str, cluster: str = "sequential"):
    params = small_params(
        str(tmp_path / name), dataset={"source": "npz", "path": _digits_npz(tmp_path / f"{name}.npz", queries), "chunk_rows": 64},
        method={"name": "ekfac", "regularization": 1e-2}, validation={"subsets": 4, "queries": 5},
        compute={"cluster": cluster, "n_workers": 2, "train_chunk_rows": 64}, storage={"cache_url": cache},
    )
    influence_run(**params.sections())
    return json.loads((tmp_path / name / "summary.json").read_text()), read_outputs(params.store())[1]


def _stage_store(tmp_path, run: str, cache: str) -> RunStore:
    """Run `run`'s store: summary.json records the URLs in its stage store `cache` as "{cache}/..."."""
    return RunStore(output_url=str(tmp_path / run), storage=StorageSpec(cache_url=str(tmp_path / cache)))


def test_new_queries_reuse_the_training_side(tmp_path, prefect_api, monkeypatch):
    """Run B asks 15 new queries of run A's training rows (a shared stage cache): fit_model, fit_preconditioner,
    index_training and validation's retrainings are reused, B evaluates gradients of its 15 queries only, and its
    outputs are bit-identical to a fresh run of B's parameters on the local cluster's workers (every stage there: the
    factor passes, the index pass and the index products), where A ran them in this process on 2 threads (a local
    cluster's small work) and B its products on one (sequential): no stage key names the cluster."""
    from influence_core.pipeline.runtime import cluster
    from influence_core.pipeline.score import scoring

    cache = str(tmp_path / "cache")
    first, _ = _run(tmp_path, "a", slice(0, 10), cache, cluster="local")
    again, reused = _run(tmp_path, "b", slice(10, 25), cache)
    monkeypatch.setattr(scoring, "IN_PROCESS_INDEX_BYTES", 0)  # every index on the cluster
    monkeypatch.setattr(cluster, "IN_PROCESS_FLOPS", 0.0)  # and every pass
    monkeypatch.setattr(cluster, "CLUSTER_START_SECONDS", 0.0)
    fresh, expected = _run(tmp_path, "fresh", slice(10, 25), str(tmp_path / "fresh-cache"), cluster="local")
    stages = again["stages"]
    assert stages["compute_influences"]["ran"].startswith("in the flow's process on 1 thread") and fresh["stages"]["compute_influences"]["ran"] == "local"
    for name in ("fit_preconditioner", "index_training", "compute_influences"):
        assert first["stages"][name]["ran"].startswith("in the flow's process on 2 threads") and fresh["stages"][name]["ran"] == "local", name
    for name in ("fit_model", "fit_preconditioner", "index_training"):
        assert first["stages"][name]["outcome"] == "computed"
        assert stages[name]["outcome"] in ("cached", "found complete"), name
        assert stages[name]["fingerprint"] == first["stages"][name]["fingerprint"], name
    assert stages["compute_test_factors"]["outcome"] == "computed" and stages["compute_test_factors"]["work"]["gradient_rows"] == 15
    assert stages["compute_influences"]["gradient_rows"] == 0 and stages["compute_influences"]["work"]["index_rows"] == 300
    assert first["stages"]["validate"]["work"]["trainings"] == 4 and stages["validate"]["work"]["trainings"] == 0
    assert sum(stage.get("work", {}).get("gradient_rows", 0) for stage in stages.values() if stage["outcome"] == "computed") == 15
    assert fresh["stages"]["index_training"]["outcome"] == "computed"
    for name, values in expected.items():
        np.testing.assert_array_equal(reused[name], values, err_msg=name)
    assert again["validation"]["lds_per_query"] == fresh["validation"]["lds_per_query"]
    for name in ("fit_model", "fit_preconditioner"):  # the stored model and curvature, byte for byte
        urls = [_stage_store(tmp_path, run, cache).resolve(summary["stages"][name]["url"]) for run, cache, summary in (("b", "cache", again), ("fresh", "fresh-cache", fresh))]
        assert storage.read_bytes(urls[0], {}) == storage.read_bytes(urls[1], {}), name
    # the reused model's summary tells its losses on B's queries, as the fresh run that trained it does, not on A's
    assert stages["fit_model"]["metrics"] == fresh["stages"]["fit_model"]["metrics"]
    assert stages["fit_model"]["metrics"]["query_loss"] != first["stages"]["fit_model"]["metrics"]["query_loss"]
    assert stages["fit_model"]["metrics"]["train_loss"] == first["stages"]["fit_model"]["metrics"]["train_loss"]


def _npz_params(tmp_path, name: str, queries: slice, **compute):
    return small_params(
        str(tmp_path / name), dataset={"source": "npz", "path": _digits_npz(tmp_path / f"{name}.npz", queries), "chunk_rows": 64},
        compute={"cluster": "sequential", "train_chunk_rows": 64, **compute}, storage={"cache_url": str(tmp_path / "cache")},
    )


def test_query_answers_new_queries_from_the_index_alone(tmp_path, prefect_api):
    """`influence-pipeline query` against run A's index gives the top-k a full run with those queries stores (same
    indices, scores to rtol 1e-5), evaluating the queries' gradients alone; its answer is written as Zarr."""
    from typer.testing import CliRunner

    from flows.cli import app

    run_a = _npz_params(tmp_path, "a", slice(0, 10))
    influence_run(**run_a.sections())
    full = _npz_params(tmp_path, "full", slice(10, 25))
    influence_run(**full.sections())
    _, expected = read_outputs(full.store())
    x, y = load_digits(return_X_y=True)
    np.savez(tmp_path / "new.npz", x_test=x[300:][10:25].astype(np.float32), y_test=y[300:][10:25])
    found = answer(run_a.store(), *query_arrays(str(tmp_path / "new.npz"), {}), top_k=4)
    assert found.work.gradient_rows == 15 and found.work.index_rows == 300
    for name in ("topk_helpful_indices", "topk_harmful_indices"):
        np.testing.assert_array_equal(found.arrays[name], expected[name], err_msg=name)
    for name in ("topk_helpful_scores", "topk_harmful_scores"):
        np.testing.assert_allclose(found.arrays[name], expected[name], rtol=1e-5, atol=1e-6 * np.abs(expected[name]).max(), err_msg=name)
    done = CliRunner().invoke(app, ["query", run_a.output_url, "--queries", str(tmp_path / "new.npz"), "--top", "4", "--output-url", str(tmp_path / "answer")])
    assert done.exit_code == 0, done.output
    assert "15 gradient rows (the queries')" in done.output
    written = zarr.open_group(str(tmp_path / "answer" / "influence.zarr"), mode="r")
    np.testing.assert_array_equal(written["argmax"][:], expected["argmax"])


def test_query_refuses_a_run_without_an_index(tmp_path, prefect_api):
    from typer.testing import CliRunner

    from flows.cli import app

    params = _npz_params(tmp_path, "a", slice(0, 10), index_budget_gb=0)
    influence_run(**params.sections())
    done = CliRunner().invoke(app, ["query", params.output_url, "--queries", str(tmp_path / "a.npz")])
    assert done.exit_code == 1
    assert done.output.strip().splitlines() == [f"run: the run at {params.output_url} has no training index. Fix: rerun it with compute.index_budget_gb large enough (its summary.json says how large), then ask again"]


def test_query_refuses_queries_the_run_s_model_does_not_take_in_one_line(tmp_path, prefect_api):
    """Queries of the wrong width, a label beyond the model's 10 classes, a NaN: one line naming --queries, exit 1,
    before any solve (a traceback from deep in the forward pass or the loss before)."""
    from typer.testing import CliRunner

    from flows.cli import app

    params = _npz_params(tmp_path, "a", slice(0, 10))
    influence_run(**params.sections())
    x, y = load_digits(return_X_y=True)
    good_x, good_y = x[300:305].astype(np.float32), y[300:305]
    nan_x = good_x.copy()
    nan_x[2, 5] = np.nan
    cases = {
        "narrow": (good_x[:, :63], good_y, "x of shape (5, 63) and 5 labels; the run's model takes one row of shape (64,) and one label per query"),
        "label": (good_x, np.array([1, 2, 12, 3, 4]), "the queries do not fit the run's model"),
        "nan": (nan_x, good_y, "x_test holds NaN or inf (first at row 2)"),
    }
    for name, (qx, qy, expected) in cases.items():
        np.savez(tmp_path / f"{name}.npz", x=qx, y=qy)
        done = CliRunner().invoke(app, ["query", params.output_url, "--queries", str(tmp_path / f"{name}.npz")])
        lines = done.output.strip().splitlines()
        assert done.exit_code == 1 and len(lines) == 1, (name, done.output)
        assert lines[0].startswith("--queries: ") and expected in lines[0], (name, lines[0])


@pytest.mark.parametrize(("method", "pearson_floor", "recall_floor"), [("ekfac", 0.95, 0.8), ("identity", 0.98, 0.9)])
def test_an_index_over_budget_is_compressed_and_tracks_the_exact_scores(tmp_path, method, pearson_floor, recall_floor):
    """Over compute.index_budget_gb the index is LoGra-compressed (side 32, float16: 2,688 bytes a row against 9,640
    exact; EK-FAC's whitened in its eigenbasis) and scores without a training gradient; its scores track the exact
    ones (measured: EK-FAC Pearson 0.974, recall@10 0.86; identity 0.994, 0.98) and self-influences stay exact."""
    compute = {"cluster": "sequential", "train_chunk_rows": 64, "index_budget_gb": 1.5e-3, "index_side": 32}
    overrides = {"method": METHODS.get(method, {"name": method}), "model": {"hidden": [32]}, "aggregate": {"top_k": 10, "report_queries": 3}}
    _, _, exact = _scores(small_params(str(tmp_path / "exact"), **overrides), with_index=False)
    got, train_index, compressed = _scores(small_params(str(tmp_path / "compressed"), compute=compute, **overrides), with_index=True)
    assert train_index is not None and train_index.compression == "logra" and train_index.dtype == "float16"
    assert train_index.bytes_per_row == 2 * (32 * 32 + 10 * 32) and train_index.side == 32
    assert got.gradient_rows == 0 and got.work["index_rows"] == 240
    pearson = np.corrcoef(compressed["scores"].ravel(), exact["scores"].ravel())[0, 1]
    top = lambda s: np.argsort(-s, axis=1)[:, :10]  # noqa: E731
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(top(compressed["scores"]), top(exact["scores"]))])
    assert pearson >= pearson_floor and recall >= recall_floor, (pearson, recall)
    np.testing.assert_allclose(compressed["self_influence"], exact["self_influence"], rtol=1e-5, atol=1e-5 * np.abs(exact["self_influence"]).max())


def test_whitened_query_factors_are_taken_in_the_compressed_index_s_coordinates(tmp_path):
    """Given a compressed index, EK-FAC's compute_test_factors projects the queries from their captures (n_test × dim,
    not n_test × p; coordinates "index"), and scoring over them gives the scores of the model-wide factors projected
    at scoring: the same up to the whitening's 1e-3 truncation (atol 1e-4 of the largest score). The index keeps
    its whitening factors in its group (the truncated SVDs factored again give the same), so queries need no SVD."""
    compute = {"cluster": "sequential", "train_chunk_rows": 64, "index_budget_gb": 1.5e-3, "index_side": 32}
    params = small_params(str(tmp_path / "run"), compute=compute, method=METHODS["ekfac"], model={"hidden": [32]}, aggregate={"top_k": 10, "report_queries": 3})
    store, data, model, curvature, flat = upstream(params)
    factory = lambda: dask_client(params.compute, False)  # noqa: E731
    train_index = index.run(index.IndexInput(params.method, params.aggregate, model, data, curvature, store, params.compute), factory)
    taken = query_factors.run(query_factors.QueryFactorsInput(params.method, model, data, curvature, store, params.compute.torch_threads, params.compute, train_index))
    assert flat.coordinates == "parameters" and taken.coordinates == "index" and taken.fingerprint != flat.fingerprint
    im = load_influence_model(params.method, model, data, curvature, store.options)
    with torch_threads(params.compute.torch_threads):  # the index stage's threads: the same bits on any machine
        kept, fresh = (index_projection(im, data, store.options, 32, url).all_whitening() for url in (train_index.whitening_url, None))
    assert storage.exists(train_index.whitening_url, store.options) and kept.keys() == fresh.keys() == {"1", "3"}
    for name in kept:
        assert all(torch.equal(a, b) for a, b in zip(kept[name], fresh[name])), name
    assert flat.shape == (data.n_test, 64 * 32 + 32 + 33 * 10) and taken.shape == (data.n_test, 32 * 32 + 10 * 32)
    scores = {}
    for name, factors in (("flat", flat), ("taken", taken)):  # each into its own output
        out = small_params(str(tmp_path / name)).store()
        scoring.run(ScoringInput(params.compute, params.method, params.aggregate, model, data, curvature, factors, out, index=train_index), factory)
        scores[name] = read_outputs(out)[1]["scores"]
    scale = np.abs(scores["flat"]).max()
    np.testing.assert_allclose(scores["taken"], scores["flat"], rtol=0, atol=1e-4 * scale)  # measured: 4.6e-6
    assert not np.array_equal(scores["taken"], scores["flat"])


def test_a_damaged_whitening_is_found_and_the_index_written_again(tmp_path, prefect_api):
    """The whitening factors live in the index's group, in its inventory: cut short, the rerun finds the index
    incomplete, factors them again and rewrites every row (none projected with other factors is kept); nothing else
    runs, and the outputs are those of the first run, bit for bit."""
    compute = {"cluster": "sequential", "train_chunk_rows": 64, "index_budget_gb": 1.5e-3, "index_side": 32}
    params = small_params(str(tmp_path / "run"), compute=compute, method=METHODS["ekfac"], model={"hidden": [32]})
    first = influence_run(**params.sections())
    assert first["stages"]["index_training"]["compression"] == "logra"
    _, expected = read_outputs(params.store())
    [whitening] = (tmp_path / "run").glob("stages/index_training/*/index.zarr/whitening.pt")
    whitening.write_bytes(whitening.read_bytes()[:100])
    again = influence_run(**params.sections())
    outcomes = {name: stage["outcome"] for name, stage in again["stages"].items()}
    assert outcomes.pop("index_training") == "computed" and set(outcomes.values()) <= {"cached", "found complete"}
    assert again["stages"]["index_training"]["chunks_computed"] == again["stages"]["index_training"]["n_chunks"] == 4
    assert_same_outputs(params.store(), expected)
    whitening.write_bytes(b"#" * whitening.stat().st_size)  # overwritten at its size: its sha256 tells
    x, y = load_digits(return_X_y=True)
    with pytest.raises(ConfigError, match=r"^index_training: the run at .* cannot be used: its index_training output index.zarr/whitening.pt holds other bytes than recorded .* Fix: run `influence-pipeline repair .*/run`"):
        answer(params.store(), torch.from_numpy(x[-3:].astype(np.float32)), y[-3:], top_k=3)  # new queries: refused in one line, never scored with other factors


def test_direct_over_budget_is_not_compressed(tmp_path):
    """Direct's factors are not projected (a projection of (H + λI)⁻¹∇ℓ loses the scores): over budget its index is
    skipped with that reason, and scoring takes the gradient path."""
    params = small_params(str(tmp_path / "run"), model={"hidden": [32]}, compute={"cluster": "sequential", "train_chunk_rows": 64, "index_budget_gb": 1.5e-3, "index_side": 32})
    ref, train_index, _ = _scores(params, with_index=True)
    assert train_index is not None and not train_index.usable and "K-FAC/EK-FAC compress whitened" in (train_index.skipped or "")
    assert ref.gradient_rows == 240
