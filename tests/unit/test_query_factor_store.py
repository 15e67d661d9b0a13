"""Stored query factors: chunks that divide the solve block and fit FACTOR_CHUNK_BYTES."""

from __future__ import annotations

import numpy as np
import pytest

from influence_core.pipeline.stages.query_factors import FACTOR_CHUNK_BYTES, chunk_rows


@pytest.mark.parametrize(("block", "width", "expected"), [(28, 1_163_274, 2), (500, 94_218, 25), (8, 10, 8), (97, 1_000_000, 1), (5, 10**8, 1)])
def test_chunk_rows_divide_the_block_and_fit_the_budget(block, width, expected):
    rows = chunk_rows(block, 4 * width)
    assert rows == expected and block % rows == 0
    assert rows == 1 or rows * 4 * width <= FACTOR_CHUNK_BYTES
    # the largest such divisor: no bigger divisor of the block fits
    assert not any(block % d == 0 and d * 4 * width <= FACTOR_CHUNK_BYTES for d in range(rows + 1, block + 1))


def test_rows_written_chunk_by_chunk_read_back_exactly_and_every_chunk_is_stored(tmp_path):
    """Blocks of 6 rows into chunks of 3 (the last block shorter and ending mid-chunk); a block of zeros is still
    stored, as the stage's inventory lists every chunk."""
    from influence_core.pipeline.store import storage
    from influence_core.pipeline.stages.query_factors import write_rows

    values = np.random.default_rng(0).standard_normal((14, 5)).astype(np.float32)
    values[6:12] = 0.0
    group = storage.open_group(str(tmp_path / "f.zarr"), {}, mode="w")
    array = group.create_array("factors", shape=values.shape, chunks=(3, 5), dtype="float32", compressors=None, config={"write_empty_chunks": True})
    for lo in range(0, 14, 6):
        write_rows(array, lo, values[lo : lo + 6])
    np.testing.assert_array_equal(array[...], values)
    assert len(storage.object_stats(str(tmp_path / "f.zarr" / "factors"), {})) == 5 + 1  # five chunks and zarr.json
