"""save_tensors stores a view's own numbers: torch.save alone writes the whole storage a view points into."""

from __future__ import annotations

import torch

from influence_core.pipeline.model.models import load_stored
from influence_core.pipeline.store.loading import save_tensors


def test_a_view_is_saved_as_its_own_numbers(tmp_path):
    """Five rows of a 1000 x 1000 float64 matrix (as the whitening factors are rows of an SVD) take a file near
    their own 40 kB, not the 8 MB storage they view, and read back equal; plain values pass through."""
    full = torch.randn(1000, 1000, dtype=torch.float64)
    url = str(tmp_path / "t.pt")
    save_tensors(url, {"left": full[:5], "whole": full[:2, :3].contiguous(), "kind": "sketch"}, {})
    assert (tmp_path / "t.pt").stat().st_size < 2 * 5 * 1000 * 8
    state = load_stored(url, {}, field="index_training")
    assert torch.equal(state["left"], full[:5]) and torch.equal(state["whole"], full[:2, :3]) and state["kind"] == "sketch"
