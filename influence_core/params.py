"""The parameters influence is taken over, and their flat vector layout."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .errors import ConfigError


class ParamSpace:
    """The chosen trainable parameters of a model, flattened in a fixed order.

    Parameters not chosen stay fixed at their values; they are excluded explicitly, never dropped silently.
    """

    def __init__(self, model: nn.Module, names: Iterable[str] | None = None) -> None:
        named = dict(model.named_parameters())
        chosen = list(names) if names is not None else [n for n, p in named.items() if p.requires_grad]
        unknown = [n for n in chosen if n not in named]
        if unknown:
            raise ConfigError("method.modules", f"no parameters named {unknown}", f"pick from {list(named)}")
        if not chosen:
            raise ConfigError("model", "the model has no trainable parameters", "unfreeze at least one parameter")
        self.names = chosen
        self.params = {n: named[n].detach() for n in chosen}
        self.fixed = {n: p.detach() for n, p in named.items() if n not in self.params}
        self.buffers = {n: b.detach() for n, b in model.named_buffers()}
        self.shapes = {n: p.shape for n, p in self.params.items()}
        self.sizes = [p.numel() for p in self.params.values()]
        first = next(iter(self.params.values()))
        self.dtype, self.device = first.dtype, first.device

    @property
    def dim(self) -> int:
        """Number of scalar parameters, p."""
        return sum(self.sizes)

    def blocks(self) -> dict[str, slice]:
        """The slice of the flat vector that holds each parameter tensor."""
        out, start = {}, 0
        for name, size in zip(self.names, self.sizes):
            out[name] = slice(start, start + size)
            start += size
        return out

    def flatten(self, tensors: dict[str, torch.Tensor], batch_dims: int = 0) -> torch.Tensor:
        """Concatenate per-parameter tensors into vectors, keeping `batch_dims` leading dimensions."""
        return torch.cat([tensors[n].reshape(*tensors[n].shape[:batch_dims], -1) for n in self.names], dim=-1)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split vectors of length p (with any leading dimensions) back into parameter-shaped tensors."""
        lead = flat.shape[:-1]
        parts = torch.split(flat, self.sizes, dim=-1)
        return {n: part.reshape(*lead, *self.shapes[n]) for n, part in zip(self.names, parts)}

    def full_state(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every tensor `functional_call` needs: the chosen params given, the fixed ones, and the buffers."""
        return {**self.fixed, **self.buffers, **params}
