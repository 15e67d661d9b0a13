"""Stage bookkeeping: deterministic keys, output locations, and manifests written last as completion marks.

A stage's key hashes its input fingerprints, its own config and the code version. Its outputs live under
`{cache_url}/{stage}/{key}`, beside `manifest.json`, which records the arguments (as Kronfluence does) and an
inventory of the output, and is written only after every output is in place. A stage is complete exactly when its
manifest is there and its output is still what the manifest recorded: the same fingerprint, and none of its
objects gone or cut short (a deleted shard, a truncated file), so damage is recomputed, never served.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from abc import ABC, abstractmethod
from contextlib import nullcontext
from datetime import datetime, timezone
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Generic, TypeVar

import zarr

from . import damage, storage
from .refs import Ref, StageRef
from ..runtime.threads import torch_threads
from ...version import CODE_VERSION
from .run_store import RunStore

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
    """The directory of one stage run, and its manifest. The manifest records URLs relative to the output's root
    (`RunStore.relative`), so an output that is moved or copied elsewhere still finds its stages complete."""

    def __init__(self, store: RunStore, stage: str, key: str) -> None:
        self.store, self.stage, self.key, self.options = store, stage, key, store.options
        self.url = storage.join(store.cache_url, stage, key)

    def path(self, name: str) -> str:
        return storage.join(self.url, name)

    @property
    def manifest_url(self) -> str:
        return self.path("manifest.json")

    def read(self, ref_type: type[R]) -> R | None:
        """The recorded output if the stage is complete and its output intact, else None."""
        try:
            manifest = storage.read_json(self.manifest_url, self.options)
            ref = ref_type.model_validate(manifest["output"]).moved(self.store.resolve)
            recorded = {self.store.resolve(url) if ".zarr" in ref.url else url: entry for url, entry in manifest["inventory"].items()}
        except (FileNotFoundError, ValueError, KeyError, TypeError):  # absent, damaged, or being written by a concurrent run
            return None
        return ref if output_intact(ref, recorded, self.options) else None

    def write(self, ref: StageRef, arguments: dict[str, Any], inputs: dict[str, Ref]) -> None:
        relative = self.store.relative
        recorded = inventory(ref, self.options)
        manifest = {
            "stage": self.stage,
            "key": self.key,
            "code_version": CODE_VERSION,
            "arguments": arguments,
            "inputs": {name: r.moved(relative).model_dump(mode="json") for name, r in inputs.items()},
            "output": ref.moved(relative).model_dump(mode="json"),
            "inventory": {relative(url) if ".zarr" in ref.url else url: entry for url, entry in recorded.items()},
        }
        storage.write_json(self.manifest_url, manifest, self.options)


def _zarr_outputs(ref: Ref, options: dict[str, Any]) -> list[str]:
    """The Zarr node at ref.url and, when it is an array, the sibling arrays the same stage wrote (same fingerprint)."""
    node = zarr.open(store=storage.zarr_store(ref.url, options, read_only=True), mode="r")
    if isinstance(node, zarr.Group):
        return [ref.url]
    parent = ref.url.rsplit("/", 1)[0]
    group = storage.open_group(parent, options, mode="r")
    return [storage.join(parent, name) for name, array in group.arrays() if array.attrs.get("fingerprint") == ref.fingerprint]


def inventory(ref: Ref, options: dict[str, Any]) -> dict[str, Any]:
    """What a finished output consists of. Zarr: the size of every object of each output node. A file: its size and
    store stamp (checked cheaply) and its content hash (read only when the stamp changed)."""
    if ".zarr" in ref.url:
        return {url: storage.file_sizes(url, options) for url in _zarr_outputs(ref, options)}
    stamp = storage.file_stamp(ref.url, options)
    assert stamp is not None, f"{ref.url} was not written"
    return {"size": stamp[0], "stamp": stamp[1], "sha256": storage.content_hash(ref.url, options)}


def output_intact(ref: Ref, recorded: dict[str, Any], options: dict[str, Any]) -> bool:
    """Zarr outputs must still carry the ref's fingerprint (another run may have overwritten them) and every object
    they had, at its size; a file must have its size, and its content hash unless its stamp is unchanged."""
    if ".zarr" not in ref.url:
        stamp = storage.file_stamp(ref.url, options)
        if stamp is None or stamp[0] != recorded["size"]:
            return False
        return stamp[1] == recorded["stamp"] or storage.content_hash(ref.url, options) == recorded["sha256"]
    hierarchies = {url[: url.index(".zarr") + len(".zarr")] for url in recorded}  # the whole hierarchy, its group's metadata too
    if any(damage.damaged_nodes(url, options) for url in hierarchies):  # metadata cut short or overwritten, even at its size
        return False
    try:
        node = zarr.open(store=storage.zarr_store(ref.url, options, read_only=True), mode="r")
    except (FileNotFoundError, KeyError, ValueError):
        return False
    if node.attrs.get("fingerprint") != ref.fingerprint:
        return False
    for url, sizes in recorded.items():
        present = storage.file_sizes(url, options)
        if any(present.get(key) != size for key, size in sizes.items()):
            return False
    return True


@dataclass(frozen=True)
class StageCall(Generic[R]):
    """One stage applied to its inputs: enough to find its output, or to compute it. Its key is computed and its
    manifest read once, however often they are asked for."""

    stage: str
    ref_type: type[R]
    config: dict[str, Any]
    inputs: dict[str, Ref]
    store: RunStore
    threads: int | None = None  # torch threads the stage computes with (None: it runs no torch arithmetic here)
    output_bytes: int | None = None  # what the stage writes, when known beforehand (the scores): named when the disk is full

    @cached_property
    def key(self) -> str:
        pinned = {} if self.threads is None else {"torch_threads": self.threads}
        return stage_key(self.stage, {**self.config, **pinned}, self.inputs)  # never where the output lives: a moved output keeps its keys

    @cached_property
    def location(self) -> StageLocation:
        return StageLocation(self.store, self.stage, self.key)

    def existing(self, recheck: bool = False) -> R | None:
        """The stored output when complete and intact; the store is the truth, not any cache in front of it. Read
        once: the flow's check and the stage's run share the answer; `recheck` reads again (another run may have
        written the output since)."""
        if recheck or "found" not in self.__dict__:
            self.__dict__["found"] = self.location.read(self.ref_type)  # frozen fields; the answer is a cache beside them
        found: R | None = self.__dict__["found"]
        return found

    def run(self, compute: Callable[[StageLocation], dict[str, Any]]) -> R:
        """Return the stored output if complete; else compute it and write the manifest last.

        `compute` writes the outputs and returns the ref fields other than stage, created_at, seconds and producer.
        """
        found = self.existing()
        if found is not None:
            return found
        location = self.location
        start = time.perf_counter()
        need = f"{storage.megabytes(self.output_bytes)} for {self.stage}'s output" if self.output_bytes else f"room for {self.stage}'s output"
        with self.store.writing(self.stage, need), nullcontext() if self.threads is None else torch_threads(self.threads):
            fields = compute(location)
        ref = self.ref_type(stage=self.stage, created_at=datetime.now(timezone.utc), seconds=time.perf_counter() - start, producer=producer(), **fields)
        location.write(ref, self.config, self.inputs)
        return ref


class StageInput(ABC, Generic[R]):
    """Everything one stage is given (its specs, its input refs and the RunStore), as one frozen dataclass that
    travels from the flow to its task, the stage and its jobs; it plans the stage's call once."""

    @abstractmethod
    def plan(self) -> StageCall[R]:
        """The stage's call: its key's config and input refs."""

    @cached_property
    def call(self) -> StageCall[R]:
        return self.plan()
