"""Uniform, re-iterable access to training data given as tensors, a DataLoader or Zarr arrays."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, Union

import torch

from . import examples
from .examples import Inputs

Batch = tuple[Inputs, torch.Tensor]


class Batches(Protocol):
    """Anything that can be iterated more than once, yielding `(x, y)` batches (x: a tensor or a dict of tensors)."""

    def __iter__(self) -> Iterator[Batch]: ...


Data = Union[tuple[Inputs, torch.Tensor], Iterable[Batch]]


class TensorBatches:
    """Row slices of in-memory tensors."""

    def __init__(self, x: Inputs, y: torch.Tensor, batch_size: int) -> None:
        for name, value in examples.fields(x).items():
            if len(value) != len(y):
                raise ValueError(f"{name} has {len(value)} rows but y has {len(y)}: pass inputs and labels of the same length")
        self.x, self.y, self.batch_size = x, y, max(1, int(batch_size))

    def __iter__(self) -> Iterator[Batch]:
        for start in range(0, len(self.y), self.batch_size):
            yield examples.take(self.x, slice(start, start + self.batch_size)), self.y[start : start + self.batch_size]

    def __len__(self) -> int:
        return len(self.y)


class ArrayBatches:
    """Row slices read lazily from array-likes (Zarr, numpy, Dask) so the data never sit in memory whole."""

    def __init__(self, x: Any, y: Any, batch_size: int, start: int = 0, stop: int | None = None) -> None:
        self.x, self.y, self.batch_size = x, y, max(1, int(batch_size))
        self.start, self.stop = start, y.shape[0] if stop is None else min(stop, y.shape[0])

    def __iter__(self) -> Iterator[Batch]:
        for lo in range(self.start, self.stop, self.batch_size):
            yield self.rows(lo, lo + self.batch_size)

    def __len__(self) -> int:
        return self.stop - self.start

    def rows(self, lo: int, hi: int) -> Batch:
        """Rows lo..hi (clipped to the range) read into tensors: one batch in any order, e.g. shuffled blocks."""
        hi = min(hi, self.stop)
        return examples.read(self.x, slice(lo, hi)), examples.read(self.y, slice(lo, hi))


def as_batches(data: Data, batch_size: int) -> Batches:
    """Wrap an `(x, y)` tuple of tensors in `TensorBatches`; pass re-iterables (DataLoader, ...) through."""
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], torch.Tensor) and all(isinstance(t, torch.Tensor) for t in examples.fields(data[0]).values()):
        return TensorBatches(data[0], data[1], batch_size)
    if iter(data) is data:  # type: ignore[arg-type]
        raise TypeError("training data must be re-iterable (a DataLoader or an (x, y) tuple), not a one-shot iterator")
    return data  # type: ignore[return-value]


def count_rows(data: Batches) -> int:
    """Number of examples, from `len` where the container knows it, else by one pass over the batches."""
    dataset = getattr(data, "dataset", None)
    if dataset is not None and hasattr(dataset, "__len__"):
        return len(dataset)
    if hasattr(data, "__len__") and not hasattr(data, "batch_sampler"):
        return len(data)  # type: ignore[arg-type]
    return sum(len(y) for _, y in data)


class BatchSampler:
    """Random mini-batches for stochastic methods: random rows (without replacement) of in-memory tensors, or all
    of them when the batch is at least as large; a random window of stored arrays (read contiguously); or the next
    batch of any other re-iterable (e.g. a shuffling DataLoader)."""

    def __init__(self, data: Batches, batch_size: int, seed: int) -> None:
        self.data, self.batch_size = data, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._cycle: Iterator[Batch] | None = None

    def __call__(self) -> Batch:
        if isinstance(self.data, TensorBatches):
            if self.batch_size >= len(self.data):  # the whole set: deterministic steps
                return self.data.x, self.data.y
            idx = torch.randperm(len(self.data), generator=self.generator)[: self.batch_size]
            return examples.take(self.data.x, idx), self.data.y[idx]
        if isinstance(self.data, ArrayBatches):
            n = len(self.data)
            size = min(self.batch_size, n)
            lo = self.data.start + int(torch.randint(n - size + 1, (1,), generator=self.generator))
            return self.data.rows(lo, lo + size)
        if self._cycle is None:
            self._cycle = iter(self.data)
        try:
            return next(self._cycle)
        except StopIteration:
            self._cycle = iter(self.data)
            return next(self._cycle)
