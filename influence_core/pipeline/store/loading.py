"""Rebuild stage outputs from their refs: data arrays, the trained model, the fitted influence model."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
import zarr
from torch import nn

from . import integrity, storage
from ... import examples
from ...batches import ArrayBatches, Batches, TensorBatches
from ...errors import ConfigError
from ...contraction import Rows, stream_rows
from ...index_projection import IndexProjection
from ...methods import InfluenceFunctionModel, KfacInfluence
from ..model.models import build_model, load_into, load_stored, save_stored
from .refs import DataRef, ModelRef, StageRef
from ..specs import LoraSpec, MethodSpec, ModelSpec


def open_data(data: DataRef, options: dict[str, Any]) -> dict[str, Any]:
    """x_train, y_train, x_test, y_test of a prepared dataset, opened lazily (nothing is read yet); the inputs of
    named fields (stored as x_train/input_ids, ...) come as a dict of arrays by field name."""
    group = storage.open_group(data.url, options, mode="r")
    arrays: dict[str, Any] = {}
    for name in data.arrays:
        split, _, field = name.partition("/")
        if field:
            arrays.setdefault(split, {})[field] = group[name]
        else:
            arrays[name] = group[name]
    return arrays


IN_MEMORY_BYTES = 64 * 2**20  # training sets up to this size are read once; larger ones stream from the store


def training_rows(data: DataRef, options: dict[str, Any]) -> tuple[Any, Any]:
    """x_train and y_train to read rows from (`examples.read`): tensors read once when the training set is at most
    IN_MEMORY_BYTES (a task's reads are then views, not a store request each), else the stored arrays."""
    arrays = open_data(data, options)
    x, y = arrays["x_train"], arrays["y_train"]
    if examples.nbytes(x) + y.nbytes <= IN_MEMORY_BYTES:
        return examples.read(x), examples.read(y)
    return x, y


def train_batches(data: DataRef, options: dict[str, Any], batch_size: int) -> Batches:
    """The training set for curvature passes: held in memory when small, else streamed chunk by chunk.

    Matrix-free methods pass over the data once per iteration, so re-reading a small set from S3 each time
    would dominate their cost.
    """
    return batches_of(*training_rows(data, options), batch_size)


def batches_of(x: Any, y: Any, batch_size: int) -> Batches:
    """Batches of `training_rows`: of the tensors held, or read from the stored arrays batch by batch."""
    return TensorBatches(x, y, batch_size) if isinstance(y, torch.Tensor) else ArrayBatches(x, y, batch_size)


def build_module(model: ModelRef, device: str = "cpu") -> nn.Module:
    """The model's module on `device`, rebuilt from its spec (with its LoRA adapters), without its trained weights:
    its stored state_dict holds every weight, so neither the seed nor training.init is needed to load it."""
    return build_model(ModelSpec.model_validate(model.spec), model, device, None if model.lora is None else LoraSpec.model_validate(model.lora))


def load_model(model: ModelRef, options: dict[str, Any], device: str = "cpu") -> nn.Module:
    """The trained module on `device`: rebuilt from its spec, weights read with weights_only=True."""
    return load_into(build_module(model, device), load_stored(model.url, options, field="fit_model", device=device), field="model")


def save_tensors(url: str, tensors: dict[str, Any], options: dict[str, Any]) -> None:
    """Tensors (and plain values) as one torch.save file with its sha256 (read back by `load_stored`); a tensor that views a larger storage is saved as a copy of
    its own numbers, since torch.save writes a view's whole storage (W3's whitening factors, rank-47 rows of a
    1024 x 1025 SVD: 17.8 MB saved for 1.6)."""
    def own(t: Any) -> Any:
        return t.clone() if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.nbytes else t

    buffer = io.BytesIO()
    torch.save({name: own(t) for name, t in tensors.items()}, buffer)
    save_stored(url, buffer.getvalue(), options)


def first_training_row(data: DataRef, options: dict[str, Any], device: str = "cpu") -> Any:
    """The first training example's inputs, one row: what a stage runs one forward over to estimate its work."""
    return examples.map_inputs(examples.read(open_data(data, options)["x_train"], slice(0, 1)), lambda t: t.to(device))


def load_influence_model(
    method: MethodSpec, model: ModelRef, data: DataRef, preconditioner: StageRef, options: dict[str, Any], device: str = "cpu", train: Batches | None = None
) -> InfluenceFunctionModel:
    """The influence model on `device` with its stored curvature state, bound to the stored training data (`train`:
    those batches already open, shared by an ensemble's members)."""
    im = method.build(load_model(model, options, device), ModelSpec.model_validate(model.spec).make_task())
    state = load_stored(preconditioner.url, options, field="fit_preconditioner", device=device)
    return im.load_state_dict(state, train=train if train is not None else train_batches(data, options, method.batch_size))


def read_factors(im: InfluenceFunctionModel, url: str, options: dict[str, Any], x_train: Any, y_train: zarr.Array) -> torch.Tensor | Rows:
    """The stored query factors as a scorer takes them: for methods that contract, per-layer rows filled one stored
    chunk at a time (a worker holds the factors once, never also as a flat copy); else the flat matrix."""
    array = storage.open_array(url, options)
    device = im.objective.space.device
    if not im.contracts():
        return torch.from_numpy(np.asarray(array[:])).to(device)
    split = im.gradient_split(examples.read(x_train, slice(0, 8)), examples.read(y_train, slice(0, 8)))
    step = array.chunks[0]
    blocks = ((lo, torch.from_numpy(np.asarray(array[lo : lo + step])).to(device)) for lo in range(0, array.shape[0], step))
    return stream_rows(blocks, array.shape[0], split, im.row_order, im.query_rank)


def index_projection(im: InfluenceFunctionModel, data: DataRef, options: dict[str, Any], side: int, whitening_url: str | None = None) -> IndexProjection:
    """A compressed training index's projection for this influence model (its gradient split probed on the first
    training rows): the same on the index's side and the queries'; with `whitening_url`, the whitening factors its
    index keeps (`keep_whitening`; an index written before they were kept: computed again)."""
    arrays = open_data(data, options)
    x, y = examples.read(arrays["x_train"], slice(0, 8)), examples.read(arrays["y_train"], slice(0, 8))
    kept = None
    if whitening_url is not None and isinstance(im, KfacInfluence) and storage.exists(whitening_url, options):
        state = _whitening_state(whitening_url, options)
        kept = {layer.name: (state[f"{layer.name}/left"], state[f"{layer.name}/right"]) for layer in im.layers}
    return IndexProjection.for_model(im, x, y, side, whitening=kept)


def intact_file(url: str, options: dict[str, Any]) -> bool:
    """Whether a file the pipeline wrote is there and reads back as written (its bytes match their sha256)."""
    try:
        integrity.read_checked(url, options, "", "")
    except (FileNotFoundError, integrity.DamagedError):
        return False
    return True


def keep_whitening(projection: IndexProjection, url: str, options: dict[str, Any]) -> bool:
    """Store a whitened projection's factors (every damped cut's truncated SVD) at `url`, unless factors that load are
    there already (a resumed index's): the index's workers and every later query load them instead of factoring
    D^(-1/2) again. Whether they were written now."""
    if not projection.damped or intact_file(url, options):
        return False
    save_tensors(url, {f"{name}/{side}": factor for name, pair in projection.all_whitening().items() for side, factor in zip(("left", "right"), pair)}, options)
    return True


def _whitening_state(url: str, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The factors an index keeps; refused in one line, saying how to rebuild the index, when they do not load (a
    file overwritten at its size, which the stage's inventory cannot tell)."""
    try:
        return load_stored(url, options, field="index_training")
    except FileNotFoundError:
        raise ConfigError("index_training", f"the training index's whitening factors at {url} are missing", "run the pipeline again with the same parameters: the index is rebuilt") from None
