"""Randomness tied to example indices, so sampled quantities do not depend on how the data are batched or chunked."""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 1024  # random numbers are drawn for fixed blocks of example indices


class ExampleNoise:
    """Uniform and normal draws for examples [lo, hi): the same for an example whatever batch it arrives in.

    `stream` separates independent draws from one seed (e.g. one stream per pass over the data)."""

    def __init__(self, seed: int, stream: int = 0) -> None:
        self.seed, self.stream = seed, stream

    def _draw(self, lo: int, hi: int, width: int, kind: str) -> np.ndarray:
        parts = []
        for block in range(lo // BLOCK, (hi - 1) // BLOCK + 1):
            rng = np.random.default_rng([self.seed, block, width, kind == "normal", self.stream])
            values = rng.standard_normal((BLOCK, width)) if kind == "normal" else rng.random((BLOCK, width))
            start = max(lo, block * BLOCK) - block * BLOCK
            stop = min(hi, (block + 1) * BLOCK) - block * BLOCK
            parts.append(values[start:stop])
        return np.concatenate(parts)

    def uniform(self, lo: int, hi: int, like: torch.Tensor, samples: int = 1) -> torch.Tensor:
        """(hi - lo, samples) uniform draws in [0, 1)."""
        return torch.from_numpy(self._draw(lo, hi, samples, "uniform")).to(dtype=like.dtype, device=like.device)

    def normal(self, lo: int, hi: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        width = int(np.prod(shape[1:]))
        return torch.from_numpy(self._draw(lo, hi, width, "normal")).reshape(shape).to(dtype=like.dtype, device=like.device)
