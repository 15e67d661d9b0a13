"""Stage bookkeeping: deterministic keys, output locations, and manifests written last as completion marks.

A stage's key hashes its inputs' fingerprints and content digests, its own config and the code version. Its
outputs live under `{cache_url}/{stage}/{key}`, beside `manifest.json`, which records the arguments (as Kronfluence
does), the inputs, and an inventory of the output's objects with their sha256 (`integrity.py`), and is written only
after every output is in place. A stage is complete exactly when its manifest is there and its output is still
what the manifest recorded, object by object, so damage (a deleted or truncated chunk, a chunk overwritten with
other bytes of its size, a swapped model) is recomputed, never served; a manifest found stale is removed before the
stage computes again, so no reader takes a stage being repaired for complete.
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

from . import damage, integrity, storage
from .refs import Ref, StageRef
from ..runtime.threads import torch_threads
from ...version import CODE_VERSION
from .run_store import RunStore

R = TypeVar("R", bound=StageRef)


def producer() -> str:
    """This process, as recorded in the refs it computes."""
    return f"{socket.gethostname()}:{os.getpid()}"


def stage_key(stage: str, config: dict[str, Any], inputs: dict[str, Ref]) -> str:
    """Hash of stage name, code version, config and the input refs' identities: their fingerprints and, for stage
    outputs, the digest of their content, so a stage is never reused over inputs other than those it was made from."""
    payload = {
        "stage": stage,
        "code": CODE_VERSION,
        "config": config,
        "inputs": {name: ref.identity for name, ref in sorted(inputs.items())},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


class StageLocation:
    """The directory of one stage run, and its manifest. The manifest records URLs relative to the output's root or
    to the stage store's (`RunStore.relative`), and its inventory records each object relative to the output's
    folder, so an output or a stage store that is moved or copied elsewhere is still found complete."""

    def __init__(self, store: RunStore, stage: str, key: str) -> None:
        self.store, self.stage, self.key, self.options = store, stage, key, store.options
        self.url = storage.join(store.cache_url, stage, key)

    def path(self, name: str) -> str:
        return storage.join(self.url, name)

    @property
    def manifest_url(self) -> str:
        return self.path("manifest.json")

    def manifest(self) -> dict[str, Any] | None:
        """The manifest when present and of this stage and key; None when absent, unreadable or another's."""
        try:
            manifest = storage.read_json(self.manifest_url, self.options)
        except (FileNotFoundError, ValueError):
            return None
        return manifest if isinstance(manifest, dict) and manifest.get("key") == self.key and manifest.get("stage") == self.stage else None

    def read(self, ref_type: type[R], deep: bool = False) -> R | None:
        """The recorded output if the stage is complete and every object of its output is what the manifest recorded
        (`integrity.problems`; `deep`: every byte hashed again), else None."""
        found = self.check(ref_type, deep)
        return found if isinstance(found, Ref) else None

    def check(self, ref_type: type[R], deep: bool = False) -> R | list[str]:
        """The recorded output, or what is wrong with it (no manifest, or the objects that do not match)."""
        manifest = self.manifest()
        if manifest is None:
            return [f"has no manifest at {self.manifest_url} (never finished, being recomputed, or damaged)"]
        try:
            ref = ref_type.model_validate(manifest["output"]).moved(self.store.resolve)
            recorded = manifest["inventory"]
            consistent = ref.digest == integrity.content_digest(recorded)
        except (KeyError, TypeError, ValueError, AttributeError):  # an older or damaged manifest
            consistent = False
        if not consistent:
            return [f"manifest {self.manifest_url} does not record the output's content (damaged, or written by an older version)"]
        wrong = integrity.problems(ref.base, recorded, self.options, deep)
        return wrong or ref

    def write(self, ref: R, arguments: dict[str, Any], inputs: dict[str, Ref]) -> R:
        """Record the output's objects (chunk tasks' markers vouch for the chunks they wrote) and write the manifest;
        the ref comes back with its content digest."""
        relative = self.store.relative
        roots = _output_roots(ref, self.options)
        if ".zarr/" in ref.url and ref.base.startswith(self.url + "/"):  # an array in a group of the stage's own: its metadata too
            roots.append(damage.METADATA)
        recorded = integrity.record_listed(ref.base, roots, self.options, self.vouched())
        ref = ref.model_copy(update={"digest": integrity.content_digest(recorded)})
        manifest = {
            "stage": self.stage,
            "key": self.key,
            "code_version": CODE_VERSION,
            "arguments": arguments,
            "inputs": {name: r.moved(relative).model_dump(mode="json") for name, r in inputs.items()},
            "output": ref.moved(relative).model_dump(mode="json"),
            "inventory": recorded,
        }
        storage.write_json(self.manifest_url, manifest, self.options)
        return ref

    def vouched(self) -> dict[str, integrity.Entry]:
        """The objects the stage's chunk tasks recorded in their markers (`chunks.py`), relative to the output's folder."""
        markers = integrity.read_markers([storage.join(self.path(MARKERS), name) for name in storage.list_names(self.path(MARKERS), self.options)], self.options)
        return {key: entry for marker in markers.values() for key, entry in marker.items()}


MARKERS = "done"  # a stage's chunk markers: done/{index}, each the record of the objects its task wrote


def _output_roots(ref: Ref, options: dict[str, Any]) -> list[str]:
    """What an output consists of, relative to its folder: a checked file and its digest, or the Zarr node at
    ref.url and, when it is an array, the sibling arrays the same stage wrote (same fingerprint)."""
    name = ref.url.rsplit("/", 1)[-1]
    if ".zarr" not in ref.url:
        return integrity.file_keys(name)
    node = zarr.open(store=storage.zarr_store(ref.url, options, read_only=True), mode="r")
    if isinstance(node, zarr.Group):
        return [name]
    group = storage.open_group(ref.base, options, mode="r")
    return sorted({name} | {sibling for sibling, array in group.arrays() if array.attrs.get("fingerprint") == ref.fingerprint})


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
        if storage.exists(location.manifest_url, self.store.options):  # damaged or stale: until recomputed, no reader takes it as complete
            storage.remove(location.manifest_url, self.store.options)
        start = time.perf_counter()
        need = f"{storage.megabytes(self.output_bytes)} for {self.stage}'s output" if self.output_bytes else f"room for {self.stage}'s output"
        with self.store.writing(self.stage, need), nullcontext() if self.threads is None else torch_threads(self.threads):
            fields = compute(location)
        ref = self.ref_type(stage=self.stage, key=self.key, created_at=datetime.now(timezone.utc), seconds=time.perf_counter() - start, producer=producer(), **fields)
        return location.write(ref, self.config, self.inputs)


class StageInput(ABC, Generic[R]):
    """Everything one stage is given (its specs, its input refs and the RunStore), as one frozen dataclass that
    travels from the flow to its task, the stage and its jobs; it plans the stage's call once."""

    @abstractmethod
    def plan(self) -> StageCall[R]:
        """The stage's call: its key's config and input refs."""

    @cached_property
    def call(self) -> StageCall[R]:
        return self.plan()
