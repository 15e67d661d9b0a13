"""EK-FAC's eigenvalues checked against an independent curvature: shared by the unit tests of the layers EK-FAC tracks."""

from __future__ import annotations

import torch
from torch import nn

from influence_core import DirectInfluence, EkfacInfluence
from influence_core.task import LanguageModelling


def assert_ekfac_eigenvalues_are_exact(model: nn.Module, layer: str, x: torch.Tensor) -> None:
    """With the exact Fisher, EK-FAC's eigenvalues for `layer` are diag(Pᵀ C P) for the layer's exact Gauss-Newton
    block C (Direct's, built independently) and its Kronecker eigenbasis P (a language model over tokens x)."""
    ekfac = EkfacInfluence(model, LanguageModelling(modules=(layer,)), 1.0, fisher="exact").fit((x, x))
    direct = DirectInfluence(model, LanguageModelling(modules=(layer,)), 1.0, second_order_mode="gauss_newton").fit((x, x))
    (tracked,) = ekfac.layers
    state, factor = ekfac.solvers[tracked.block].state_dict(), direct.solvers["all"].factor
    block = factor @ factor.T - torch.eye(len(factor), dtype=factor.dtype)
    basis = tracked.to_flat(torch.einsum("os,ia->saoi", state["q_s"], state["q_a"]).reshape(-1, tracked.out_dim, tracked.in_dim))
    expected = torch.diagonal(basis @ block @ basis.T)
    torch.testing.assert_close(state["eigenvalues"].reshape(-1), expected, rtol=0, atol=1e-9 * float(expected.max()))
