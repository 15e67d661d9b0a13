"""Model inputs of a batch: one tensor, or a dict of named tensors with the same rows (`input_ids`, `attention_mask`,
`pixel_values`, ...). Every operation on inputs goes through here, so the rest of the library handles both alike;
the functions also take numpy and Zarr arrays (and dicts of them), which is how stored examples are read."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Union

import numpy as np
import torch
from torch import nn

Inputs = Union[torch.Tensor, dict[str, torch.Tensor]]


def fields(x: Any) -> dict[str, Any]:
    """The named arrays of `x`: a dict as it is, a single array under the name 'x'."""
    return x if isinstance(x, dict) else {"x": x}


def map_inputs(x: Any, fn: Callable[[Any], Any]) -> Any:
    """`fn` applied to each array of `x`, keeping its form (a dict stays a dict with the same names)."""
    return {name: fn(value) for name, value in x.items()} if isinstance(x, dict) else fn(x)


def count(x: Any) -> int:
    """Number of examples (rows) of `x`; every field of a dict has the same."""
    return int(next(iter(fields(x).values())).shape[0])


def take(x: Any, rows: Any) -> Any:
    """Rows of `x`: a slice, an index array or a boolean mask, applied to every field."""
    return map_inputs(x, lambda value: value[rows])


def read(x: Any, rows: Any = slice(None)) -> Inputs:
    """Rows of stored or numpy arrays read into tensors (Zarr, memory maps, Dask: only those rows are read)."""
    return map_inputs(x, lambda value: torch.from_numpy(np.asarray(value[rows])))


def concat(parts: Sequence[Inputs]) -> Inputs:
    """Batches of inputs joined row-wise."""
    if isinstance(parts[0], dict):
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}  # type: ignore[index]
    return torch.cat(list(parts))  # type: ignore[arg-type]


def single(x: Inputs) -> Inputs:
    """One example (as vmap hands it over, without its row dimension) as a batch of one."""
    return map_inputs(x, lambda value: value.unsqueeze(0))


def nbytes(x: Any) -> int:
    """Bytes of all fields of `x`."""
    return sum(int(value.nbytes) for value in fields(x).values())


def call_args(x: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments of the model call: `model(**x)` for a dict (Hugging Face style), else `model(x)`."""
    return ((), dict(x)) if isinstance(x, dict) else ((x,), {})


def call(model: nn.Module, x: Inputs) -> Any:
    """The model's raw output on the inputs `x`."""
    args, kwargs = call_args(x)
    return model(*args, **kwargs)
