"""Damaged Zarr metadata: a `zarr.json` that is truncated, garbage or not Zarr v3 metadata anywhere in a hierarchy.

`show` and `verify` name it, a stage output holding it counts as incomplete (`stage.output_intact`), and a rerun
repairs the output before writing into it: a damaged array is removed (its stage computes it again), a damaged
root group gets fresh metadata and keeps its arrays (each array carries its stage's fingerprint, so whatever no
longer belongs to the run is recomputed and pruned).
"""

from __future__ import annotations

import json
from typing import Any

from zarr.core.group import GroupMetadata
from zarr.core.metadata.v3 import ArrayV3Metadata

from . import storage

METADATA = "zarr.json"


def _check(raw: bytes) -> None:
    """Raise ValueError unless `raw` is the metadata of a Zarr v3 array or group."""
    try:
        meta = json.loads(raw)
        kind = meta.get("node_type") if isinstance(meta, dict) else None
        if kind == "array":
            ArrayV3Metadata.from_dict(dict(meta))
        elif kind == "group" and meta.get("zarr_format") == 3:
            GroupMetadata.from_dict(dict(meta))
        else:
            raise ValueError("not the metadata of a Zarr v3 array or group")
    except ValueError:
        raise
    except Exception as exc:  # zarr's parsers raise TypeError, KeyError, ... for malformed fields
        raise ValueError(f"{type(exc).__name__}: {exc}") from None


def damaged_nodes(url: str, options: dict[str, Any]) -> dict[str, str]:
    """Nodes of the hierarchy at `url` whose metadata cannot be read, by path relative to it ('' is the root), with
    why. One listing and one small read per node; empty when the hierarchy is sound or absent."""
    fs, path = storage.filesystem(url, options)
    root = path.rstrip("/")
    try:
        names = [name for name in fs.find(root) if name.rsplit("/", 1)[-1] == METADATA]
    except FileNotFoundError:
        return {}
    damaged = {}
    for name in sorted(names):
        node = name[len(root) :].removesuffix(METADATA).strip("/")
        try:
            _check(fs.cat_file(name))
        except ValueError as exc:
            damaged[node] = str(exc).splitlines()[0][:160]
    return damaged


def describe(url: str, damaged: dict[str, str]) -> str:
    """One phrase naming the first damaged node, e.g. "influence.zarr/scores/zarr.json is damaged (Expecting ...)"."""
    node, why = next(iter(damaged.items()))
    where = storage.join(url.rstrip("/").rsplit("/", 1)[-1], node, METADATA) if node else storage.join(url.rstrip("/").rsplit("/", 1)[-1], METADATA)
    more = f", and {len(damaged) - 1} more" if len(damaged) > 1 else ""
    return f"{where} is damaged ({why}){more}"


def repair(url: str, options: dict[str, Any]) -> dict[str, str]:
    """Remove every node with damaged metadata; a damaged root gets fresh, empty group metadata and keeps its
    children. Returns what was damaged."""
    damaged = damaged_nodes(url, options)
    for node in damaged:
        storage.remove(storage.join(url, node) if node else storage.join(url, METADATA), options)
    if "" in damaged:
        storage.open_group(url, options, mode="a")  # writes group metadata; the children stay
    return damaged
