"""Arrow tables as named arrays: local Parquet and Arrow/Feather files, and Hugging Face `datasets` saved to disk.
pyarrow and datasets (the `data` extra) are imported only here, when such a source is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError

SPLITS = ("train", "test")
TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")


def _require(module: str) -> Any:
    """Import pyarrow or datasets, or say which extra installs them."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError("dataset.source", f"this source needs {module}, which is not installed", "pip install 'influence-pipeline[data]' (pyarrow and datasets)") from None


class ArrowColumn:
    """One column of a table as an array-like: `shape`, and rows (a slice or indices) read into numpy. Fixed-length
    (nested) lists become trailing dimensions (token ids (n, T), images (n, C, H, W)); ragged lists are refused, and
    so is a row read with a missing value, named by its row in `where` (the file or split)."""

    def __init__(self, column: Any, name: str, where: str) -> None:
        pa = _require("pyarrow")
        self.column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        self.name, self.where = name, where
        self.shape = (len(self.column), *_inner_shape(self.column, name))

    def __getitem__(self, rows: Any) -> np.ndarray:
        if isinstance(rows, slice):
            start, stop, _ = rows.indices(len(self.column))
            part = self.column.slice(start, max(0, stop - start))
            wanted = np.arange(start, start + len(part))
        else:
            wanted = np.asarray(rows, dtype=np.int64)
            part = self.column.take(wanted)
        _refuse_nulls(part, wanted, self.name, self.where)
        return _numpy(part, self.shape[1:])


class ParquetColumn:
    """One column of a Parquet file as an array-like read row group by row group: the rows asked for come off disk
    (with the groups holding them), so a file larger than memory streams into Zarr. Shapes as ArrowColumn's."""

    def __init__(self, path: Path, name: str) -> None:
        self.file, self.name, self.file_name = _require("pyarrow.parquet").ParquetFile(path, memory_map=True), name, path.name
        groups = self.file.metadata.num_row_groups
        self.starts = np.cumsum([0] + [self.file.metadata.row_group(g).num_rows for g in range(groups)])
        inner = {_inner_shape(self._group(g), name) for g in range(groups)}  # one group in memory at a time
        if len(inner) > 1:
            raise ConfigError("dataset.path", f"column {name!r} holds lists of different lengths {sorted(inner)}", f"pad {name} to one length (and give an attention_mask)")
        self.shape = (int(self.starts[-1]), *(inner.pop() if inner else ()))

    def _group(self, g: int) -> Any:
        return self.file.read_row_group(g, columns=[self.name]).column(0).combine_chunks()

    def __getitem__(self, rows: Any) -> np.ndarray:
        n = self.shape[0]
        wanted = np.arange(n)[rows] if isinstance(rows, slice) else np.asarray(rows, dtype=np.int64)
        out = np.empty((len(wanted), *self.shape[1:]), dtype=self._dtype())
        groups = np.searchsorted(self.starts, wanted, side="right") - 1
        for g in np.unique(groups):
            mine = groups == g
            part = self._group(int(g)).take(wanted[mine] - self.starts[g])
            _refuse_nulls(part, wanted[mine], self.name, self.file_name)
            out[mine] = _numpy(part, self.shape[1:])
        return out

    def _dtype(self) -> np.dtype:
        return _numpy(self.file.read_row_group(0, columns=[self.name]).column(0).slice(0, 1).combine_chunks(), self.shape[1:]).dtype


def _numpy(part: Any, inner: tuple[int, ...]) -> np.ndarray:
    """An Arrow array of rows (lists flattened level by level) as numpy (rows, *inner)."""
    values = part
    while _is_list(values.type):
        values = values.flatten()
    return values.to_numpy(zero_copy_only=False).reshape(len(part), *inner)


def _null_rows(part: Any) -> np.ndarray:
    """Positions of the rows of `part` with a missing value at any level of their lists (sorted; found from the null
    counts, without a scan, when there is none): numpy would read a null integer as -9223372036854775808."""
    pc = _require("pyarrow.compute")
    rows, values, found = np.arange(len(part)), part, []
    while True:
        if values.null_count:
            found.append(rows[np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))])
        if not _is_list(values.type):
            return np.unique(np.concatenate(found)) if found else rows[:0]
        rows, values = rows[pc.list_parent_indices(values).to_numpy()], values.flatten()


def _refuse_nulls(part: Any, rows: np.ndarray, name: str, where: str) -> None:
    """Refuse a missing value in `part`, the rows `rows` of `where` (a file, or a split saved apart), naming the column
    and the row of `where` that holds it: never a row counted after the hold-out split."""
    bad = _null_rows(part)
    if len(bad):
        raise ConfigError(
            "dataset.path", f"column {name!r} of {where} holds a missing value (null) in row {int(rows[bad[0]])}",
            f"drop or fill the rows with missing {name} before the run: a null would be read as a number (NaN, or -9223372036854775808 for integers)",
        )


def _is_list(kind: Any) -> bool:
    pa = _require("pyarrow")
    return bool(pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))


def _inner_shape(column: Any, name: str) -> tuple[int, ...]:
    """The dimensions below the rows: one per level of list nesting, each of one length throughout the column."""
    pc = _require("pyarrow.compute")
    shape: list[int] = []
    values = column
    while _is_list(values.type):
        lengths = pc.list_value_length(values)
        low, high = pc.min(lengths).as_py(), pc.max(lengths).as_py()
        if values.null_count or (len(values) and low != high):
            raise ConfigError(
                "dataset.path", f"column {name!r} holds lists of different lengths ({low} to {high}) or missing values",
                f"pad {name} to one length (and give an attention_mask), e.g. tokenizer(..., padding='max_length', max_length={high})",
            )
        shape.append(int(high or 0))
        values = values.flatten()
    return tuple(shape)


def table_arrays(table: Any, where: str, suffix: str = "") -> dict[str, ArrowColumn]:
    """Every column of a pyarrow Table (read from `where`) as an ArrowColumn, named column + suffix (`_train`, `_test` or none)."""
    return {f"{name}{suffix}": ArrowColumn(table.column(name), name, where) for name in table.column_names}


def _file_columns(path: Path, suffix: str = "") -> dict[str, Any]:
    """The columns of a Parquet file (read by row group) or an Arrow/Feather file (memory-mapped), named + suffix."""
    if path.suffix != ".parquet":
        return table_arrays(_read_table(path), path.name, suffix)
    names = _require("pyarrow.parquet").ParquetFile(path).schema_arrow.names
    return {f"{name}{suffix}": ParquetColumn(path, name) for name in names}


def _read_table(path: Path) -> Any:
    """An Arrow/Feather file (the IPC file or stream format) as a memory-mapped pyarrow Table."""
    pa, ipc = _require("pyarrow"), _require("pyarrow.ipc")
    try:
        return ipc.open_file(pa.memory_map(str(path))).read_all()
    except pa.ArrowInvalid:  # an Arrow stream (what datasets writes), not the file format
        return ipc.open_stream(pa.memory_map(str(path))).read_all()


def file_arrays(path: str) -> dict[str, Any]:
    """A Parquet/Arrow file (one set, split by the hold-out), or a directory with train.* and test.* files."""
    root = Path(path).expanduser()
    if root.is_file():
        return _file_columns(root)
    found = {split: [p for p in sorted(root.iterdir()) if p.stem == split and p.suffix in TABLE_SUFFIXES] for split in SPLITS}
    if not all(found.values()):
        raise ConfigError("dataset.path", f"{path!r} has no train and test files ({', '.join(TABLE_SUFFIXES)})", "give one file (split by test_fraction), or a directory with train.parquet and test.parquet")
    return {name: column for split in SPLITS for name, column in _file_columns(found[split][0], f"_{split}").items()}


def hf_disk_arrays(path: str) -> dict[str, ArrowColumn]:
    """A `datasets.Dataset` (split by the hold-out) or `DatasetDict` (its train and test splits, or train alone split
    by the hold-out) saved with save_to_disk."""
    datasets = _require("datasets")
    try:
        loaded = datasets.load_from_disk(str(Path(path).expanduser()))
    except FileNotFoundError as exc:
        raise ConfigError("dataset.path", f"{path!r} is not a dataset saved with save_to_disk ({exc})", "give the directory written by Dataset.save_to_disk or DatasetDict.save_to_disk") from None
    if isinstance(loaded, datasets.DatasetDict):
        if set(SPLITS) <= loaded.keys():
            return {name: column for split in SPLITS for name, column in table_arrays(loaded[split].with_format("arrow")[:], f"the {split} split", f"_{split}").items()}
        if "train" not in loaded:
            raise ConfigError("dataset.path", f"{path!r} holds the splits {sorted(loaded)}", "save a DatasetDict with train (and test) splits, or one Dataset")
        loaded = loaded["train"]
    return table_arrays(loaded.with_format("arrow")[:], "the dataset")
