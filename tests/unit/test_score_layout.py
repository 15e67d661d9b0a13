"""The scores' layout keeps its promises over a grid of shapes: at least MIN_TASKS tasks (every worker, or thread, has
work), shards no larger than the target, and inner chunks that tile each shard exactly."""

from __future__ import annotations

import math

import pytest

from influence_core.pipeline.score.layout import INNER_CHUNK_BYTES, MIN_TASKS, score_layout


@pytest.mark.parametrize("n_test", [1, 20, 322, 500, 1000, 3000])
@pytest.mark.parametrize("n_train", [8, 300, 2000, 5000, 1_000_000])
def test_layout_leaves_min_tasks_and_whole_chunks(n_test, n_train):
    layout = score_layout(n_test, n_train, 64.0)
    assert layout.n_tasks >= MIN_TASKS  # W3's 500 x 5,000 once left 5
    assert layout.shard[1] % layout.chunk[1] == 0 and layout.shard[0] % layout.chunk[0] == 0
    assert layout.shard[1] <= max(layout.chunk[1], math.ceil(n_train / MIN_TASKS))
    assert layout.shard[0] * layout.shard[1] * 4 <= max(64 * 2**20, layout.shard[0] * layout.chunk[1] * 4)
    assert layout.chunk[0] * layout.chunk[1] * 4 <= INNER_CHUNK_BYTES + 4 * layout.chunk[0]
