"""The training recipe the pipeline runs (Adam, L2 weight decay, a seeded batch schedule), reusable by any code that
must replay it step for step (MAGIC's metagradients, the LDS retrainings)."""

from .recipe import SHUFFLE_BLOCK_ROWS, AdamRecipe, LrDecay, train
from .schedule import Block, BatchSchedule

__all__ = ["SHUFFLE_BLOCK_ROWS", "AdamRecipe", "BatchSchedule", "Block", "LrDecay", "train"]
