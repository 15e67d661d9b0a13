"""K-FAC factor blocks: contiguous row ranges covering every row once, as few as FACTOR_ROWS allows, of equal size."""

from __future__ import annotations

import math

import pytest

from influence_core.pipeline.preconditioner import FACTOR_ROWS, factor_blocks


@pytest.mark.parametrize("n", [1, 7, FACTOR_ROWS, FACTOR_ROWS + 1, 5_000, 2 * FACTOR_ROWS + 1, 1_000_000])
def test_factor_blocks_cover_the_rows_in_equal_blocks(n):
    blocks = factor_blocks(n)
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(hi == lo for (_, hi), (lo, _) in zip(blocks, blocks[1:]))  # contiguous, in order
    assert len(blocks) == math.ceil(n / FACTOR_ROWS)
    sizes = [hi - lo for lo, hi in blocks]
    assert max(sizes) <= FACTOR_ROWS and max(sizes) - min(sizes) <= 1
