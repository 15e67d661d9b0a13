"""Stored query factors: chunks that divide the solve block and fit FACTOR_CHUNK_BYTES."""

from __future__ import annotations

import pytest

from influence_core.pipeline.factors import FACTOR_CHUNK_BYTES, chunk_rows


@pytest.mark.parametrize(("block", "width", "expected"), [(28, 1_163_274, 2), (500, 94_218, 25), (8, 10, 8), (97, 1_000_000, 1), (5, 10**8, 1)])
def test_chunk_rows_divide_the_block_and_fit_the_budget(block, width, expected):
    rows = chunk_rows(block, 4 * width)
    assert rows == expected and block % rows == 0
    assert rows == 1 or rows * 4 * width <= FACTOR_CHUNK_BYTES
    # the largest such divisor: no bigger divisor of the block fits
    assert not any(block % d == 0 and d * 4 * width <= FACTOR_CHUNK_BYTES for d in range(rows + 1, block + 1))
