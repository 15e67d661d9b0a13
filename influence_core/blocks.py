"""Parameter blocks (the whole model, or one block per layer) and the curvature restricted to one block."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Literal, Union

import torch

from .batches import Batches
from .curvature import CurvatureOperator, embed
from .errors import ConfigError
from .params import ParamSpace
from .work import Work

BlockStructure = Literal["full", "layer_wise"]
Regularization = Union[float, dict[str, float]]


ROOT_BLOCK = "model"  # the block of parameters that belong to the top-level module itself


def layer_blocks(space: ParamSpace) -> dict[str, slice]:
    """One block per module: parameters named `<module>.<param>` share the block `<module>`."""
    blocks: dict[str, slice] = {}
    for name, sl in space.blocks().items():
        module = name.rsplit(".", 1)[0] if "." in name else ROOT_BLOCK
        previous = blocks.get(module)
        blocks[module] = slice(previous.start, sl.stop) if previous else sl
    return blocks


def make_blocks(space: ParamSpace, structure: BlockStructure) -> dict[str, slice]:
    if structure == "full":
        return {"all": slice(0, space.dim)}
    if structure == "layer_wise":
        return layer_blocks(space)
    raise ConfigError("method.block_structure", f"unknown block structure {structure!r}", "use 'full' or 'layer_wise'")


def block_regularization(blocks: dict[str, slice], value: Regularization, positive: bool, method: str) -> dict[str, float]:
    """λ for each block, from one number or a dict keyed by block name (layer_wise only)."""
    if isinstance(value, dict):
        if list(blocks) == ["all"]:
            raise ConfigError("method.regularization", "λ per block needs block_structure='layer_wise'", "give one number, or set method.block_structure=layer_wise")
        missing, unknown = set(blocks) - set(value), set(value) - set(blocks)
        if missing or unknown:
            raise ConfigError("method.regularization", f"blocks are {list(blocks)}; missing {sorted(missing)}, unknown {sorted(unknown)}", "give one λ for each block name")
        lams = {name: float(value[name]) for name in blocks}
    else:
        lams = dict.fromkeys(blocks, float(value))
    for name, lam in lams.items():
        if not math.isfinite(lam) or lam < 0 or (positive and lam == 0):
            bound = "> 0" if positive else "≥ 0"
            raise ConfigError("method.regularization", f"{method} got λ={lam} for block {name!r}", f"use a finite number {bound}, e.g. 1e-3")
    return lams


class BlockCurvature:
    """The curvature restricted to one parameter block: products with block vectors, training gradients, sampling."""

    def __init__(self, operator: CurvatureOperator, block: slice, name: str, partition: tuple[slice, ...] | None = None) -> None:
        """`partition`: the blocks whose explicit matrices are formed together with this one's (all of the method's)."""
        self.operator, self.block, self.name = operator, block, name
        self.partition = partition or (block,)
        self.dim = block.stop - block.start
        self.whole = self.dim == operator.dim

    def _embed(self, vectors: torch.Tensor) -> torch.Tensor:
        return vectors if self.whole else embed(vectors, self.block, self.operator.dim)

    def matmat(self, vectors: torch.Tensor) -> torch.Tensor:
        """Rows of `vectors` (k, p_block) times the block's curvature, in one pass over the data."""
        return self.operator.matmat(self._embed(vectors))[:, self.block]

    def dense(self) -> torch.Tensor:
        """The explicit block matrix, float64 and symmetric, formed in one pass over the data with the other blocks
        of its partition (`CurvatureOperator.dense_blocks`)."""
        return self.operator.dense_block(self.block, self.partition)

    def batch_matmat(self, x: torch.Tensor, y: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
        """The same product with one batch's curvature (for stochastic methods)."""
        return self.operator.batch_product(x, y, self._embed(vectors))[:, self.block]

    def gradient_batches(self) -> Iterator[torch.Tensor]:
        """Per-sample training gradients restricted to this block, batch by batch."""
        for x, y in self.data:
            yield self.operator.objective.per_sample_grads(x, y)[:, self.block]

    @property
    def data(self) -> Batches:
        return self.operator.batches

    @property
    def psd(self) -> bool:
        """Positive semi-definite by construction (Gauss-Newton), so a Nyström sketch applies."""
        return self.operator.mode == "gauss_newton"

    @property
    def work(self) -> Work:
        return self.operator.objective.work

    @property
    def n(self) -> int:
        return self.operator.n

    @property
    def dtype(self) -> torch.dtype:
        return self.operator.objective.space.dtype

    @property
    def device(self) -> torch.device:
        return self.operator.objective.space.device
