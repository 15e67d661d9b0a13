"""Importable dataset factories for the `torch` source in tests (`tests.datasets:<name>`)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def blobs() -> TensorDataset:
    """120 labelled points: a map-style Dataset of (x, y) pairs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(120, 5, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def blobs_split() -> tuple[TensorDataset, TensorDataset]:
    data = blobs()
    return TensorDataset(*data[:100]), TensorDataset(*data[100:])
