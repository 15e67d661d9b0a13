"""Content records of stored objects, so that no damaged byte is ever used.

A stage output is recorded object by object (every chunk and metadata document of a Zarr node, every file) as
[size, store stamp, sha256 of its bytes], by path relative to the output's folder. Checking it costs one listing: an
object that is missing, of another size, or whose stamp moved (an ETag on S3; modification time, change time and
inode on a local disk) is read and hashed again, and must hash to what was recorded. A deep check hashes every
object. Files the pipeline writes and reads back (state dicts, plans, FAISS indexes) carry their sha256 beside them
(`name.sha256`) and are checked on every read. Zarr arrays checksum each chunk besides (`storage.create_array`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from . import storage
from ...errors import ConfigError

SIDECAR = ".sha256"
Entry = list  # [size, stamp, sha256]: JSON keeps it a list


class DamagedError(ConfigError):
    """A stored byte that does not match its record: refused in one line naming what is damaged and how to repair it."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_checked(url: str, data: bytes, options: dict[str, Any]) -> str:
    """Write a file and its sha256 beside it (the digest last: a file without one is incomplete). Returns the digest."""
    digest = sha256(data)
    storage.write_bytes(url, data, options)
    storage.write_bytes(url + SIDECAR, digest.encode(), options)
    return digest


def read_checked(url: str, options: dict[str, Any], field: str, fix: str) -> bytes:
    """A file written by `write_checked`, its bytes checked against its sha256. FileNotFoundError when it is absent;
    DamagedError (naming `field` and `fix`) when its digest is missing or differs."""
    raw = storage.read_bytes(url, options)
    try:
        expected = storage.read_bytes(url + SIDECAR, options).decode(errors="replace").strip()
    except FileNotFoundError:
        raise DamagedError(field, f"{url} has no {SIDECAR} record (written incompletely, or not by this pipeline)", fix) from None
    if sha256(raw) != expected:
        raise DamagedError(field, f"{url} is damaged (its sha256 differs from the one recorded when it was written)", fix)
    return raw


@contextmanager
def chunk_reads(field: str, what: str, fix: str) -> Iterator[None]:
    """Reads of checksummed Zarr chunks: a chunk whose bytes fail zarr's crc32c becomes one DamagedError line."""
    try:
        yield
    except ValueError as exc:
        if "checksum" not in str(exc):
            raise
        raise DamagedError(field, f"a chunk of {what} is damaged (zarr's crc32c of its bytes differs)", fix) from None


def file_keys(name: str) -> list[str]:
    """The objects of a checked file: the file and its digest."""
    return [name, name + SIDECAR]


def record(base: str, keys: Iterable[str], options: dict[str, Any], vouched: dict[str, Entry] | None = None) -> dict[str, Entry]:
    """[size, stamp, sha256] of the objects `keys` (paths relative to `base`): the sha256 taken from `vouched` where
    its size and stamp are still those recorded there (a chunk task's marker), else read and hashed here."""
    vouched = vouched or {}
    recorded: dict[str, Entry] = {}
    for key in sorted(keys):
        url = storage.join(base, key)
        stat = storage.object_stat(url, options)
        if stat is None:
            raise FileNotFoundError(url)
        known = vouched.get(key)
        if known is not None and (known[0], known[1]) == stat:
            recorded[key] = [stat[0], stat[1], known[2]]
        else:
            recorded[key] = [stat[0], stat[1], sha256(storage.read_bytes(url, options))]
    return recorded


def record_listed(base: str, roots: Iterable[str], options: dict[str, Any], vouched: dict[str, Entry] | None = None) -> dict[str, Entry]:
    """`record` of every object under each of `roots` (paths relative to `base`: a Zarr node, or a file)."""
    keys = []
    for root in roots:
        keys += [storage.join(root, name) if name else root for name in storage.object_stats(storage.join(base, root), options)]
    return record(base, keys, options, vouched)


def problems(base: str, recorded: dict[str, Entry], options: dict[str, Any], deep: bool = False, present: dict[str, tuple[int, str]] | None = None) -> list[str]:
    """What no longer matches the record, one phrase per object (empty: intact). One listing of `base` (or `present`,
    that listing made already); an object whose size and stamp are unchanged is trusted unless `deep`, which hashes
    every object."""
    present = storage.object_stats(base, options) if present is None else present
    found = []
    for key, (size, stamp, digest) in sorted(recorded.items()):
        stat = present.get(key)
        if stat is None:
            found.append(f"{key} is missing")
        elif stat[0] != size:
            found.append(f"{key} has {stat[0]} bytes, not the {size} recorded")
        elif (deep or stat[1] != stamp) and sha256(storage.read_bytes(storage.join(base, key), options)) != digest:
            found.append(f"{key} holds other bytes than recorded (sha256 differs)")
    return found


def content_digest(recorded: dict[str, Entry]) -> str:
    """One digest of the whole output's content: its objects' names and sha256s (not their stamps or location)."""
    return sha256(json.dumps(sorted((key, entry[2]) for key, entry in recorded.items())).encode())[:24]


def read_markers(urls: list[str], options: dict[str, Any]) -> dict[str, dict[str, Entry]]:
    """The JSON records at `urls` by URL (fetched together); an unreadable one is left out (its chunk is redone)."""
    if not urls:
        return {}
    fs, _ = storage.filesystem(urls[0], options)
    paths = {storage.filesystem(url, options)[1]: url for url in urls}
    try:
        raw = fs.cat(list(paths), on_error="omit")
    except FileNotFoundError:
        return {}
    found = {}
    for path, data in raw.items():
        try:
            parsed = json.loads(data)
        except ValueError:
            continue
        if isinstance(parsed, dict) and all(isinstance(entry, list) and len(entry) == 3 for entry in parsed.values()):
            found[paths[path]] = parsed
    return found
