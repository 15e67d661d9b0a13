"""Stage bookkeeping: deterministic keys, output locations, and manifests written last as completion marks.

A stage's key hashes its input fingerprints, its own config and the code version. Its outputs live under
`{cache_url}/{stage}/{key}`, beside `manifest.json`, which records the arguments (as Kronfluence does) and is
written only after every output is in place, so a stage is complete exactly when its manifest is there and its
output still carries the fingerprint the manifest names.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import zarr

from .. import storage
from ..refs import Ref, StageRef
from ..threads import torch_threads
from ..version import CODE_VERSION
from .store import RunStore

R = TypeVar("R", bound=StageRef)


def producer() -> str:
    """This process, as recorded in the refs it computes."""
    return f"{socket.gethostname()}:{os.getpid()}"


def stage_key(stage: str, config: dict[str, Any], inputs: dict[str, Ref]) -> str:
    """Hash of stage name, code version, config and the input refs' fingerprints."""
    payload = {
        "stage": stage,
        "code": CODE_VERSION,
        "config": config,
        "inputs": {name: ref.fingerprint for name, ref in sorted(inputs.items())},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


class StageLocation:
    """The directory of one stage run, and its manifest."""

    def __init__(self, cache_url: str, stage: str, key: str, options: dict[str, Any]) -> None:
        self.stage, self.key, self.options = stage, key, options
        self.url = storage.join(cache_url, stage, key)

    def path(self, name: str) -> str:
        return storage.join(self.url, name)

    @property
    def manifest_url(self) -> str:
        return self.path("manifest.json")

    def read(self, ref_type: type[R]) -> R | None:
        """The recorded output if the stage is complete and its output intact, else None."""
        if not storage.exists(self.manifest_url, self.options):
            return None
        ref = ref_type.model_validate(storage.read_json(self.manifest_url, self.options)["output"])
        return ref if output_intact(ref, self.options) else None

    def write(self, ref: StageRef, arguments: dict[str, Any], inputs: dict[str, Ref]) -> None:
        manifest = {
            "stage": self.stage,
            "key": self.key,
            "code_version": CODE_VERSION,
            "arguments": arguments,
            "inputs": {name: r.model_dump(mode="json") for name, r in inputs.items()},
            "output": ref.model_dump(mode="json"),
        }
        storage.write_json(self.manifest_url, manifest, self.options)


def output_intact(ref: Ref, options: dict[str, Any]) -> bool:
    """Zarr outputs must still carry the ref's fingerprint (another run may have overwritten them)."""
    if ".zarr" in ref.url:
        try:
            node = zarr.open(store=storage.zarr_store(ref.url, options, read_only=True), mode="r")
        except (FileNotFoundError, KeyError, ValueError):
            return False
        return node.attrs.get("fingerprint") == ref.fingerprint
    return storage.exists(ref.url, options)


@dataclass(frozen=True)
class StageCall(Generic[R]):
    """One stage applied to its inputs: enough to find its output, or to compute it."""

    stage: str
    ref_type: type[R]
    config: dict[str, Any]
    inputs: dict[str, Ref]
    store: RunStore
    threads: int | None = None  # torch threads the stage computes with (None: it runs no torch arithmetic here)

    @property
    def key(self) -> str:
        pinned = {} if self.threads is None else {"torch_threads": self.threads}
        return stage_key(self.stage, {**self.config, **pinned, "cache_url": self.store.cache_url}, self.inputs)

    @property
    def location(self) -> StageLocation:
        return StageLocation(self.store.cache_url, self.stage, self.key, self.store.options)

    def existing(self) -> R | None:
        """The stored output when complete and intact; the store is the truth, not any cache in front of it."""
        return self.location.read(self.ref_type)

    def run(self, compute: Callable[[StageLocation], dict[str, Any]]) -> R:
        """Return the stored output if complete; else compute it and write the manifest last.

        `compute` writes the outputs and returns the ref fields other than stage, created_at, seconds and producer.
        """
        found = self.existing()
        if found is not None:
            return found
        location = self.location
        start = time.perf_counter()
        with nullcontext() if self.threads is None else torch_threads(self.threads):
            fields = compute(location)
        ref = self.ref_type(stage=self.stage, created_at=datetime.now(timezone.utc), seconds=time.perf_counter() - start, producer=producer(), **fields)
        location.write(ref, self.config, self.inputs)
        return ref
