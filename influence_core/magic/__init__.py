"""MAGIC (Ilyas & Engstrom 2025): exact metagradients of query measurements with respect to per-example training loss
weights, by reverse mode through every step of the replayed, deterministic training."""

from .metagradient import Metagradients, metagradients
from .replay import ReplayWork, check_deterministic, check_replayable

__all__ = ["Metagradients", "ReplayWork", "check_deterministic", "check_replayable", "metagradients"]
