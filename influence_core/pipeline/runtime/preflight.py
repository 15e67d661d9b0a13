"""Cheap checks at the start of a run: everything that can be found out in seconds fails before any stage computes."""

from __future__ import annotations

import torch

from ..store import storage
from .cluster import check_local_workers, check_scheduler
from ...errors import ConfigError
from ..specs import ComputeSpec, ModelSpec
from ..store.run_store import RunStore


def preflight(store: RunStore, compute: ComputeSpec, model: ModelSpec) -> None:
    """Output and cache writable (credentials, endpoint, bucket, permissions), scheduler answering, local workers within
    the cores, checkpoint present.

    Each failure is a ConfigError naming the field and the fix; none takes longer than a short probe timeout.
    """
    store.check()
    check_scheduler(compute)
    check_local_workers(compute)
    if compute.torch_device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("compute.device", "cuda, but no CUDA device is visible to torch here", "set compute.device: cpu, or run on a GPU host (with cluster: cuda, one worker per GPU)")
    if model.checkpoint and not storage.exists(model.checkpoint, store.options):
        raise ConfigError("model.checkpoint", f"no checkpoint at {model.checkpoint!r}", "give the path or s3:// URL of a saved state_dict")
