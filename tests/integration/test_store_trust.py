"""Stored stage outputs are long-lived assets: a damaged index chunk, a swapped model, a replaced dataset file or a
moved stage store never gives an answer. A question refuses in one line naming the stage and the repair; a run
recomputes exactly what is damaged and its scores equal an uncached run's; a moved stage store is found where it
lands. Real stores (local and moto S3), a real Prefect API."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import s3fs
from sklearn.datasets import load_digits
from typer.testing import CliRunner

from flows.cli import app
from flows.influence_run import influence_run
from influence_core.pipeline.report.verify import verify_run
from influence_core.pipeline.score.query import ask
from influence_core.pipeline.specs import SearchSpec, StorageSpec
from influence_core.pipeline.store import storage
from influence_core.pipeline.store.run_store import RunStore
from tests.helpers import read_outputs, small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
runner = CliRunner()
COMPUTE = {"cluster": "sequential", "train_chunk_rows": 64}  # 240 training rows: 4 index chunks of 64 rows


def _digits_npz(path: Path, queries: slice, train_rows: slice = slice(0, 240)) -> str:
    x, y = load_digits(return_X_y=True)
    rest_x, rest_y = x[300:][queries], y[300:][queries]
    np.savez(path, x_train=x[train_rows].astype(np.float32), y_train=y[train_rows], x_test=rest_x.astype(np.float32), y_test=rest_y)
    return str(path)


def _params(root: str, data: str, cache: str | None, seed: int = 0, **storage_options):
    dataset = {"source": "npz", "path": data, "chunk_rows": 64}
    return small_params(root, dataset=dataset, compute=COMPUTE, training={"epochs": 15, "seed": seed}, storage={"cache_url": cache, **storage_options})


def _questions(tmp_path: Path) -> str:
    x, y = load_digits(return_X_y=True)
    path = tmp_path / "q.npz"
    np.savez(path, x=x[-6:].astype(np.float32), y=y[-6:])
    return str(path)


def _query(run: str, queries: str, *extra: str):
    return runner.invoke(app, ["query", run, "--queries", queries, *extra], terminal_width=400)


def _one_line_refusal(result, *parts: str) -> str:
    """The command refused with exit 1 and one line (no traceback) that holds every part."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and "Traceback" not in result.output, result.output
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


class LocalFiles:
    """The store's objects on a local disk."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def url(self, relative: str) -> str:
        return str(self.root / relative)

    def glob(self, pattern: str) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.glob(pattern))

    def read(self, relative: str) -> bytes:
        return (self.root / relative).read_bytes()

    def write(self, relative: str, data: bytes) -> None:
        (self.root / relative).write_bytes(data)

    def delete(self, relative: str) -> None:
        (self.root / relative).unlink()


class S3Files:
    """The store's objects in a moto S3 bucket, reached through s3fs as a user would."""

    def __init__(self, root: str, endpoint: str) -> None:
        self.root, self.fs = root, s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, use_listings_cache=False)

    def url(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def glob(self, pattern: str) -> list[str]:
        prefix = self.root.removeprefix("s3://")
        return sorted(p.removeprefix(prefix + "/") for p in self.fs.glob(f"{prefix}/{pattern}"))

    def read(self, relative: str) -> bytes:
        return self.fs.cat_file(self.url(relative))

    def write(self, relative: str, data: bytes) -> None:
        self.fs.pipe_file(self.url(relative), data)

    def delete(self, relative: str) -> None:
        self.fs.rm(self.url(relative))


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    """Where the run and its stage store live: (run URL, stage store URL, the store's files, fsspec options)."""
    if request.param == "local":
        return str(tmp_path / "run"), str(tmp_path / "cache"), LocalFiles(tmp_path / "cache"), {}
    endpoint, bucket = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run", f"s3://{bucket}/cache", S3Files(f"s3://{bucket}/cache", endpoint), {"endpoint_url": endpoint}


@pytest.mark.parametrize("damage", ["copy of another chunk", "random bytes"])
def test_an_index_chunk_overwritten_at_its_size_is_refused_and_recomputed(tmp_path, place, damage):
    """Issue 52, case 2: one index chunk overwritten with bytes of its own size. A question refuses it in one line
    naming index_training and the repair; a run with new queries through the shared stage store recomputes that chunk
    alone, and its scores equal an uncached run's bit for bit."""
    run, cache, files, s3 = place
    params = _params(run, _digits_npz(tmp_path / "a.npz", slice(0, 10)), cache, **s3)
    influence_run(**params.sections())
    chunks = files.glob("index_training/*/index.zarr/features/c/*/0")
    assert len(chunks) == 4
    size = len(files.read(chunks[2]))
    files.write(chunks[2], files.read(chunks[1]) if damage.startswith("copy") else os.urandom(size))
    assert len(files.read(chunks[2])) == size

    endpoint = ["--endpoint-url", s3["endpoint_url"]] if s3 else []
    _one_line_refusal(_query(run, _questions(tmp_path), *endpoint), "index_training: ", "index.zarr/features/c/2/0", "Fix: run `influence-pipeline repair")

    again = _params(run + "-b", _digits_npz(tmp_path / "b.npz", slice(10, 25)), cache, **s3)
    summary = influence_run(**again.sections())
    assert summary["stages"]["index_training"]["outcome"] == "computed" and summary["stages"]["index_training"]["chunks_computed"] == 1
    assert summary["stages"]["fit_model"]["outcome"] != "computed"
    fresh = _params(str(tmp_path / "fresh"), _digits_npz(tmp_path / "b.npz", slice(10, 25)), None)
    influence_run(**fresh.sections())
    _, got = read_outputs(again.store())
    _, expected = read_outputs(fresh.store())
    for name in ("scores", "self_influence", "topk_helpful_indices", "topk_harmful_indices"):
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@pytest.fixture
def indexed_run(tmp_path) -> tuple[RunStore, LocalFiles]:
    """A finished run whose stage store is a separate folder, and that folder's files."""
    params = _params(str(tmp_path / "run"), _digits_npz(tmp_path / "a.npz", slice(0, 10)), str(tmp_path / "cache"))
    influence_run(**params.sections())
    return params.store(), LocalFiles(tmp_path / "cache")


def _answer(store: RunStore, queries: str, search: str = "scan") -> dict[str, np.ndarray]:
    return ask(RunStore(output_url=store.output_url), queries, 4, search=SearchSpec(kind=search))[0].arrays


def test_a_deleted_chunk_is_refused_by_scan_and_faiss_and_faiss_never_keeps_damaged_rows(tmp_path, indexed_run):
    """Case 3: a deleted index chunk. Scan and FAISS questions refuse it (no FAISS index is built from the damaged
    rows); after `repair`, the FAISS answer equals the scan's."""
    store, files = indexed_run
    queries = _questions(tmp_path)
    expected = _answer(store, queries)
    [chunk] = files.glob("index_training/*/index.zarr/features/c/1/0")
    files.delete(chunk)
    for search in ("scan", "faiss"):
        _one_line_refusal(_query(store.output_url, queries, "--search", search), "index_training: ", "features/c/1/0 is missing")
    assert files.glob("index_training/*/faiss/*") == []
    repaired = runner.invoke(app, ["repair", store.output_url], terminal_width=400)
    assert repaired.exit_code == 0, repaired.output
    assert "index_training" in repaired.output
    for search in ("scan", "faiss"):  # FAISS scores its candidates by other float32 products: the same to round-off
        got = _answer(store, queries, search)
        for name, values in expected.items():
            compare = np.testing.assert_array_equal if name.endswith("indices") else lambda a, b, err_msg: np.testing.assert_allclose(a, b, rtol=1e-4, err_msg=err_msg)
            compare(got[name], values, err_msg=f"{search}: {name}")


def test_a_stage_being_repaired_is_refused(tmp_path, indexed_run):
    """Case 3, a question during a repair: a stage found damaged loses its manifest before it is computed again, and
    a question meanwhile refuses the incomplete index instead of answering from it."""
    store, files = indexed_run
    [manifest] = files.glob("index_training/*/manifest.json")
    files.delete(manifest)  # what StageCall.run does first when it recomputes a damaged stage
    _one_line_refusal(_query(store.output_url, _questions(tmp_path)), "index_training: ", "has no manifest", "being recomputed")


def test_a_swapped_model_is_refused_by_query_and_verify(tmp_path, indexed_run):
    """Case 4: model.pt (and its digest) replaced by another seed's model of the same architecture: the question and
    verify refuse fit_model; `repair` trains it again, and the question then gives the original answer."""
    store, files = indexed_run
    queries = _questions(tmp_path)
    expected = _answer(store, queries)
    other = _params(str(tmp_path / "other"), _digits_npz(tmp_path / "a.npz", slice(0, 10)), str(tmp_path / "other-cache"), seed=1)
    influence_run(**other.sections())
    [mine] = files.glob("fit_model/*/model.pt")
    [theirs] = LocalFiles(tmp_path / "other-cache").glob("fit_model/*/model.pt")
    for name in (mine, mine + ".sha256"):
        shutil.copy(tmp_path / "other-cache" / theirs.replace("model.pt", Path(name).name), tmp_path / "cache" / name)
    assert files.read(mine) != b"" and files.read(mine) == (tmp_path / "other-cache" / theirs).read_bytes()
    _one_line_refusal(_query(store.output_url, queries), "fit_model: ", "model.pt holds other bytes than recorded")
    failed = {check.name: check.detail for check in verify_run(RunStore(output_url=store.output_url)) if not check.ok}
    assert list(failed) == ["stage fit_model"], failed
    assert runner.invoke(app, ["repair", store.output_url]).exit_code == 0
    got = _answer(store, queries)
    for name, values in expected.items():
        np.testing.assert_array_equal(got[name], values, err_msg=name)


def test_a_truncated_chunk_and_deleted_metadata_are_refused_then_repaired(tmp_path, indexed_run):
    """Cases 8 and 9: a truncated index chunk, a deleted index.zarr/zarr.json and a deleted features/zarr.json: each
    question refuses in one line, verify fails, and `repair` recomputes the index so that verify passes and the run
    is complete again."""
    store, files = indexed_run
    queries = _questions(tmp_path)
    [chunk] = files.glob("index_training/*/index.zarr/features/c/3/0")
    stage = chunk.split("/index.zarr")[0]
    damages = {
        "truncated chunk": (lambda: files.write(chunk, files.read(chunk)[:250]), "features/c/3/0 has 250 bytes"),
        "group metadata": (lambda: files.delete(f"{stage}/index.zarr/zarr.json"), "index.zarr/zarr.json is missing"),
        "array metadata": (lambda: files.delete(f"{stage}/index.zarr/features/zarr.json"), "features/zarr.json is missing"),
    }
    for name, (damage, phrase) in damages.items():
        damage()
        _one_line_refusal(_query(store.output_url, queries), "index_training: ", phrase)
        assert "stage index_training" in [check.name for check in verify_run(RunStore(output_url=store.output_url)) if not check.ok], name
        repaired = runner.invoke(app, ["repair", store.output_url], terminal_width=400)
        assert repaired.exit_code == 0, repaired.output
        checks = verify_run(RunStore(output_url=store.output_url))
        assert all(check.ok for check in checks), (name, [c for c in checks if not c.ok])
        assert storage.open_group(store.influence_url, {}, mode="r").attrs["status"] == "complete"


def test_a_replaced_dataset_file_of_the_same_size_and_mtime_is_read_again(tmp_path):
    """Case 5: the dataset file replaced by other rows of the same size and modification time (as `cp -p` leaves
    it): with a shared stage store nothing of the old training side is reused, and the scores equal an uncached
    run's."""
    data, cache = tmp_path / "data.npz", str(tmp_path / "cache")
    _digits_npz(data, slice(0, 10), slice(0, 240))
    influence_run(**_params(str(tmp_path / "a"), str(data), cache).sections())
    stamp = data.stat()
    size = stamp.st_size
    _digits_npz(data, slice(0, 10), slice(240, 480))
    assert data.stat().st_size == size
    os.utime(data, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    again = _params(str(tmp_path / "b"), str(data), cache)
    summary = influence_run(**again.sections())
    for name in ("prepare_data", "fit_model", "fit_preconditioner", "index_training"):
        assert summary["stages"][name]["outcome"] == "computed", name
    fresh = _params(str(tmp_path / "fresh"), str(data), None)
    influence_run(**fresh.sections())
    np.testing.assert_array_equal(read_outputs(again.store())[1]["scores"], read_outputs(fresh.store())[1]["scores"])


def test_a_moved_stage_store_is_found_where_it_lands(tmp_path, indexed_run):
    """Case 10: the external stage store moved. show and query say so in one line naming --cache-url; given the new
    place they answer as before; a run pointed there reuses every stage (manifests hold store-relative paths)."""
    store, _ = indexed_run
    queries = _questions(tmp_path)
    expected = _answer(store, queries)
    moved = tmp_path / "moved-cache"
    (tmp_path / "cache").rename(moved)
    _one_line_refusal(runner.invoke(app, ["show", store.output_url], terminal_width=400), "has no manifest", "--cache-url")
    _one_line_refusal(_query(store.output_url, queries), "has no manifest", "--cache-url")
    shown = runner.invoke(app, ["show", store.output_url, "--cache-url", str(moved)], terminal_width=400)
    assert shown.exit_code == 0, shown.output
    asked = ask(RunStore(output_url=store.output_url, storage=StorageSpec(cache_url=str(moved))), queries, 4)[0].arrays
    for name, values in expected.items():
        np.testing.assert_array_equal(asked[name], values, err_msg=name)
    again = _params(store.output_url, _digits_npz(tmp_path / "a.npz", slice(0, 10)), str(moved))
    summary = influence_run(**again.sections())
    assert {stage["outcome"] for stage in summary["stages"].values()} <= {"cached", "found complete"}, summary["stages"]
