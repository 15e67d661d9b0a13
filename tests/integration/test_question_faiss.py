"""A question answered through a FAISS inner-product index over the run's training index (`query --search faiss`):
a flat index gives the exact scan's top-k, an approximate one most of it with the scan's scores, and the FAISS index
is built by the first question and loaded by the next, beside the training index, locally and on S3."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.influence_run import influence_run
from flows.question import influence_question
from influence_core.pipeline.score.query import answer, query_arrays, run_index
from influence_core.pipeline.specs import SearchSpec
from influence_core.pipeline.store.loading import open_data
from tests.helpers import read_outputs, small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
N_TRAIN, N_QUERIES, K = 20_000, 20, 10


@pytest.fixture(scope="module")
def run(tmp_path_factory, dask_address):
    """A run over 20,000 seeded synthetic rows (a linear model on 16 features, 10 classes, Direct on its 170
    parameters) on the shared Dask cluster, its 20 queries saved as a question's .npz, and their exact scores."""
    root = tmp_path_factory.mktemp("faiss")
    params = small_params(
        str(root / "run"), dataset={"source": "synthetic_classification", "n_features": 16, "n_classes": 10, "n_train": N_TRAIN, "n_test": N_QUERIES, "chunk_rows": 4096},
        model={"architecture": "linear"}, training={"epochs": 1, "batch_size": 1024}, method={"name": "direct", "regularization": 1e-3},
        compute={"cluster": "address", "address": dask_address}, aggregate={"top_k": K, "report_queries": 3, "self_influence": "off"},
    )
    influence_run(**params.sections())
    store = params.store()
    data = run_index(store)[4]
    arrays = open_data(data, store.options)
    np.savez(root / "queries.npz", x=np.asarray(arrays["x_test"][:]), y=np.asarray(arrays["y_test"][:]))
    return store, str(root / "queries.npz"), read_outputs(store)[1]["scores"]


def _ask(run, search: SearchSpec | None = None):
    store, queries, _ = run
    return answer(store, *query_arrays(queries, {}), top_k=K, search=search)


def _recall(exact: np.ndarray, found: np.ndarray) -> float:
    """Mean over queries of the share of the exact top-k that `found` holds."""
    return float(np.mean([len(set(e) & set(f)) / len(e) for e, f in zip(exact, found)]))


def test_a_flat_faiss_index_answers_as_the_scan(run):
    """Through the exact (flat) inner-product index the answer is the scan's: the same indices, the same scores
    (rtol 1e-5), helpful by the largest score and harmful by the smallest."""
    scan, faiss = _ask(run), _ask(run, SearchSpec(kind="faiss", index="flat"))
    assert scan.search == {"kind": "scan"}
    assert faiss.search["kind"] == "faiss" and faiss.search["index"] == "flat" and faiss.search["metric"] == "ip"
    for side in ("helpful", "harmful"):
        np.testing.assert_array_equal(faiss.arrays[f"topk_{side}_indices"], scan.arrays[f"topk_{side}_indices"], err_msg=side)
        expected = scan.arrays[f"topk_{side}_scores"]
        np.testing.assert_allclose(faiss.arrays[f"topk_{side}_scores"], expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max(), err_msg=side)


@pytest.mark.parametrize(
    ("kind", "nprobe", "floors"),
    [("ivf", None, (0.95, 0.55)), ("ivf", 128, (0.95, 0.7)), ("hnsw", None, (0.9, 0.7))],
    ids=["ivf-default-32-of-512-lists", "ivf-128-of-512-lists", "hnsw"],
)
def test_an_approximate_index_finds_most_of_the_exact_top_10_with_their_exact_scores(run, kind, nprobe, floors):
    """On this seeded problem recall@10 against the exact scan (helpful, harmful) meets the floors; measured: IVF
    probing 32 of its 512 lists (the default, 1/16) 0.985 and 0.615, probing 128 1.0 and 0.75, HNSW 0.945 and 0.77
    (the smallest scores are the harder side here). Every row returned carries its exact score (the run's stored
    scores, rtol 1e-5), in the scan's order."""
    *_, scores = run
    scan, found = _ask(run), _ask(run, SearchSpec(kind="faiss", index=kind, nprobe=nprobe))
    assert found.search["index"] == kind and found.search.get("nprobe") == ((nprobe or 32) if kind == "ivf" else None)
    for side, order, floor in (("helpful", 1, floors[0]), ("harmful", -1, floors[1])):
        indices, values = found.arrays[f"topk_{side}_indices"], found.arrays[f"topk_{side}_scores"]
        recall = _recall(scan.arrays[f"topk_{side}_indices"], indices)
        assert recall >= floor, (side, recall)
        exact = np.take_along_axis(scores, indices, 1)
        np.testing.assert_allclose(values, exact, rtol=1e-5, atol=1e-6 * np.abs(scores).max(), err_msg=side)
        assert (np.diff(values, axis=1) * order <= 0).all(), side


def test_the_faiss_index_is_built_by_the_first_question_and_loaded_by_the_next(run, tmp_path):
    """Through the question flow: the first question builds the IVF index beside the training index (reading the
    index once), the next loads that file untouched (same mtime, no index row read) and answers alike; another
    kind is another file, and a truncated file is built again rather than read."""
    import zarr

    store, queries, _ = run
    beside = Path(run_index(store)[3].url).parent
    shutil.rmtree(beside / "faiss", ignore_errors=True)  # the other tests' questions kept theirs
    ask = lambda name, search: influence_question(run_url=store.output_url, queries=queries, top_k=K, output_url=str(tmp_path / name), search=search)  # noqa: E731
    first = ask("first", SearchSpec(kind="faiss", index="ivf"))
    kept = Path(first["search"]["url"])
    assert first["search"]["built"] and first["work"]["index_rows"] == N_TRAIN and kept.parent == beside / "faiss"
    stamp = kept.stat().st_mtime_ns
    second = ask("second", SearchSpec(kind="faiss", index="ivf", nprobe=32))  # nprobe is a search setting: the same file
    assert not second["search"]["built"] and second["work"]["index_rows"] == 0 and second["search"]["url"] == str(kept)
    assert kept.stat().st_mtime_ns == stamp and sorted(os.listdir(kept.parent)) == [kept.name, f"{kept.name}.sha256", kept.with_suffix(".json").name]
    answers = [zarr.open_group(str(tmp_path / name / "influence.zarr"), mode="r") for name in ("first", "second")]
    assert [group.attrs["search"]["built"] for group in answers] == [True, False]
    for name in ("topk_helpful_indices", "topk_harmful_indices", "topk_helpful_scores", "topk_harmful_scores"):
        np.testing.assert_array_equal(answers[0][name][:], answers[1][name][:], err_msg=name)
    other = ask("flat", SearchSpec(kind="faiss", index="flat"))
    assert other["search"]["built"] and other["search"]["url"] != str(kept)
    kept.write_bytes(kept.read_bytes()[:1000])
    assert ask("again", SearchSpec(kind="faiss", index="ivf"))["search"]["built"]
    raw = bytearray(kept.read_bytes())  # overwritten at its size: its sha256 tells, and it is built again
    raw[len(raw) // 2] ^= 0xFF
    kept.write_bytes(bytes(raw))
    assert ask("damaged", SearchSpec(kind="faiss", index="ivf"))["search"]["built"]


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--search", "nearest"], "--search: Input should be 'scan' or 'faiss'. Fix: set --search to one of the values listed"),
        (["--search", "faiss", "--faiss-index", "lsh"], "--faiss-index: Input should be 'auto', 'flat', 'ivf' or 'hnsw'. Fix: set --faiss-index to one of the values listed"),
        (["--search", "faiss", "--nprobe", "0"], "--nprobe: Input should be greater than or equal to 1. Fix: set --nprobe to 1 or more"),
        (["--search", "faiss", "--faiss-index", "hnsw", "--nprobe", "4"], "--nprobe: nprobe=4 applies to an ivf index, not to a hnsw index. Fix: leave nprobe out, or search with faiss over an ivf (or auto) index"),
        (["--nprobe", "4"], "--nprobe: nprobe=4 applies to an ivf index, not to the exact scan. Fix: leave nprobe out, or search with faiss over an ivf (or auto) index"),
    ],
    ids=["search", "faiss-index", "nprobe-zero", "nprobe-with-hnsw", "nprobe-with-scan"],
)
def test_bad_search_options_are_one_line_naming_the_flag(flags, line, tmp_path):
    """Refused before the run is opened: exit 2 and the one line."""
    done = CliRunner().invoke(app, ["query", str(tmp_path / "no-run"), "--queries", str(tmp_path / "q.npz"), *flags], terminal_width=400)
    assert done.exit_code == 2 and done.output.strip().splitlines() == [line], done.output


def test_the_faiss_index_is_kept_beside_an_index_on_s3(s3_bucket, s3_endpoint, tmp_path):
    """On S3 the FAISS index is written beside the training index and loaded by the next question, through the CLI."""
    import s3fs
    from sklearn.datasets import load_digits

    params = small_params(f"s3://{s3_bucket}/run", storage={"endpoint_url": s3_endpoint})
    influence_run(**params.sections())
    x, y = load_digits(return_X_y=True)
    np.savez(tmp_path / "q.npz", x=x[300:305].astype(np.float32), y=y[300:305])
    ask = ["query", params.output_url, "--queries", str(tmp_path / "q.npz"), "--endpoint-url", s3_endpoint, "--search", "faiss", "--top", "3"]
    first, second = (CliRunner().invoke(app, ask, terminal_width=400) for _ in range(2))
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    beside = run_index(params.store())[3].url.rsplit("/", 1)[0]
    kept = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).ls(f"{beside}/faiss")
    assert sorted(name.rsplit(".", 1)[1] for name in kept) == ["faiss", "json", "sha256"]
    assert "FAISS flat inner-product index" in first.output and "built in" in first.output and "loaded in" in second.output
    assert first.output.split("\n5 queries in")[0] == second.output.split("\n5 queries in")[0]  # the same top-k table
