"""aggregate's reductions (top-k both ways, argmax, totals, NaN count), streamed over the scores' column shards, against
numpy on the whole matrix, ties included: they go to the lower index, as `influence-pipeline query`'s scan breaks
them, whatever the shard layout."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from influence_core.pipeline.score.layout import score_layout
from influence_core.pipeline.score import score_reductions
from influence_core.pipeline.score.score_reductions import aggregate_candidates
from influence_core.pipeline.specs import AggregateSpec
from influence_core.pipeline.stages import aggregation


def _stable_top(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k largest and k smallest, ties to the lower index (a stable sort of the whole row)."""
    return np.argsort(-values, axis=1, kind="stable")[:, :k], np.argsort(values, axis=1, kind="stable")[:, :k]


@pytest.mark.parametrize("read_bytes", [score_reductions.READ_BYTES, 0])
@pytest.mark.parametrize("levels", [None, 3])
def test_streamed_reductions_equal_numpy_on_the_whole_matrix(tmp_path, monkeypatch, levels, read_bytes):
    """30 x 2,000 scores in the flow's shards (several along the columns), read as one block (READ_BYTES) or a shard
    at a time (0): continuous (levels None), or of 3 values, so every row's top 4 ties across shards. The top 4 each
    way, their scores, and the float64 column totals."""
    monkeypatch.setattr(score_reductions, "READ_BYTES", read_bytes)
    layout = score_layout(30, 2000, 0.05)
    group = zarr.open_group(str(tmp_path / "out.zarr"), mode="w")
    scores = group.create_array("scores", shape=(30, 2000), chunks=layout.chunk, shards=layout.shard, dtype="float32")
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((30, 2000)) if levels is None else rng.integers(0, levels, (30, 2000))).astype(np.float32)
    scores[...] = values
    assert 2000 // layout.shard[1] > 1
    result, totals = aggregation._from_scores(AggregateSpec(top_k=4), group, scores)
    helpful, harmful = _stable_top(values, 4)
    assert np.array_equal(result.helpful_indices, helpful) and np.array_equal(result.harmful_indices, harmful)
    assert np.array_equal(result.helpful_scores, np.take_along_axis(values, helpful, 1))
    assert np.array_equal(result.harmful_scores, np.take_along_axis(values, harmful, 1))
    np.testing.assert_allclose(totals[...], values.astype(np.float64).sum(0), rtol=1e-6)
    assert result.missing == 0


def test_nan_scores_are_counted(tmp_path):
    layout = score_layout(5, 300, 0.002)
    group = zarr.open_group(str(tmp_path / "out.zarr"), mode="w")
    scores = group.create_array("scores", shape=(5, 300), chunks=layout.chunk, shards=layout.shard, dtype="float32", fill_value=np.nan)
    scores[:, :200] = np.ones((5, 200), dtype=np.float32)  # the last columns never written: a partial matrix
    result, _ = aggregation._from_scores(AggregateSpec(top_k=2), group, scores)
    assert result.missing == 5 * 100


def test_candidates_ties_go_to_the_lower_training_index():
    """Candidates listed out of index order with tied scores: the top-k names the lower training index first."""
    indices = np.array([[9, 4, 7, 1]])
    scores = np.array([[2.0, 2.0, -1.0, -1.0]], dtype=np.float32)
    result, totals = aggregate_candidates(indices, scores, 2, 10)
    assert result.helpful_indices.tolist() == [[4, 9]] and result.harmful_indices.tolist() == [[1, 7]]
    assert result.helpful_scores.tolist() == [[2.0, 2.0]] and result.harmful_scores.tolist() == [[-1.0, -1.0]]
    assert totals[[1, 4, 7, 9]].tolist() == [-1.0, 2.0, -1.0, 2.0]
