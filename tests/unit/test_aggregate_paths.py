"""aggregate's reductions (top-k both ways, argmax, totals, NaN count) from scores reduced in memory as one block and
streamed over their shards, both against numpy on the whole matrix."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from influence_core.pipeline.score.layout import score_layout
from influence_core.pipeline.specs import AggregateSpec
from influence_core.pipeline.stages import aggregation


@pytest.mark.parametrize("in_memory_bytes", [aggregation.IN_MEMORY_BYTES, 0])
def test_both_paths_equal_numpy_on_the_whole_matrix(tmp_path, monkeypatch, in_memory_bytes):
    """30 x 2,000 continuous scores in the flow's shards (several along the columns): the top 4 each way, their
    scores, and the float64 column totals as numpy finds them."""
    monkeypatch.setattr(aggregation, "IN_MEMORY_BYTES", in_memory_bytes)
    layout = score_layout(30, 2000, 64.0)
    group = zarr.open_group(str(tmp_path / "out.zarr"), mode="w")
    scores = group.create_array("scores", shape=(30, 2000), chunks=layout.chunk, shards=layout.shard, dtype="float32")
    values = np.random.default_rng(0).standard_normal((30, 2000)).astype(np.float32)
    scores[...] = values
    assert 2000 // layout.shard[1] > 1
    result, totals = aggregation._from_scores(AggregateSpec(top_k=4), group, scores)
    helpful, harmful = np.argsort(-values, axis=1)[:, :4], np.argsort(values, axis=1)[:, :4]
    assert np.array_equal(result.helpful_indices, helpful) and np.array_equal(result.harmful_indices, harmful)
    assert np.array_equal(result.helpful_scores, np.take_along_axis(values, helpful, 1))
    assert np.array_equal(result.harmful_scores, np.take_along_axis(values, harmful, 1))
    np.testing.assert_allclose(totals[...], values.astype(np.float64).sum(0), rtol=1e-6)
    assert result.missing == 0
