"""The batch schedule: which training rows each optimiser step takes, a pure function of (seed, epoch).

One torch generator seeded with `seed` is drawn from in a fixed order: each epoch, a permutation of the blocks of
`block_rows` rows, then for each block in that order a permutation of its rows, cut into batches of `batch_size`
(a block's last batch may be shorter). Epoch e's batches are therefore those drawn after epochs 0..e-1's draws:
`epoch(e)` replays them, and `epochs(n)` yields all n without replaying. Only one block need be in memory at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Block:
    """Rows start..stop of the training set, and each step's batch as indices into them."""

    start: int
    stop: int
    batches: tuple[torch.Tensor, ...]

    def rows(self) -> Iterator[torch.Tensor]:
        """Each step's batch as training row indices."""
        return (self.start + idx for idx in self.batches)


@dataclass(frozen=True)
class BatchSchedule:
    """The seeded batch order of n_rows training rows (see the module's docstring)."""

    seed: int
    n_rows: int
    batch_size: int
    block_rows: int

    @property
    def n_blocks(self) -> int:
        return -(-self.n_rows // self.block_rows)

    def steps_per_epoch(self) -> int:
        """Optimiser steps in one epoch: each block's rows in batches."""
        full, tail = divmod(self.n_rows, self.block_rows)
        return full * -(-self.block_rows // self.batch_size) + -(-tail // self.batch_size)

    def epochs(self, count: int) -> Iterator[list[Block]]:
        """Epochs 0..count-1, each as its blocks in visiting order."""
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(count):
            yield self._draw(generator)

    def epoch(self, index: int) -> list[Block]:
        """Epoch `index` alone (the draws of the epochs before it are replayed, not kept)."""
        return list(self.epochs(index + 1))[-1]

    def steps(self, count: int) -> Iterator[torch.Tensor]:
        """The training row indices of every step of epochs 0..count-1, in order."""
        for blocks in self.epochs(count):
            for block in blocks:
                yield from block.rows()

    def _draw(self, generator: torch.Generator) -> list[Block]:
        blocks = []
        for b in torch.randperm(self.n_blocks, generator=generator).tolist():
            start, stop = b * self.block_rows, min((b + 1) * self.block_rows, self.n_rows)
            order = torch.randperm(stop - start, generator=generator)
            blocks.append(Block(start, stop, tuple(order[lo : lo + self.batch_size] for lo in range(0, stop - start, self.batch_size))))
        return blocks
