"""Cheap checks at the start of a run: everything that can be found out in seconds fails before any stage computes."""

from __future__ import annotations

import torch

from ..store import storage
from .cluster import check_local_workers, check_scheduler
from ...errors import ConfigError
from ..model.models import missing_weights
from ..specs import ComputeSpec, ModelSpec, TrainingSpec
from ..store.run_store import RunStore


def preflight(store: RunStore, compute: ComputeSpec, model: ModelSpec, training: TrainingSpec) -> None:
    """Output and cache writable (credentials, endpoint, bucket, permissions), scheduler answering, local workers within
    the cores, checkpoint and initial weights present.

    Each failure is a ConfigError naming the field and the fix; none takes longer than a short probe timeout.
    """
    store.check()
    check_scheduler(compute)
    check_local_workers(compute)
    if compute.torch_device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("compute.device", "cuda, but no CUDA device is visible to torch here", "set compute.device: cpu, or run on a GPU host (with cluster: cuda, one worker per GPU)")
    for field, url in (("model.checkpoint", model.checkpoint), ("training.init", training.init)):
        if url and not storage.exists(url, store.options):
            raise missing_weights(url, field)
