"""The library on inputs given as a dict of named tensors (issue 25, item 3): model(**x), every method, the same
scores as the same model reading one stacked tensor; the report's view of named fields."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from influence_core import ArnoldiInfluence, CgInfluence, DirectInfluence, EkfacInfluence, LissaInfluence
from influence_core.batches import ArrayBatches
from influence_core.pipeline.report.report import example_view, prompted_text


class FieldsClassifier(nn.Module):
    """Mean of the unmasked token embeddings, then a linear head: called with input_ids and attention_mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(11, 4), nn.Linear(4, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embedding(input_ids) * attention_mask[..., None]
        return self.head(h.sum(1) / attention_mask.sum(1, keepdim=True))


class Stacked(nn.Module):
    """The same model reading one (n, 2, T) tensor: the independent reference."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x[:, 0], x[:, 1])


def data(n: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(5)[None, :] < torch.randint(2, 6, (n,), generator=g)[:, None]).long()
    return {"input_ids": torch.randint(0, 11, (n, 5), generator=g), "attention_mask": mask}, torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("cls", [DirectInfluence, CgInfluence, LissaInfluence, ArnoldiInfluence, EkfacInfluence])
def test_dict_inputs_score_as_the_stacked_tensor(cls):
    torch.manual_seed(0)
    model = FieldsClassifier().double()
    (x, y), (xq, yq) = data(24, 0), data(5, 1)
    options = {"lissa_batch_size": 8, "depth": 30, "seed": 0} if cls is LissaInfluence else {}  # random batches of rows: examples.take
    got = cls(model, "cross_entropy", 1e-1, **options).fit((x, y))
    want = cls(Stacked(model), "cross_entropy", 1e-1, **options).fit((torch.stack([x["input_ids"], x["attention_mask"]], 1), y))
    stack = lambda fields: torch.stack([fields["input_ids"], fields["attention_mask"]], 1)  # noqa: E731
    scores = got.influences(xq, yq, x, y)
    assert scores.shape == (5, 24) and scores.abs().max() > 0
    torch.testing.assert_close(scores, want.influences(stack(xq), yq, stack(x), y), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.self_influences(x, y), want.self_influences(stack(x), y), rtol=1e-9, atol=1e-12)


def test_stored_arrays_by_field_stream_as_dict_batches():
    """ArrayBatches over a dict of (numpy) arrays yields dict batches of those rows."""
    x = {"input_ids": np.arange(20).reshape(10, 2), "pixel_values": np.zeros((10, 3, 2, 2), np.float32)}
    batches = list(ArrayBatches(x, np.arange(10), 4, start=1, stop=9))
    assert [len(y) for _, y in batches] == [4, 4]
    np.testing.assert_array_equal(batches[1][0]["input_ids"].numpy(), np.arange(20).reshape(10, 2)[5:9])
    assert batches[0][0]["pixel_values"].shape == (4, 3, 2, 2)


def test_report_shows_input_ids_without_padding():
    ids = np.array([[ord(c) for c in "abcd"], [ord(c) for c in "wxyz"]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    view = example_view({"input_ids": ids, "attention_mask": mask})
    np.testing.assert_array_equal(view[1], [ord("w"), ord("x"), -1, -1])
    labels = np.where(mask == 0, -100, ids)
    assert prompted_text(view[0], labels[0]) == "abc"  # padding is neither prompt nor completion
    assert example_view({"pixel_values": ids}) is ids
