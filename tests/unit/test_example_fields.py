"""Examples as dicts of named arrays (issue 25, item 3): every source reads back exactly what was written, one Zarr
array per field and split, integer dtypes and (C, H, W) kept; bad fields are refused naming them, leaving nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr
from pydantic import ValidationError

from influence_core import ConfigError
from influence_core.pipeline.stages import prepare
from influence_core.pipeline.store.loading import open_data
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.specs import HfDiskDataset, NpyDataset, NpzDataset, ParquetDataset, TorchFactoryDataset, ZarrDataset
from influence_core.task import IGNORE_INDEX

N_TRAIN, N_TEST = 20, 6


def make_fields(n: int, seed: int) -> dict[str, np.ndarray]:
    """Token ids (int32), a right-padded attention mask, images (C, H, W) float32 and integer labels."""
    rng = np.random.default_rng(seed)
    mask = (np.arange(7)[None, :] < rng.integers(3, 8, n)[:, None]).astype(np.int8)
    return {
        "input_ids": rng.integers(0, 50, (n, 7)).astype(np.int32),
        "attention_mask": mask,
        "pixel_values": rng.standard_normal((n, 3, 4, 5)).astype(np.float32),
        "labels": rng.integers(0, 3, n).astype(np.int64),
    }


TRAIN, TEST = make_fields(N_TRAIN, 0), make_fields(N_TEST, 1)
INPUTS = ["input_ids", "attention_mask", "pixel_values"]


def split_files() -> dict[str, np.ndarray]:
    return {**{f"{k}_train": v for k, v in TRAIN.items()}, **{f"{k}_test": v for k, v in TEST.items()}}


def prepared(spec, tmp_path):  # type: ignore[no-untyped-def]
    store = RunStore(output_url=str(tmp_path / "out"))
    ref = prepare.run(prepare.PrepareInput(spec, store))
    return ref, open_data(ref, store.options)


def assert_read_back(ref, arrays, train=TRAIN, test=TEST) -> None:  # type: ignore[no-untyped-def]
    """Each field of each split equals what was written, with integers as int64 and floats as float32."""
    for split, expected in (("train", train), ("test", test)):
        x = arrays[f"x_{split}"]
        assert sorted(x) == sorted(INPUTS)
        for name in INPUTS:
            got = np.asarray(x[name][...])
            np.testing.assert_array_equal(got, expected[name])
            assert got.dtype == (np.float32 if name == "pixel_values" else np.int64)
            assert ref.arrays[f"x_{split}/{name}"].fingerprint == x[name].attrs["fingerprint"]
        np.testing.assert_array_equal(np.asarray(arrays[f"y_{split}"][...]), expected["labels"])
    assert arrays["x_train"]["pixel_values"].shape == (len(train["labels"]), 3, 4, 5) and arrays["x_train"]["pixel_values"].chunks == (8, 3, 4, 5)


def named(source_cls, path, **extra):  # type: ignore[no-untyped-def]
    return source_cls(path=str(path), inputs=INPUTS, target="labels", chunk_rows=8, **extra)


def test_npz_with_named_fields(tmp_path):
    np.savez(tmp_path / "d.npz", **split_files())
    ref, arrays = prepared(named(NpzDataset, tmp_path / "d.npz"), tmp_path)
    assert_read_back(ref, arrays)


def test_npy_directory_with_named_fields_and_a_hold_out(tmp_path):
    for name, values in TRAIN.items():
        np.save(tmp_path / f"{name}.npy", values)
    ref, arrays = prepared(named(NpyDataset, tmp_path, n_test=5), tmp_path)
    held_out = np.sort(np.random.default_rng(0).choice(N_TRAIN, 5, replace=False))
    keep = np.setdiff1d(np.arange(N_TRAIN), held_out)
    assert_read_back(ref, arrays, {k: v[keep] for k, v in TRAIN.items()}, {k: v[held_out] for k, v in TRAIN.items()})


def test_zarr_group_with_named_fields(tmp_path):
    group = zarr.open_group(str(tmp_path / "src.zarr"), mode="w")
    for name, values in split_files().items():
        group.create_array(name, data=values, chunks=(4, *values.shape[1:]))
    ref, arrays = prepared(named(ZarrDataset, tmp_path / "src.zarr"), tmp_path)
    assert_read_back(ref, arrays)


def test_fingerprints_fold_every_field(tmp_path):
    """The data fingerprint changes with any one field's content; the rest keep their own fingerprints."""
    np.savez(tmp_path / "d.npz", **split_files())
    before, _ = prepared(named(NpzDataset, tmp_path / "d.npz"), tmp_path)
    changed = split_files()
    changed["attention_mask_test"] = changed["attention_mask_test"].copy()
    changed["attention_mask_test"][0, -1] ^= 1
    np.savez(tmp_path / "e.npz", **changed)
    after, _ = prepared(named(NpzDataset, tmp_path / "e.npz"), tmp_path / "e")
    assert after.fingerprint != before.fingerprint
    differ = {name for name in before.arrays if before.arrays[name].fingerprint != after.arrays[name].fingerprint}
    assert differ == {"x_test/attention_mask"}


class DictDataset(torch.utils.data.Dataset):
    """Hugging Face style: each example a dict of tensors, labels among them."""

    def __init__(self, fields: dict[str, np.ndarray]) -> None:
        self.fields = fields

    def __len__(self) -> int:
        return len(self.fields["labels"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {name: torch.as_tensor(values[i]) for name, values in self.fields.items()}


class PairDataset(DictDataset):
    """(inputs dict, label) pairs."""

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # type: ignore[override]
        item = super().__getitem__(i)
        return {name: item[name] for name in INPUTS}, item["labels"]


def dict_datasets() -> tuple[DictDataset, DictDataset]:
    return DictDataset(TRAIN), DictDataset(TEST)


def pair_datasets() -> tuple[PairDataset, PairDataset]:
    return PairDataset(TRAIN), PairDataset(TEST)


@pytest.mark.parametrize("factory", ["dict_datasets", "pair_datasets"])
def test_torch_factory_of_dict_examples(tmp_path, factory):
    spec = TorchFactoryDataset(path=f"tests.unit.test_example_fields:{factory}", target="labels", chunk_rows=8)
    ref, arrays = prepared(spec, tmp_path)
    assert_read_back(ref, arrays)


def columns(fields: dict[str, np.ndarray]) -> dict[str, list]:
    """Fields as table columns: arrays of shape (n, ...) as nested lists per row."""
    return {name: values.tolist() for name, values in fields.items()}


def test_hf_disk_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns(TRAIN)), "test": datasets.Dataset.from_dict(columns(TEST))})
    splits.save_to_disk(str(tmp_path / "hf"))
    ref, arrays = prepared(named(HfDiskDataset, tmp_path / "hf"), tmp_path)
    assert_read_back(ref, arrays)


def test_parquet_directory_and_single_feather_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table(columns(TRAIN)), tmp_path / "pq" / "train.parquet")
    pq.write_table(pa.table(columns(TEST)), tmp_path / "pq" / "test.parquet")
    ref, arrays = prepared(named(ParquetDataset, tmp_path / "pq"), tmp_path)
    assert_read_back(ref, arrays)
    feather.write_feather(pa.table(columns(TRAIN)), tmp_path / "all.feather")
    ref, arrays = prepared(named(ParquetDataset, tmp_path / "all.feather", n_test=5), tmp_path / "one")
    held_out = np.sort(np.random.default_rng(0).choice(N_TRAIN, 5, replace=False))
    keep = np.setdiff1d(np.arange(N_TRAIN), held_out)
    assert_read_back(ref, arrays, {k: v[keep] for k, v in TRAIN.items()}, {k: v[held_out] for k, v in TRAIN.items()})


def test_a_parquet_file_is_read_row_group_by_row_group(tmp_path):
    """A single Parquet file of row groups of 3 rows, split by the seeded hold-out: every field reads back exactly
    (the held-out rows are gathered across groups), and the source reads one group at a time, never the whole file."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from influence_core.pipeline.sources.tables import ParquetColumn

    pq.write_table(pa.table(columns(TRAIN)), tmp_path / "all.parquet", row_group_size=3)
    column = ParquetColumn(tmp_path / "all.parquet", "pixel_values")
    assert column.shape == (N_TRAIN, 3, 4, 5) and column.file.metadata.num_row_groups == 7
    np.testing.assert_array_equal(column[[19, 0, 4]], TRAIN["pixel_values"][[19, 0, 4]])
    ref, arrays = prepared(named(ParquetDataset, tmp_path / "all.parquet", n_test=5), tmp_path)
    held_out = np.sort(np.random.default_rng(0).choice(N_TRAIN, 5, replace=False))
    keep = np.setdiff1d(np.arange(N_TRAIN), held_out)
    assert_read_back(ref, arrays, {k: v[keep] for k, v in TRAIN.items()}, {k: v[held_out] for k, v in TRAIN.items()})


def test_language_modelling_labels_from_input_ids_skip_padding(tmp_path):
    """target: input_ids with an attention_mask: the labels are the ids, IGNORE_INDEX where the mask is 0."""
    np.savez(tmp_path / "d.npz", **split_files())
    spec = NpzDataset(path=str(tmp_path / "d.npz"), inputs=["input_ids", "attention_mask"], target="input_ids")
    _, arrays = prepared(spec, tmp_path)
    expected = np.where(TRAIN["attention_mask"] == 0, IGNORE_INDEX, TRAIN["input_ids"])
    np.testing.assert_array_equal(np.asarray(arrays["y_train"][...]), expected)
    np.testing.assert_array_equal(np.asarray(arrays["x_train"]["input_ids"][...]), TRAIN["input_ids"])


def test_existing_specs_keep_their_keys():
    """A path source without field names hashes as before (no inputs/target keys); naming them changes the key."""
    plain = NpzDataset.model_construct(source="npz", path="d.npz")
    assert "inputs" not in plain.key_config() and "target" not in plain.key_config()
    assert NpzDataset.model_construct(source="npz", path="d.npz", inputs=["a"], target="labels").key_config()["inputs"] == ["a"]


# -- bad input: refused naming the field, nothing left behind ----------------------------------------------------
def refused(spec, tmp_path) -> ConfigError:  # type: ignore[no-untyped-def]
    store = RunStore(output_url=str(tmp_path / "out"))
    with pytest.raises(ConfigError) as caught:
        prepare.run(prepare.PrepareInput(spec, store))
    assert not list((tmp_path / "out").rglob("manifest.json")) and not list((tmp_path / "out").rglob("zarr.json"))
    return caught.value


def with_change(tmp_path, **changes: np.ndarray):  # type: ignore[no-untyped-def]
    files = {**split_files(), **changes}
    np.savez(tmp_path / "bad.npz", **files)
    return named(NpzDataset, tmp_path / "bad.npz")


def test_nan_in_a_float_field(tmp_path):
    pixels = TRAIN["pixel_values"].copy()
    pixels[13, 1, 2, 3] = np.nan
    error = refused(with_change(tmp_path, pixel_values_train=pixels), tmp_path)
    assert error.field == "dataset.path" and "pixel_values_train holds NaN or inf (first at row 13)" in error.problem


def test_attention_mask_not_zero_or_one(tmp_path):
    mask = TEST["attention_mask"].copy()
    mask[4, 0] = 2
    error = refused(with_change(tmp_path, attention_mask_test=mask), tmp_path)
    assert error.field == "dataset.inputs" and "attention_mask_test" in error.problem and "row 4" in error.problem


def test_negative_labels(tmp_path):
    labels = TRAIN["labels"].copy()
    labels[3] = -2
    error = refused(with_change(tmp_path, labels_train=labels), tmp_path)
    assert "negative label -2" in error.problem and "row 3" in error.problem


def test_fields_with_different_row_counts(tmp_path):
    error = refused(with_change(tmp_path, attention_mask_train=TRAIN["attention_mask"][:-1]), tmp_path)
    assert f"attention_mask_train has {N_TRAIN - 1} rows but labels_train has {N_TRAIN}" in error.problem


def test_field_shape_differs_between_train_and_test(tmp_path):
    error = refused(with_change(tmp_path, input_ids_test=TEST["input_ids"][:, :5], attention_mask_test=TEST["attention_mask"][:, :5]), tmp_path)
    assert "query input_ids have shape (5,) but training input_ids (7,)" in error.problem and "pad" in error.fix


def test_missing_field(tmp_path):
    files = split_files()
    del files["pixel_values_test"]
    np.savez(tmp_path / "bad.npz", **files)
    error = refused(named(NpzDataset, tmp_path / "bad.npz"), tmp_path)
    assert "pixel_values_test" in error.fix


def test_ragged_lists_are_refused_naming_the_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = columns(TRAIN)
    table["input_ids"] = [row[: 3 + i % 4] for i, row in enumerate(table["input_ids"])]
    pq.write_table(pa.table(table), tmp_path / "ragged.parquet")
    error = refused(named(ParquetDataset, tmp_path / "ragged.parquet"), tmp_path)
    assert "'input_ids'" in error.problem and "different lengths" in error.problem and "pad input_ids" in error.fix


def test_field_names_are_validated():
    with pytest.raises(ValidationError, match="dataset.inputs"):
        NpzDataset.model_validate({"source": "npz", "path": __file__, "inputs": ["a", "a"]})


def test_built_in_architectures_refuse_named_fields(tmp_path):
    from influence_core.pipeline.model.models import build_model
    from influence_core.pipeline.specs import ModelSpec

    np.savez(tmp_path / "d.npz", **split_files())
    ref, _ = prepared(named(NpzDataset, tmp_path / "d.npz"), tmp_path)
    with pytest.raises(ConfigError) as caught:
        build_model(ModelSpec(), ref)
    assert caught.value.field == "dataset.inputs" and "model.factory" in caught.value.fix
