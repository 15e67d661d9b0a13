"""Dataset sources, streamed block by block into row-chunked Zarr arrays with a content fingerprint."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import storage
from .errors import ConfigError
from .specs import DatasetSource, DatasetSpec

GENERATION_BLOCK = 8192  # generated data depend on this, never on the storage chunking
Block = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Split:
    """One split as a stream of (x, y) row blocks, so sources larger than memory never load whole."""

    n: int
    blocks: Callable[[], Iterator[Block]]


@dataclass(frozen=True)
class Source:
    train: Split
    test: Split
    n_classes: int | None
    image_shape: tuple[int, ...] | None


def _in_memory_split(x: np.ndarray, y: np.ndarray, limit: int | None) -> Split:
    x, y = x[:limit], y[:limit]
    return Split(len(y), lambda: iter([(x, y)]))


def _labels(y: np.ndarray) -> np.ndarray:
    """Integer labels keep an integer dtype; targets stay float32."""
    return y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32)


def _digits(spec: DatasetSpec) -> Source:
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


def _synthetic(spec: DatasetSpec) -> Source:
    """Seeded Gaussian inputs with labels from a fixed random teacher, generated in fixed-size blocks."""
    classify = spec.source == DatasetSource.synthetic_classification.value
    d = spec.n_features
    teacher = np.random.default_rng(spec.seed).standard_normal((d, spec.n_classes if classify else 1)) / np.sqrt(d)

    def split(split_id: int, n: int) -> Split:
        def blocks() -> Iterator[Block]:
            for b, lo in enumerate(range(0, n, GENERATION_BLOCK)):
                rng = np.random.default_rng([spec.seed, split_id, b])
                x = rng.standard_normal((min(GENERATION_BLOCK, n - lo), d)).astype(np.float32)
                signal = x @ teacher
                if classify:
                    y = np.argmax(3 * signal + spec.noise * rng.gumbel(size=signal.shape), axis=1).astype(np.int64)
                else:
                    y = (signal[:, 0] + spec.noise * rng.standard_normal(len(x))).astype(np.float32)
                yield x, y

        return Split(n, blocks)

    return Source(split(0, spec.n_train or 1000), split(1, spec.n_test or 100), spec.n_classes if classify else None, None)


def _npz(spec: DatasetSpec) -> Source:
    assert spec.path is not None
    try:
        with np.load(spec.path) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as exc:
        raise ConfigError("dataset.path", f"cannot read {spec.path!r} as .npz ({exc})", "give a file written by numpy.savez") from None
    if {"x_train", "y_train", "x_test", "y_test"} <= arrays.keys():
        x_tr, y_tr, x_te, y_te = (arrays[k] for k in ("x_train", "y_train", "x_test", "y_test"))
    elif {"x", "y"} <= arrays.keys():
        from sklearn.model_selection import train_test_split

        x_tr, x_te, y_tr, y_te = train_test_split(arrays["x"], arrays["y"], test_size=spec.test_fraction, random_state=spec.seed)
    else:
        raise ConfigError("dataset.path", f"{spec.path!r} holds {sorted(arrays)}", "store x_train, y_train, x_test, y_test (or x, y) in it")
    y_all = np.concatenate([y_tr, y_te])
    n_classes = int(y_all.max()) + 1 if np.issubdtype(y_all.dtype, np.integer) else None
    return Source(
        _in_memory_split(x_tr.astype(np.float32), _labels(y_tr), spec.n_train),
        _in_memory_split(x_te.astype(np.float32), _labels(y_te), spec.n_test),
        n_classes,
        None,
    )


SOURCES: dict[str, Callable[[DatasetSpec], Source]] = {
    DatasetSource.digits.value: _digits,
    DatasetSource.synthetic_classification.value: _synthetic,
    DatasetSource.synthetic_regression.value: _synthetic,
    DatasetSource.npz.value: _npz,
}


def open_source(spec: DatasetSpec) -> Source:
    """The dataset described by `spec`, as streams of row blocks."""
    return SOURCES[spec.source](spec)


def write_dataset(source: Source, url: str, options: dict[str, Any], chunk_rows: int) -> dict[str, Any]:
    """Stream both splits into a Zarr group; return the DataRef fields, with a content hash built chunk by chunk."""
    group = storage.open_group(url, options, mode="w")
    total = hashlib.sha256()
    arrays: dict[str, dict[str, Any]] = {}
    for split_name, split in (("train", source.train), ("test", source.test)):
        if split.n == 0:
            raise ConfigError("dataset", f"the {split_name} split is empty", "use more data or a different test_fraction")
        first_x, first_y = next(split.blocks())
        made = {
            kind: group.create_array(
                f"{kind}_{split_name}",
                shape=(split.n, *sample.shape[1:]),
                chunks=(min(chunk_rows, split.n), *sample.shape[1:]),
                dtype=sample.dtype,
            )
            for kind, sample in (("x", first_x), ("y", first_y))
        }
        digests = {kind: hashlib.sha256(f"{arr.shape}{arr.dtype}".encode()) for kind, arr in made.items()}
        row = 0
        for x, y in split.blocks():
            for kind, block in (("x", x), ("y", y)):
                made[kind][row : row + len(block)] = block
                digests[kind].update(np.ascontiguousarray(block).tobytes())
            row += len(y)
        for kind, arr in made.items():
            fingerprint = digests[kind].hexdigest()[:24]
            arr.attrs["fingerprint"] = fingerprint
            total.update(fingerprint.encode())
            arrays[arr.basename] = {"url": storage.join(url, arr.basename), "fingerprint": fingerprint, "shape": arr.shape, "dtype": str(arr.dtype)}
    fingerprint = total.hexdigest()[:24]
    group.attrs.update({"fingerprint": fingerprint, "n_classes": source.n_classes, "image_shape": source.image_shape})
    x_train = arrays["x_train"]
    return {
        "url": url,
        "fingerprint": fingerprint,
        "shape": x_train["shape"],
        "dtype": x_train["dtype"],
        "arrays": arrays,
        "n_classes": source.n_classes,
        "image_shape": source.image_shape,
    }
