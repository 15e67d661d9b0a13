"""Dataset sources → row-chunked Zarr: every source, integer labels kept, content fingerprints, bounded memory."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import torch

from influence_core.pipeline.stages import prepare
from influence_core.pipeline.store import storage
from influence_core.pipeline.store.loading import open_data
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.specs import NpyDataset, NpzDataset, StorageSpec, TorchFactoryDataset, ZarrDataset
from tests.datasets import blobs


def arrays_of(ref, store):
    return {name: np.asarray(arr[...]) for name, arr in open_data(ref, store.options).items()}


@pytest.fixture
def xy():
    rng = np.random.default_rng(0)
    return rng.standard_normal((200, 6)).astype(np.float32), rng.integers(0, 4, 200).astype(np.int32)


def test_npy_directory_with_random_hold_out(tmp_path, xy):
    x, y = xy
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    store = RunStore(output_url=str(tmp_path / "out"))
    ref = prepare.run(prepare.PrepareInput(NpyDataset(path=str(tmp_path), n_test=30, chunk_rows=16), store))
    got = arrays_of(ref, store)
    held_out = np.sort(np.random.default_rng(0).choice(200, 30, replace=False))
    keep = np.setdiff1d(np.arange(200), held_out)
    np.testing.assert_array_equal(got["x_test"], x[held_out])
    np.testing.assert_array_equal(got["x_train"], x[keep])
    np.testing.assert_array_equal(got["y_train"], y[keep])
    assert got["y_train"].dtype == np.int64 and ref.n_classes == 4
    assert open_data(ref, store.options)["x_train"].chunks == (16, 6)


def test_n_train_caps_the_streamed_training_rows(tmp_path, xy):
    x, y = xy
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    store = RunStore(output_url=str(tmp_path / "out"))
    ref = prepare.run(prepare.PrepareInput(NpyDataset(path=str(tmp_path), n_test=30, n_train=50, chunk_rows=16), store))
    keep = np.setdiff1d(np.arange(200), np.sort(np.random.default_rng(0).choice(200, 30, replace=False)))[:50]
    np.testing.assert_array_equal(arrays_of(ref, store)["x_train"], x[keep])


def test_python_docs_trains_on_the_same_windows_whatever_the_number_of_queries(tmp_path):
    """Asking 10 or 30 held-out windows leaves the training windows, and the training fingerprint that keys the
    training side's stages, as they were (the queries were cut from the training windows' front before)."""
    from influence_core.pipeline.specs import PythonDocsDataset

    refs, arrays = [], []
    for n_test in (10, 30):
        store = RunStore(output_url=str(tmp_path / f"out{n_test}"))
        refs.append(prepare.run(prepare.PrepareInput(PythonDocsDataset(window=32, n_train=200, n_test=n_test), store)))
        arrays.append(arrays_of(refs[-1], store))
        assert arrays[-1]["x_test"].shape == (n_test, 32)
    np.testing.assert_array_equal(arrays[0]["x_train"], arrays[1]["x_train"])
    np.testing.assert_array_equal(arrays[0]["x_test"], arrays[1]["x_test"][:10])
    assert not (arrays[1]["x_test"][:, None] == arrays[1]["x_train"][None]).all(-1).any()  # no query is a training window
    assert refs[0].training.fingerprint == refs[1].training.fingerprint and refs[0].fingerprint != refs[1].fingerprint


def test_python_docs_train_offset_keeps_disjoint_windows(tmp_path):
    """A pretraining run on the first 40 training windows and a fine-tune on the next 30 (train_offset: 40, with
    listed queries) share no window: both are slices of one run's 70; an offset past the windows is refused."""
    from influence_core.errors import ConfigError
    from influence_core.pipeline.specs import PythonDocsDataset

    def windows(name: str, **spec) -> np.ndarray:  # type: ignore[no-untyped-def]
        store = RunStore(output_url=str(tmp_path / name))
        return arrays_of(prepare.run(prepare.PrepareInput(PythonDocsDataset(window=32, n_test=4, **spec), store)), store)["x_train"]

    whole, first, later = windows("whole", n_train=70), windows("first", n_train=40), windows("later", n_train=30, train_offset=40, queries=["Return the| value"])
    np.testing.assert_array_equal(first, whole[:40])
    np.testing.assert_array_equal(later, whole[40:])
    assert not (first[:, None] == later[None]).all(-1).any()
    assert "train_offset" not in PythonDocsDataset().key_config() and PythonDocsDataset(train_offset=5).key_config()["train_offset"] == 5
    with pytest.raises(ConfigError, match=r"^dataset.train_offset: train_offset=10000000 skips all \d+ training windows"):
        windows("past", n_train=10, train_offset=10_000_000)


def test_fingerprint_is_content_not_chunking(tmp_path, xy):
    x, y = xy
    np.savez(tmp_path / "d.npz", x_train=x[:150], y_train=y[:150], x_test=x[150:], y_test=y[150:])
    refs = [prepare.run(prepare.PrepareInput(NpzDataset(path=str(tmp_path / "d.npz"), chunk_rows=c), RunStore(output_url=str(tmp_path / f"o{c}")))) for c in (7, 64)]
    assert refs[0].fingerprint == refs[1].fingerprint
    np.savez(tmp_path / "d.npz", x_train=x[:150] + 1, y_train=y[:150], x_test=x[150:], y_test=y[150:])
    changed = prepare.run(prepare.PrepareInput(NpzDataset(path=str(tmp_path / "d.npz"), chunk_rows=7), RunStore(output_url=str(tmp_path / "o7"))))
    assert changed.fingerprint != refs[0].fingerprint  # a replaced file is read again, not served from the cache


def test_zarr_group_on_s3(tmp_path, s3_endpoint, s3_bucket, xy):
    x, y = xy
    options = StorageSpec(endpoint_url=s3_endpoint).fsspec_options()
    group = storage.open_group(f"s3://{s3_bucket}/source.zarr", options, mode="w")
    for name, values in {"x_train": x[:150], "y_train": y[:150], "x_test": x[150:], "y_test": y[150:]}.items():
        group.create_array(name, data=values, chunks=(25, *values.shape[1:]))
    store = RunStore(output_url=f"s3://{s3_bucket}/run", storage=StorageSpec(endpoint_url=s3_endpoint))
    ref = prepare.run(prepare.PrepareInput(ZarrDataset(path=f"s3://{s3_bucket}/source.zarr"), store))
    got = arrays_of(ref, store)
    np.testing.assert_array_equal(got["x_train"], x[:150])
    np.testing.assert_array_equal(got["y_test"], y[150:])
    assert got["y_test"].dtype == np.int64


@pytest.mark.parametrize("factory", ["tests.datasets:blobs", "tests.datasets:blobs_split"])
def test_torch_dataset_factory(tmp_path, factory):
    store = RunStore(output_url=str(tmp_path))
    ref = prepare.run(prepare.PrepareInput(TorchFactoryDataset(path=factory, test_fraction=1 / 6, chunk_rows=32), store))
    got = arrays_of(ref, store)
    full = blobs()
    assert ref.n_train == 100 and ref.n_test == 20 and ref.n_classes == 3
    assert got["y_train"].dtype == np.int64
    rows = {tuple(np.round(r, 6)) for r in full.tensors[0].numpy()}
    assert all(tuple(np.round(r, 6)) in rows for r in got["x_train"])
    if factory.endswith("split"):
        np.testing.assert_array_equal(got["x_test"], full.tensors[0][100:].numpy())


def test_torch_factory_path_is_validated():
    with pytest.raises(ValueError, match="package.module:factory"):
        TorchFactoryDataset(path="not a path")


def test_prepare_streams_without_loading_the_source(tmp_path):
    """A 64 MB memory-mapped source is written and fingerprinted with far less than 64 MB of allocations."""
    rows, cols = 65536, 256
    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(rows, cols))
    for lo in range(0, rows, 8192):
        x[lo : lo + 8192] = np.random.default_rng(lo).standard_normal((8192, cols), dtype=np.float32)
    x.flush()
    np.save(tmp_path / "y.npy", np.arange(rows) % 10)
    del x
    store = RunStore(output_url=str(tmp_path / "out"))
    tracemalloc.start()
    ref = prepare.run(prepare.PrepareInput(NpyDataset(path=str(tmp_path), n_test=100, chunk_rows=2048), store))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert ref.n_train == rows - 100
    assert peak < 0.4 * rows * cols * 4, f"peak traced allocation {peak / 2**20:.1f} MB for 64 MB of data"
    first = np.asarray(open_data(ref, store.options)["x_train"][:3])
    assert torch.is_tensor(torch.from_numpy(first)) and first.shape == (3, cols)


def test_prepare_data_key_hashes_the_flat_spec(tmp_path):
    """The digits' prepare_data key is that of the flat dataset spec's dump (as at commit 98cf5ce), so a digits run
    keeps its stage key although its config no longer carries the synthetic settings."""
    from influence_core.pipeline.store.stage import stage_key
    from influence_core.pipeline.specs import DigitsDataset

    flat = {"source": "digits", "path": None, "n_train": 50, "n_test": None, "test_fraction": 0.2, "n_features": 20, "n_classes": 2, "noise": 0.1, "seed": 0, "chunk_rows": 4096}
    call = prepare.PrepareInput(DigitsDataset(n_train=50), RunStore(output_url=str(tmp_path))).call
    assert call.key == stage_key("prepare_data", flat, {})


def _prepared(tmp_path, name, spec):
    store = RunStore(output_url=str(tmp_path / name))
    ref = prepare.run(prepare.PrepareInput(spec, store))
    return ref, arrays_of(ref, store)


@pytest.mark.parametrize("source", ["synthetic", "digits", "python_docs", "npz_split"])
def test_a_query_offset_asks_the_next_held_out_rows_of_the_same_split(tmp_path, source, xy):
    """Rows offset..offset + n_test of the queries that n_test = offset + n_test would give, the same training rows
    (so the training side's stages are reused), across stored blocks smaller than the offset (npz, chunk_rows 16)."""
    from influence_core.pipeline.specs import DigitsDataset, PythonDocsDataset, SyntheticClassificationDataset

    x, y = xy
    np.savez(tmp_path / "split.npz", x_train=x[:120], y_train=y[:120], x_test=x[120:], y_test=y[120:])
    make = {
        "synthetic": lambda **kw: SyntheticClassificationDataset(n_train=64, n_features=5, **kw),
        "digits": lambda **kw: DigitsDataset(n_train=64, **kw),
        "python_docs": lambda **kw: PythonDocsDataset(window=16, n_train=64, **kw),  # its 256 byte classes are stated, not counted over the queries
        "npz_split": lambda **kw: NpzDataset(path=str(tmp_path / "split.npz"), chunk_rows=16, **kw),
    }[source]
    whole_ref, whole = _prepared(tmp_path, "whole", make(n_test=50))
    ref, got = _prepared(tmp_path, "offset", make(n_test=30, query_offset=20))
    np.testing.assert_array_equal(got["x_test"], whole["x_test"][20:50])
    np.testing.assert_array_equal(got["y_test"], whole["y_test"][20:50])
    np.testing.assert_array_equal(got["x_train"], whole["x_train"])
    assert ref.training.fingerprint == whole_ref.training.fingerprint and ref.fingerprint != whole_ref.fingerprint


def test_fewer_queries_than_n_test_asks_are_kept_and_said(tmp_path):
    """"At most n_test": a source holding fewer query rows keeps them all, and the run's check says so (the flow logs
    it as a warning), with or without a query_offset. The digits source holds out 20% of scikit-learn's 1,797 images,
    stratified: 360 rows."""
    from influence_core.pipeline.sources.data import fewer_queries
    from influence_core.pipeline.specs import DigitsDataset

    from sklearn.datasets import load_digits

    held_out = math.ceil(0.2 * len(load_digits().target))  # train_test_split rounds the held-out share up
    asked = DigitsDataset(n_train=64, n_test=500)
    ref, _ = _prepared(tmp_path, "asked", asked)
    assert ref.n_test == held_out == 360
    assert fewer_queries(asked, ref.n_test) == "dataset.n_test: asked for 500 query examples, but source=digits holds 360: scoring those 360"
    offset = DigitsDataset(n_train=64, n_test=300, query_offset=100)
    ref, _ = _prepared(tmp_path, "offset", offset)
    assert ref.n_test == 260
    assert fewer_queries(offset, ref.n_test) == "dataset.n_test: asked for 300 query examples, but source=digits holds 260 after query_offset=100: scoring those 260"
    assert fewer_queries(DigitsDataset(n_train=64, n_test=360), 360) is None and fewer_queries(DigitsDataset(n_train=64), 360) is None


def test_a_query_offset_is_refused_where_it_would_move_rows_or_skip_every_query(tmp_path, xy):
    from influence_core.errors import ConfigError
    from influence_core.pipeline.specs import PythonDocsDataset

    x, y = xy
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    np.savez(tmp_path / "split.npz", x_train=x[:120], y_train=y[:120], x_test=x[120:], y_test=y[120:])
    cases = [
        (NpyDataset(path=str(tmp_path), n_test=30, query_offset=10), "^dataset.query_offset: source=npy holds one set, whose query rows are drawn at random"),
        (PythonDocsDataset(queries=["Return the| value"], query_offset=1), "^dataset.query_offset: the queries are the texts listed in dataset.queries"),
        (NpzDataset(path=str(tmp_path / "split.npz"), query_offset=80), "^dataset.query_offset: query_offset=80 skips all 80 query examples that source=npz holds here. Fix: set dataset.query_offset below 80"),
    ]
    for spec, message in cases:
        with pytest.raises(ConfigError, match=message):
            _prepared(tmp_path, spec.source, spec)


def test_a_query_class_the_training_rows_lack_keeps_the_training_key_and_is_refused_before_training(tmp_path, xy):
    """The classes are the training rows' (0..3 here): queries holding label 5 leave n_classes and the training
    fingerprint as queries of known classes do, so the trained model and curvature are reused, and the run refuses
    them in one line naming the fix; with model.output_dim covering them, they are taken."""
    from influence_core.errors import ConfigError
    from influence_core.pipeline.model.models import check_query_labels
    from influence_core.pipeline.specs import ModelSpec

    x, y = xy
    np.savez(tmp_path / "known.npz", x_train=x[:120], y_train=y[:120], x_test=x[120:], y_test=y[120:])
    np.savez(tmp_path / "new.npz", x_train=x[:120], y_train=y[:120], x_test=x[120:], y_test=np.where(np.arange(80) == 7, 5, y[120:]))
    known, _ = _prepared(tmp_path, "known", NpzDataset(path=str(tmp_path / "known.npz")))
    new, got = _prepared(tmp_path, "new", NpzDataset(path=str(tmp_path / "new.npz")))
    assert new.n_classes == known.n_classes == 4 and new.training.fingerprint == known.training.fingerprint
    with pytest.raises(ConfigError, match=r"^dataset: a query has label 5, but the model has 4 outputs.*model.output_dim: 6"):
        check_query_labels(ModelSpec(), new, got["y_test"])
    check_query_labels(ModelSpec(output_dim=6), new, got["y_test"])
    check_query_labels(ModelSpec(), known, arrays_of(known, RunStore(output_url=str(tmp_path / "known")))["y_test"])
