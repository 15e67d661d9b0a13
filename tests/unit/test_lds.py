"""The linear datamodeling score against independent references: a hand-computed case, scipy's Spearman, and
constructed retraining outcomes whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from influence_core.errors import ConfigError
from influence_core.lds import average_ranks, linear_datamodeling_score, spearman


def test_hand_computed_spearman() -> None:
    # ranks of a: 1, 3, 2, 4; of b: 2, 3, 1, 4; d = (-1, 0, 1, 0): rho = 1 - 6·2 / (4·15) = 0.8
    assert spearman(np.array([0.1, 0.7, 0.3, 2.0]), np.array([5.0, 6.0, -1.0, 9.0])) == pytest.approx(0.8)
    assert average_ranks(np.array([3.0, 1.0, 3.0, 2.0])) == pytest.approx([3.5, 1.0, 3.5, 2.0])


def test_spearman_matches_scipy_with_ties() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.integers(0, 6, 40).astype(float)  # many ties
        b = a + rng.integers(0, 4, 40)
        assert spearman(a, b) == pytest.approx(spearmanr(a, b)[0], abs=1e-12)


def test_lds_of_a_true_linear_datamodel() -> None:
    """Losses that are exactly a monotone function of −Σ_S score give LDS 1; the flipped sign gives −1; noise gives
    scipy's per-query Spearman."""
    rng = np.random.default_rng(1)
    scores = rng.standard_normal((5, 30))
    masks = rng.random((64, 30)) < 0.5
    loss = -(masks @ scores.T)  # (64, 5)
    assert linear_datamodeling_score(scores, masks, np.exp(loss)).mean == pytest.approx(1.0)
    assert linear_datamodeling_score(scores, masks, -loss).mean == pytest.approx(-1.0)
    noisy = loss + 2.0 * rng.standard_normal(loss.shape)
    got = linear_datamodeling_score(scores, masks, noisy)
    ref = np.array([spearmanr(loss[:, q], noisy[:, q])[0] for q in range(5)])
    assert got.per_query == pytest.approx(ref, abs=1e-12)
    assert got.stderr == pytest.approx(ref.std(ddof=1) / np.sqrt(5))


def test_lds_refuses_misaligned_inputs() -> None:
    with pytest.raises(ConfigError, match="lds: .* do not line up"):
        linear_datamodeling_score(np.zeros((2, 5)), np.ones((10, 4), bool), np.zeros((10, 2)))
    with pytest.raises(ConfigError, match="lds.subsets"):
        linear_datamodeling_score(np.zeros((2, 5)), np.ones((2, 5), bool), np.zeros((2, 2)))
