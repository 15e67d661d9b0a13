"""Rebuild stage outputs from their refs: data arrays, the trained model, the fitted influence model."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
import zarr
from torch import nn

from .. import storage
from ..batches import ArrayBatches, Batches, TensorBatches
from ..methods import InfluenceFunctionModel
from ..models import load_into, load_state
from ..refs import DataRef, ModelRef, StageRef
from ..specs import MethodSpec, ModelSpec


def open_data(data: DataRef, options: dict[str, Any]) -> dict[str, zarr.Array]:
    """The four arrays of a prepared dataset, opened lazily (nothing is read yet)."""
    group = storage.open_group(data.url, options, mode="r")
    return {name: group[name] for name in data.arrays}  # type: ignore[misc]


IN_MEMORY_BYTES = 64 * 2**20  # training sets up to this size are read once; larger ones stream from the store


def train_batches(data: DataRef, options: dict[str, Any], batch_size: int) -> Batches:
    """The training set for curvature passes: held in memory when small, else streamed chunk by chunk.

    Matrix-free methods pass over the data once per iteration, so re-reading a small set from S3 each time
    would dominate their cost.
    """
    arrays = open_data(data, options)
    x, y = arrays["x_train"], arrays["y_train"]
    if x.nbytes + y.nbytes <= IN_MEMORY_BYTES:
        return TensorBatches(torch.from_numpy(np.asarray(x[...])), torch.from_numpy(np.asarray(y[...])), batch_size)
    return ArrayBatches(x, y, batch_size)


def load_model(model: ModelRef, options: dict[str, Any]) -> nn.Module:
    """The trained module: rebuilt from its spec, weights read with weights_only=True."""
    spec = ModelSpec.model_validate(model.spec)
    module = spec.build(model.in_features, model.out_features).to(getattr(torch, spec.dtype))
    return load_into(module, load_state(model.url, options, field="model"), field="model")


def save_tensors(url: str, tensors: dict[str, torch.Tensor], options: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    storage.write_bytes(url, buffer.getvalue(), options)


def load_influence_model(
    method: MethodSpec, model: ModelRef, data: DataRef, curvature: StageRef, options: dict[str, Any]
) -> InfluenceFunctionModel:
    """The influence model with its stored curvature state, bound to the stored training data."""
    im = method.build(load_model(model, options), ModelSpec.model_validate(model.spec).loss)
    state = load_state(curvature.url, options, field="preconditioner")
    return im.load_state_dict(state, train=train_batches(data, options, method.batch_size))
