"""A question's running top-k over index chunks equals a stable sort of each whole row (ties: the lower index
first), with ties within the selection's margin and past it."""

from __future__ import annotations

import pytest
import torch

from influence_core.pipeline.score.score_reductions import RunningTopK


@pytest.mark.parametrize(("levels", "step"), [(None, 37), (20, 37), (3, 50), (None, 3)])
def test_running_top_k_equals_a_stable_sort_of_the_whole_row(levels, step):
    """levels None: continuous scores (no ties); 20 levels: ties within the margin; 3 levels: ties past it."""
    gen = torch.Generator().manual_seed(levels or 0)
    scores = torch.randn(7, 500, generator=gen) if levels is None else torch.randint(0, levels, (7, 500), generator=gen).float()
    running = RunningTopK(7, 5)
    for lo in range(0, 500, step):
        running.add(scores[:, lo : lo + step], lo)
    found = running.arrays()
    for q, row in enumerate(scores.tolist()):
        helpful = sorted(range(500), key=lambda i: (-row[i], i))[:5]
        harmful = sorted(range(500), key=lambda i: (row[i], i))[:5]
        assert found["topk_helpful_indices"][q].tolist() == helpful and found["topk_harmful_indices"][q].tolist() == harmful
        assert found["topk_helpful_scores"][q].tolist() == [row[i] for i in helpful]
