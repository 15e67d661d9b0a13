"""Model factories the pipeline's tests name by dotted path (`model.factory: tests.plugin_models:...`)."""

from __future__ import annotations

from torch import nn


def dropout_batchnorm_mlp(in_features: int, classes: int, hidden: int = 16, dropout: float = 0.5) -> nn.Module:
    """An MLP with BatchNorm and Dropout: random in train mode, deterministic in eval mode."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, classes))
