"""K-FAC and EK-FAC on padded token batches (named fields with an attention_mask): the token ids under mask 0 change
nothing, since padding adds nothing to the input covariance (without the mask's weights this test fails: every
score moves)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from influence_core import EkfacInfluence, KfacInfluence
from influence_core.methods.kfac import padding_mask
from influence_core.task import IGNORE_INDEX
from tests.plugin_models import gpt2_fields


def padded(seed: int, n: int = 24, length: int = 8) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-padded random token ids with their mask, and LM labels that ignore the padding."""
    rng = np.random.default_rng(seed)
    mask = torch.from_numpy((np.arange(length)[None, :] < rng.integers(3, length + 1, n)[:, None]).astype(np.int64))
    ids = torch.from_numpy(rng.integers(1, 64, (n, length))) * mask
    return {"input_ids": ids, "attention_mask": mask}, torch.where(mask == 0, IGNORE_INDEX, ids)


@pytest.mark.parametrize("method", [KfacInfluence, EkfacInfluence])
def test_token_ids_under_padding_leave_the_scores_unchanged(method):
    torch.manual_seed(0)
    model = gpt2_fields(n_layer=1, n_embd=16, n_head=2).double().eval()
    x, y = padded(0)
    xq, yq = padded(1, n=4)
    other = {**x, "input_ids": torch.where(x["attention_mask"] == 0, (x["input_ids"] * 7 + 5) % 63 + 1, x["input_ids"])}

    def scores(train: dict[str, torch.Tensor]) -> torch.Tensor:
        im = method(model, "language_modelling", 1e-3, fisher="exact", batch_size=8)
        return im.fit((train, y)).influences(xq, yq, train, y)

    base = scores(x)
    np.testing.assert_allclose(scores(other).numpy(), base.numpy(), rtol=1e-9, atol=1e-9 * float(base.abs().max()))
    changed = {**x, "input_ids": x["input_ids"].clone()}
    changed["input_ids"][0, 0] = changed["input_ids"][0, 0] % 63 + 1
    assert not torch.allclose(scores(changed), base, rtol=1e-4)


def test_the_mask_applies_only_to_layers_that_see_its_positions():
    x = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}
    np.testing.assert_array_equal(padding_mask(x, torch.zeros(2, 5, 3)).numpy(), x["attention_mask"].numpy())
    assert padding_mask(x, torch.zeros(2, 1, 3)) is None and padding_mask(x["input_ids"], torch.zeros(2, 5, 3)) is None
