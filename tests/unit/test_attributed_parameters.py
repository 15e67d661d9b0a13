"""What is attributed is listed: frozen parameters (requires_grad=False) are never included, every method says so
with names and counts, and K-FAC/EK-FAC refuse a frozen layer in method.modules naming that field."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from influence_core import CgInfluence, ConfigError, DirectInfluence, EkfacInfluence


def frozen_first_layer() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (40,), generator=gen)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    model[0].requires_grad_(False)
    return model, x, y


@pytest.mark.parametrize("method", [DirectInfluence, CgInfluence, EkfacInfluence])
def test_frozen_parameters_are_listed_and_left_out(method):
    model, x, y = frozen_first_layer()
    im = method(model, "cross_entropy", 1e-2).fit((x, y))
    listed = im.attributed_parameters()
    assert listed["frozen"] == {"tensors": 2, "elements": 5 * 4 + 4, "names": ["0.weight", "0.bias"]}
    assert listed["included"] == {"tensors": 2, "elements": 4 * 3 + 3, "names": ["2.weight", "2.bias"]}
    assert listed["excluded"] == {"tensors": 0, "elements": 0, "names": []}
    # the same scores as choosing the last layer explicitly on the unfrozen model: the frozen layer is really left out
    model.requires_grad_(True)
    chosen = DirectInfluence(model, "cross_entropy", 1e-2, modules=["2"], second_order_mode="hessian").fit((x, y))
    expected = chosen.influences(x[:3], y[:3], x, y)
    model[0].requires_grad_(False)
    got = im.influences(x[:3], y[:3], x, y)
    if method is EkfacInfluence:  # EK-FAC approximates the Gauss-Newton matrix: only its ranking is close
        assert torch.corrcoef(torch.stack([got.flatten(), expected.flatten()]))[0, 1] > 0.9
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-8)


def test_ekfac_refuses_a_frozen_layer_naming_method_modules():
    model, *_ = frozen_first_layer()
    with pytest.raises(ConfigError) as refused:
        EkfacInfluence(model, "cross_entropy", 1e-2, modules=["0", "2"])
    assert refused.value.field == "method.modules" and "['0'] are frozen" in refused.value.problem and "['2']" in refused.value.fix


def test_included_parameters_are_split_by_how_their_gradients_are_taken():
    """A LayerNorm goes through torch.func (vmapped); the embedding and the Linear layers are captured; the split
    covers exactly the included parameters, with their element counts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Flatten(), nn.Linear(18, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randint(0, 11, (30, 3)), torch.randint(0, 3, (30,))
    listed = DirectInfluence(model, "cross_entropy", 1e-2, second_order_mode="gauss_newton").fit((x, y)).attributed_parameters()
    assert listed["captured"]["names"] == ["0.weight", "2.weight", "2.bias", "5.weight", "5.bias"]
    assert listed["vmapped"] == {"tensors": 2, "elements": 8 + 8, "names": ["3.weight", "3.bias"]}
    assert listed["captured"]["elements"] + listed["vmapped"]["elements"] == listed["included"]["elements"] == sum(p.numel() for p in model.parameters())
