"""Dataset sources, streamed block by block into row-chunked Zarr arrays with a content fingerprint."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..store import storage
from . import tables
from ... import examples
from .dotted import load_attribute, user_error
from ...errors import ConfigError
from ...task.builtin import IGNORE_INDEX
from . import python_docs
from ..specs import DatasetSpec, DigitsDataset, HeldOutDataset, PathDataset, PythonDocsDataset, SyntheticClassificationDataset, SyntheticDataset

GENERATION_BLOCK = 8192  # generated data depend on this, never on the storage chunking
Block = tuple[Any, np.ndarray]  # the inputs (one array, or a dict of named arrays) and the labels of some rows


@dataclass(frozen=True)
class Split:
    """One split as a stream of (x, y) row blocks, so sources larger than memory never load whole; x is an array, or
    a dict of arrays by field name (named fields: input_ids, attention_mask, ...)."""

    n: int
    blocks: Callable[[], Iterator[Block]]


@dataclass(frozen=True)
class Source:
    train: Split
    test: Split
    n_classes: int | None
    image_shape: tuple[int, ...] | None


def _in_memory_split(x: Any, y: np.ndarray, limit: int | None) -> Split:
    x, y = examples.take(x, slice(None, limit)), y[:limit]
    return Split(len(y), lambda: iter([(x, y)]))


def _features(x: np.ndarray) -> np.ndarray:
    """Integer features (token ids, pixel counts) stay integers, as int64; others are float32."""
    _numeric(x, "dataset.inputs", "features", "store numeric features (encode text as token ids, categories as indices)")
    return x.astype(np.int64) if np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_ else x.astype(np.float32)


def _labels(y: np.ndarray) -> np.ndarray:
    """Integer labels keep an integer dtype; targets stay float32."""
    _numeric(y, "dataset.target", "labels", "store class indices 0..C-1 (map each class name to its index) or numeric targets")
    return y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32)


def _numeric(a: np.ndarray, field: str, what: str, fix: str) -> None:
    """Refuse values that are not numbers (a column of strings), naming the first."""
    if a.dtype.kind not in "biuf":
        first = next((v for v in a.ravel() if not isinstance(v, (int, float, np.number))), a.ravel()[0] if a.size else None)
        raise ConfigError(field, f"the {what} hold {type(first).__name__} values such as {str(first)[:40]!r}, not numbers", fix)


def _digits(spec: DigitsDataset) -> Source:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=spec.test_fraction, random_state=spec.seed, stratify=y)
    return Source(
        _in_memory_split(x_tr, _labels(y_tr), spec.n_train),
        _in_memory_split(x_te, _labels(y_te), spec.n_test),
        n_classes=10,
        image_shape=(8, 8),
    )


def _synthetic(spec: SyntheticDataset) -> Source:
    """Seeded Gaussian inputs with labels from a fixed random teacher, generated in fixed-size blocks."""
    n_classes = spec.n_classes if isinstance(spec, SyntheticClassificationDataset) else None
    d = spec.n_features
    teacher = np.random.default_rng(spec.seed).standard_normal((d, n_classes or 1)) / np.sqrt(d)

    def split(split_id: int, n: int) -> Split:
        def blocks() -> Iterator[Block]:
            for b, lo in enumerate(range(0, n, GENERATION_BLOCK)):
                rng = np.random.default_rng([spec.seed, split_id, b])
                x = rng.standard_normal((min(GENERATION_BLOCK, n - lo), d)).astype(np.float32)
                signal = x @ teacher
                if n_classes:
                    y = np.argmax(3 * signal + spec.noise * rng.gumbel(size=signal.shape), axis=1).astype(np.int64)
                else:
                    y = (signal[:, 0] + spec.noise * rng.standard_normal(len(x))).astype(np.float32)
                yield x, y

        return Split(n, blocks)

    return Source(split(0, spec.n_train or 1000), split(1, spec.n_test or 100 + spec.query_offset), n_classes, None)


def _load_npz(spec: PathDataset) -> dict[str, np.ndarray]:
    assert spec.path is not None
    try:
        with np.load(spec.path) as f:
            return {k: f[k] for k in f.files}
    except (OSError, ValueError) as exc:
        raise ConfigError("dataset.path", f"cannot read {spec.path!r} as .npz ({exc})", "give a file written by numpy.savez") from None


def _load_npy_dir(spec: PathDataset) -> dict[str, np.ndarray]:
    """`x_train.npy`, ... (or `x.npy`, `y.npy`) in a directory, memory-mapped: read block by block."""
    assert spec.path is not None
    return {p.stem: np.load(p, mmap_mode="r") for p in sorted(Path(spec.path).expanduser().glob("*.npy"))}


def _open_zarr(spec: PathDataset, options: dict[str, Any]) -> dict[str, Any]:
    """The arrays of a Zarr group, local or on S3, opened lazily."""
    assert spec.path is not None
    try:
        group = storage.open_group(storage.validate_url(spec.path, "dataset.path"), options, mode="r")
    except FileNotFoundError:
        raise ConfigError("dataset.path", f"no Zarr group at {spec.path!r}", "give the URL of a group holding x_train, y_train, x_test, y_test (or x, y)") from None
    return dict(group.arrays())


def _pick(fields: dict[str, Any], names: list[str], spec: PathDataset) -> dict[str, Any]:
    """The named fields of an example dict, in the order of `names`; a missing one is refused naming dataset.inputs."""
    missing = [name for name in names if name not in fields]
    if missing:
        raise ConfigError("dataset.inputs", f"the examples of {spec.path!r} have no field {missing[0]!r} (they hold {sorted(fields)})", "list only fields the examples hold in dataset.inputs")
    return {name: fields[name] for name in names}


def _torch_batch(batch: Any, spec: PathDataset) -> Block:
    """A collated DataLoader batch as (inputs, labels): from (x, y) pairs (x a tensor or a dict of tensors) or from
    dicts holding the target field and the inputs (`dataset.inputs`, else every other key)."""
    if isinstance(batch, dict):
        if spec.target not in batch:
            raise ConfigError("dataset.target", f"the examples of {spec.path!r} are dicts of {sorted(batch)}, without {spec.target!r}", "set dataset.target to the key of the labels, e.g. labels")
        x, y = _pick(batch, spec.inputs or sorted(set(batch) - {spec.target}), spec), batch[spec.target]
    else:
        x, y = batch
        if isinstance(x, dict) and spec.inputs:
            x = _pick(x, spec.inputs, spec)
    return examples.map_inputs(x, lambda t: _features(np.asarray(t))), _labels(np.asarray(y))


def _torch_source(spec: PathDataset) -> Source:
    """`package.module:factory` returning a torch Dataset of (x, y) pairs or of dicts of fields (split here), or a
    (train, test) pair of them, streamed through a DataLoader in blocks of `chunk_rows`."""
    from torch.utils.data import DataLoader, Subset

    assert spec.path is not None
    make = load_attribute(spec.path, "dataset.path")
    try:
        made = make()
    except Exception as exc:  # the user's code failed: no traceback, and never retried
        raise user_error("dataset.path", spec.path, exc, f"correct {spec.path}; it is called with no arguments and returns a torch Dataset") from None
    if isinstance(made, tuple):
        train_set, test_set = made
    elif len(made) < 2:
        raise ConfigError("dataset.path", f"{spec.path!r} returned a dataset of {len(made)} examples", "return a dataset with training and query examples")
    else:
        held_out = _held_out(len(made), spec)
        train_set, test_set = Subset(made, np.setdiff1d(np.arange(len(made)), held_out).tolist()), Subset(made, held_out.tolist())

    def split(dataset: Any, limit: int | None) -> Split:
        subset = Subset(dataset, range(min(len(dataset), limit or len(dataset))))
        return Split(len(subset), lambda: (_torch_batch(batch, spec) for batch in DataLoader(subset, batch_size=spec.chunk_rows)))

    return Source(split(train_set, spec.n_train), split(test_set, spec.n_test), None, None)


def _held_out(n: int, spec: HeldOutDataset) -> np.ndarray:
    """Sorted, seeded random query rows: n_test of them, or test_fraction of n. They are part of the data's definition:
    another n_test moves rows between the splits and retrains; new queries of the same training rows are asked with
    `influence-pipeline query` (or a file with its own test split)."""
    if spec.query_offset:
        raise ConfigError(
            "dataset.query_offset", f"source={spec.source} holds one set, whose query rows are drawn at random with n_test: skipping some would move rows between the splits",
            "store the data with its own test split (x_test, y_test) to page through its queries, or ask new queries with influence-pipeline query",
        )
    count = min(spec.n_test or max(1, int(spec.test_fraction * n)), n - 1)
    return np.sort(np.random.default_rng(spec.seed).choice(n, count, replace=False))


def _input_names(spec: PathDataset) -> list[str]:
    """The source's names of the input arrays: the spec's named fields, else the one array `x`."""
    return spec.inputs or ["x"]


def _inputs_of(arrays: dict[str, Any], spec: PathDataset, suffix: str) -> Any:
    """The inputs of one split (suffix '_train', '_test' or ''): the array x, or a dict of the named fields' arrays."""
    if spec.inputs:
        return {name: arrays[f"{name}{suffix}"] for name in spec.inputs}
    return arrays[f"x{suffix}"]


def _read_block(x: Any, y: Any, rows: Any, keep: Any = slice(None)) -> Block:
    """Rows of the inputs and labels, read and cast (integer fields stay integers); `keep` selects among them."""
    return examples.map_inputs(x, lambda a: _features(np.asarray(a[rows])[keep])), _labels(np.asarray(y[rows])[keep])


def _range_split(x: Any, y: Any, stop: int, block_rows: int, keep: np.ndarray | None = None) -> Split:
    """Rows [0, stop) of the inputs and labels, streamed in blocks; with `keep`, only rows whose mask is True."""
    count = stop if keep is None else int(keep[:stop].sum())

    def blocks() -> Iterator[Block]:
        for lo in range(0, stop, block_rows):
            hi = min(lo + block_rows, stop)
            yield _read_block(x, y, slice(lo, hi), slice(None) if keep is None else keep[lo:hi])

    return Split(count, blocks)


def _check_pairs(arrays: dict[str, Any], spec: PathDataset) -> None:
    """Each input array has as many rows as its labels, and none is empty: checked on shapes, before any row is read."""
    for suffix in ("_train", "_test", ""):
        y = arrays.get(f"{spec.target}{suffix}")
        for name in _input_names(spec):
            x = arrays.get(f"{name}{suffix}")
            if x is None or y is None:
                continue
            if x.shape[0] != y.shape[0]:
                raise ConfigError("dataset.path", f"{spec.path!r}: {name}{suffix} has {x.shape[0]} rows but {spec.target}{suffix} has {y.shape[0]}", "give every example exactly one label")
            if x.shape[0] == 0:
                raise ConfigError("dataset.path", f"{spec.path!r}: {name}{suffix} has no rows", "give a dataset with examples in it")


def _split_names(spec: PathDataset, suffix: str) -> list[str]:
    """The arrays a split needs: each input's and the target's, with the split's suffix."""
    return [f"{name}{suffix}" for name in [*_input_names(spec), spec.target]]


def _from_arrays(arrays: dict[str, Any], spec: PathDataset) -> Source:
    """A source from named array-likes (memory maps, Zarr, Arrow columns): an explicit train/test split, or one set
    with a seeded random hold-out of queries (read by index) while the training rows stream in blocks, never loaded whole."""
    _check_pairs(arrays, spec)
    if set(_split_names(spec, "_train") + _split_names(spec, "_test")) <= arrays.keys():
        y_train, y_test = arrays[f"{spec.target}_train"], arrays[f"{spec.target}_test"]
        n_tr, n_te = y_train.shape[0], y_test.shape[0]
        train = _range_split(_inputs_of(arrays, spec, "_train"), y_train, min(n_tr, spec.n_train or n_tr), spec.chunk_rows)
        test = _range_split(_inputs_of(arrays, spec, "_test"), y_test, min(n_te, spec.n_test or n_te), spec.chunk_rows)
    elif set(_split_names(spec, "")) <= arrays.keys():
        x, y = _inputs_of(arrays, spec, ""), arrays[spec.target]
        n = y.shape[0]
        held_out = _held_out(n, spec)
        keep = np.ones(n, dtype=bool)
        keep[held_out] = False
        stop = int(np.searchsorted(np.cumsum(keep), spec.n_train) + 1) if spec.n_train and spec.n_train < keep.sum() else n
        train = _range_split(x, y, stop, spec.chunk_rows, keep)
        test = Split(len(held_out), lambda: iter([_read_block(x, y, held_out)]))
    else:
        raise _missing_arrays(arrays, spec)
    return Source(train, test, None, None)


def _missing_arrays(arrays: dict[str, Any], spec: PathDataset) -> ConfigError:
    """The refusal of a source without the arrays the spec names: the target's name when its labels are what is
    missing (a language model's labels are its input_ids: dataset.target), else the arrays to provide."""
    if not any(name.removesuffix(suffix) == spec.target for name in arrays for suffix in ("_train", "_test", "")):
        inputs = [name for name in spec.inputs or [] if name != spec.target]
        example = f" (a language model's labels are its inputs: dataset.target: {inputs[0]})" if inputs else ""
        return ConfigError("dataset.target", f"{spec.path!r} holds {sorted(arrays)}, without the labels {spec.target!r}", f"set dataset.target to the field of the labels{example}")
    wanted = ", ".join(_split_names(spec, "_train") + _split_names(spec, "_test"))
    return ConfigError("dataset.path", f"{spec.path!r} holds {sorted(arrays)}", f"provide {wanted} (or {', '.join(_split_names(spec, ''))})")


def _npz(spec: PathDataset, options: dict[str, Any]) -> Source:
    arrays = _load_npz(spec)
    _check_pairs(arrays, spec)
    names = [*_input_names(spec), spec.target]
    if set(names) <= arrays.keys() and f"{spec.target}_train" not in arrays:  # small enough to be in memory: stratify-free random split
        from sklearn.model_selection import train_test_split

        parts = train_test_split(*(arrays[name] for name in names), test_size=spec.test_fraction, random_state=spec.seed)
        arrays = {f"{name}{suffix}": parts[2 * i + j] for i, name in enumerate(names) for j, suffix in enumerate(("_train", "_test"))}
    return _from_arrays(arrays, spec)


BYTE_CLASSES = 256  # python_docs' labels are byte ids: stated, not counted, so the queries asked never change the training side's key


def _python_docs(spec: PythonDocsDataset) -> Source:
    """Language modelling on byte windows of the standard library's docstrings: seeded shuffled windows for training,
    then the 'prompt|completion' queries (or held-out windows); labels are the inputs' own ids. Without queries the
    last fifth of the shuffled windows is held out and the queries are its first n_test, so the training rows are
    the same for every n_test (and the training side's stages are reused when only the queries change)."""
    if spec.queries and spec.query_offset:
        raise ConfigError("dataset.query_offset", "the queries are the texts listed in dataset.queries", "list the texts to ask, and leave dataset.query_offset at 0")
    rows = python_docs.windows(python_docs.corpus(), spec.window)
    rows = rows[np.random.default_rng(spec.seed).permutation(len(rows))]
    held_out = 0 if spec.queries else len(rows) // 5
    pool_rows = len(rows) - held_out  # the training windows come first, whatever the queries: every offset reads the same order
    if spec.train_offset >= pool_rows:
        raise ConfigError("dataset.train_offset", f"train_offset={spec.train_offset} skips all {pool_rows} training windows of window={spec.window}", f"set dataset.train_offset below {pool_rows}")
    train = rows[spec.train_offset : pool_rows][: spec.n_train]
    pool = rows[len(rows) - held_out :][: spec.n_test or 20 + spec.query_offset]
    x_test, y_test = python_docs.query_rows(spec.queries, spec.window) if spec.queries else (pool, pool)
    return Source(_in_memory_split(train, train, None), _in_memory_split(x_test, y_test, None), BYTE_CLASSES, None)


SOURCES: dict[str, Callable[[Any, dict[str, Any]], Source]] = {
    "digits": lambda spec, options: _digits(spec),
    "synthetic_classification": lambda spec, options: _synthetic(spec),
    "synthetic_regression": lambda spec, options: _synthetic(spec),
    "npz": _npz,
    "npy": lambda spec, options: _from_arrays(_load_npy_dir(spec), spec),
    "zarr": lambda spec, options: _from_arrays(_open_zarr(spec, options), spec),
    "torch": lambda spec, options: _torch_source(spec),
    "hf_disk": lambda spec, options: _from_arrays(tables.hf_disk_arrays(spec.path), spec),
    "parquet": lambda spec, options: _from_arrays(tables.file_arrays(spec.path), spec),
    "python_docs": lambda spec, options: _python_docs(spec),
}


def _unmasked_labels(split: Split) -> Split:
    """Labels taken from the inputs (language modelling's token ids) with IGNORE_INDEX where attention_mask is 0, so
    padding is never scored."""

    def blocks() -> Iterator[Block]:
        for x, y in split.blocks():
            yield x, np.where(x["attention_mask"] == 0, IGNORE_INDEX, y)

    return Split(split.n, blocks)


def open_source(spec: DatasetSpec, options: dict[str, Any]) -> Source:
    """The dataset described by `spec`, as streams of row blocks; `options` reach S3 for Zarr sources."""
    offset = spec.query_offset
    source = SOURCES[spec.source](spec.model_copy(update={"n_test": spec.n_test + offset}) if offset and spec.n_test else spec, options)
    if spec.n_train and source.train.n < spec.n_train:  # "at most n_train" silently giving fewer rows would go unseen
        raise ConfigError("dataset.n_train", f"n_train={spec.n_train} asks for more training examples than the {source.train.n} that source={spec.source} has", f"set dataset.n_train to at most {source.train.n}, or leave it empty for all")
    if offset:
        source = replace(source, test=_after(source.test, offset, spec))
    if isinstance(spec, PathDataset) and spec.target in (spec.inputs or []) and "attention_mask" in (spec.inputs or []):
        return Source(_unmasked_labels(source.train), _unmasked_labels(source.test), source.n_classes, source.image_shape)
    return source


def fewer_queries(spec: DatasetSpec, n_test: int) -> str | None:
    """What to tell the user when the source held fewer query examples than dataset.n_test asked for: "at most
    n_test" keeps what there is (a rerun's query_offset may reach the split's end), but says so; None when it held them all."""
    if spec.n_test is None or n_test >= spec.n_test:
        return None
    after = f" after query_offset={spec.query_offset}" if spec.query_offset else ""
    return f"dataset.n_test: asked for {spec.n_test} query examples, but source={spec.source} holds {n_test}{after}: scoring those {n_test}"


def _after(split: Split, offset: int, spec: DatasetSpec) -> Split:
    """The query split without its first `offset` rows; refused when nothing would be left, naming what there is."""
    if split.n <= offset:
        raise ConfigError("dataset.query_offset", f"query_offset={offset} skips all {split.n} query examples that source={spec.source} holds here", f"set dataset.query_offset below {split.n}")

    def blocks() -> Iterator[Block]:
        seen = 0
        for x, y in split.blocks():
            start, seen = max(0, offset - seen), seen + len(y)
            if start < len(y):
                yield (x, y) if start == 0 else (examples.take(x, slice(start, None)), y[start:])

    return Split(split.n - offset, blocks)


def _stored_names(x: Any, split: str) -> dict[str, Any]:
    """A block's inputs by stored array name: x_{split} for one array, x_{split}/{field} for named fields."""
    return {f"x_{split}/{name}": value for name, value in x.items()} if isinstance(x, dict) else {f"x_{split}": x}


def _shown(stored: str) -> str:
    """An array's name as the source names it: x_train, or the field and split of a named field (input_ids_train)."""
    kind, _, field = stored.partition("/")
    return f"{field}_{kind.split('_')[1]}" if field else kind


def check_block(x: Any, y: np.ndarray, split: str, first_row: int) -> None:
    """Refuse rows that would poison every score: non-finite values in any float field or target, negative class
    labels, an attention_mask that is not 0/1."""
    for name, values in ((_shown(n), v) for n, v in {**_stored_names(x, split), f"y_{split}": y}.items()):
        if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
            row = first_row + int(np.argwhere(~np.isfinite(values.reshape(len(values), -1)))[0, 0])
            raise ConfigError("dataset.path", f"{name} holds NaN or inf (first at row {row})", "drop or impute those rows before the run: one non-finite value spoils every score")
    mask = x.get("attention_mask") if isinstance(x, dict) else None
    if mask is not None and not np.isin(mask, (0, 1)).all():
        row = first_row + int(np.argwhere(~np.isin(mask, (0, 1)).reshape(len(mask), -1))[0, 0])
        raise ConfigError("dataset.inputs", f"attention_mask_{split} holds values other than 0 and 1 (first at row {row})", "store 1 for tokens attended to and 0 for padding")
    negative = (y < 0) & (y != IGNORE_INDEX) if np.issubdtype(y.dtype, np.integer) else np.zeros(0, dtype=bool)  # IGNORE_INDEX: a label not scored
    if negative.any():
        row = first_row + int(np.argwhere(negative.reshape(len(y), -1))[0, 0])
        raise ConfigError(
            "dataset.path", f"y_{split} holds the negative label {int(y[negative].min())} (first at row {row}); integer labels are class indices", f"number the classes 0..C-1 ({IGNORE_INDEX} marks a label not scored), or store regression targets as floats"
        )


def _first_block(split: Split, name: str) -> Block:
    """The split's first block, from which the arrays take their shapes and dtypes; an empty split is refused."""
    if split.n == 0:
        raise ConfigError("dataset", f"the {name} split is empty", "use more data or a different test_fraction")
    return next(split.blocks())


def _check_shapes(train: Any, test: Any) -> None:
    """Every input of the queries has the training examples' shape (per field), and both have the same fields."""
    if isinstance(train, dict) != isinstance(test, dict) or examples.fields(train).keys() != examples.fields(test).keys():
        raise ConfigError("dataset.path", f"query inputs have fields {sorted(examples.fields(test))} but training inputs {sorted(examples.fields(train))}", "give both splits the same fields")
    for name, value in examples.fields(train).items():
        other = examples.fields(test)[name]
        if other.shape[1:] != value.shape[1:]:
            what, fix = ("features", "give x_test the same features as x_train") if name == "x" and not isinstance(train, dict) else (f"{name}", f"pad or cut {name} to the same length in both splits")
            raise ConfigError("dataset.path", f"query {what} have shape {other.shape[1:]} but training {what} {value.shape[1:]}", fix)


def _write_splits(group: Any, url: str, source: Source, firsts: dict[str, Block], chunk_rows: int) -> tuple[dict[str, dict[str, Any]], int]:
    """Stream both splits into `group`, checking every block; the arrays' refs (each with its content hash) by
    stored name, and the largest integer training label (-1 without): the classes are the training rows', so new
    queries never change the training side's key (a query label beyond them is refused by check_query_labels)."""
    arrays: dict[str, dict[str, Any]] = {}
    top_label = -1  # integer training labels: the classes are counted while streaming
    for split_name, split in (("train", source.train), ("test", source.test)):
        first_x, first_y = firsts[split_name]
        made = {
            name: storage.create_array(group, name, shape=(split.n, *sample.shape[1:]), chunks=(min(chunk_rows, split.n), *sample.shape[1:]), dtype=sample.dtype)
            for name, sample in {**_stored_names(first_x, split_name), f"y_{split_name}": first_y}.items()
        }
        digests = {name: hashlib.sha256(f"{arr.shape}{arr.dtype}".encode()) for name, arr in made.items()}
        row = 0
        for x, y in split.blocks():
            check_block(x, y, split_name, row)
            for name, block in {**_stored_names(x, split_name), f"y_{split_name}": y}.items():
                made[name][row : row + len(block)] = block
                digests[name].update(np.ascontiguousarray(block).tobytes())
            row += len(y)
            if split_name == "train" and np.issubdtype(y.dtype, np.integer) and len(y):
                top_label = max(top_label, int(y.max()))
        for name, arr in made.items():
            fingerprint = digests[name].hexdigest()[:24]
            arr.attrs["fingerprint"] = fingerprint
            arrays[name] = {"url": storage.join(url, name), "fingerprint": fingerprint, "shape": arr.shape, "dtype": str(arr.dtype)}
    return arrays, top_label


def write_dataset(source: Source, url: str, options: dict[str, Any], chunk_rows: int) -> dict[str, Any]:
    """Stream both splits into a Zarr group, one row-chunked array per input field and split; return the DataRef
    fields, with a content hash of each array built chunk by chunk and a data hash over all of them. Data refused
    by a check leave nothing behind."""
    firsts = {name: _first_block(split, name) for name, split in (("train", source.train), ("test", source.test))}
    _check_shapes(firsts["train"][0], firsts["test"][0])
    group = storage.open_group(url, options, mode="w")
    try:
        arrays, top_label = _write_splits(group, url, source, firsts, chunk_rows)
    except ConfigError:
        storage.remove(url, options)
        raise
    fingerprint = hashlib.sha256("".join(ref["fingerprint"] for ref in arrays.values()).encode()).hexdigest()[:24]
    n_classes = source.n_classes or (top_label + 1 if top_label >= 0 else None)
    group.attrs.update({"fingerprint": fingerprint, "n_classes": n_classes, "image_shape": source.image_shape})
    x_train = next(iter(arrays.values()))
    return {
        "url": url,
        "fingerprint": fingerprint,
        "shape": x_train["shape"],
        "dtype": x_train["dtype"],
        "arrays": arrays,
        "n_classes": n_classes,
        "image_shape": source.image_shape,
    }
