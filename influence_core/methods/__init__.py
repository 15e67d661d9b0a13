"""Curvature methods, each an `InfluenceFunctionModel`."""

from .base import InfluenceFunctionModel
from .cg import CgInfluence
from .direct import DirectInfluence

__all__ = ["InfluenceFunctionModel", "DirectInfluence", "CgInfluence"]
