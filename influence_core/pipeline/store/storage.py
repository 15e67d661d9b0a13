"""Where results live: local paths or s3:// URLs, opened through fsspec and Zarr v3."""

from __future__ import annotations

import hashlib
import itertools
import json
import posixpath
import shutil
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import fsspec
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec
from zarr.storage import FsspecStore, LocalStore

from ...errors import ConfigError

REMOTE_SCHEMES = ("s3",)


def scheme(url: str) -> str:
    """The URL's scheme; '' for a plain local path."""
    return url.split("://", 1)[0] if "://" in url else ""


def validate_url(url: str, field: str = "output_url") -> str:
    """Accept local paths, file:// and s3:// URLs; name the field and the fix otherwise."""
    kind = scheme(url)
    if kind not in ("", "file", *REMOTE_SCHEMES):
        raise ConfigError(field, f"unsupported scheme {kind!r} in {url!r}", "use a local path, file:///path or s3://bucket/prefix")
    if kind in REMOTE_SCHEMES and not url.split("://", 1)[1].strip("/"):
        raise ConfigError(field, f"{url!r} names no bucket", "use s3://bucket/prefix")
    if kind in REMOTE_SCHEMES:
        return url.rstrip("/")
    return str(Path(url.removeprefix("file://")).expanduser().absolute())


def join(url: str, *parts: str) -> str:
    """Append path parts to a local path or URL."""
    return posixpath.join(url, *parts)


def is_absolute(url: str) -> bool:
    """A URL with a scheme or a rooted local path; anything else is relative to some root."""
    return bool(scheme(url)) or url.startswith("/")


def is_remote(url: str) -> bool:
    return scheme(url) in REMOTE_SCHEMES


def filesystem(url: str, options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """A synchronous fsspec filesystem and the path inside it."""
    fs, path = fsspec.core.url_to_fs(url, **(options if is_remote(url) else {}))
    return fs, path


def zarr_store(url: str, options: dict[str, Any], read_only: bool = False) -> zarr.abc.store.Store:
    """A Zarr store for the URL; for S3, FsspecStore.from_url builds the asynchronous filesystem zarr needs."""
    if is_remote(url):
        return FsspecStore.from_url(url, storage_options=options, read_only=read_only)
    return LocalStore(validate_url(url), read_only=read_only)


def open_group(url: str, options: dict[str, Any], mode: str = "a") -> zarr.Group:
    return zarr.open_group(store=zarr_store(url, options, read_only=mode == "r"), mode=mode)


CHECKSUM = Crc32cCodec()  # zarr v3's crc32c, last in every stored array's codecs: a damaged chunk fails its read


def create_array(group: zarr.Group, name: str, **kwargs: Any) -> zarr.Array:
    """`group.create_array` with each chunk's bytes checksummed (zarr's crc32c codec after any compressor: a chunk
    cut short or overwritten with other bytes fails the read that decodes it) and every chunk written, also one
    equal to the fill value, so a missing chunk object always means damage. `compressors=None` stores the bytes
    raw (then checksummed); left out, zstd as zarr's default."""
    compressors = kwargs.pop("compressors", (ZstdCodec(level=0),))
    kept = [] if compressors is None else list(compressors if isinstance(compressors, (list, tuple)) else [compressors])
    config = {"write_empty_chunks": True, **kwargs.pop("config", {})}
    return group.create_array(name, compressors=(*kept, CHECKSUM), config=config, **kwargs)


def open_array(url: str, options: dict[str, Any], mode: str = "r") -> zarr.Array:
    parent, name = url.rsplit("/", 1)
    group = open_group(parent, options, mode="r" if mode == "r" else "a")
    node = group[name]
    assert isinstance(node, zarr.Array)
    return node


def chunk_keys(array: zarr.Array, axis: int, index: int) -> list[str]:
    """The store keys (relative to the array's folder) of the chunks (shards, for a sharded array) whose coordinate
    on `axis` is `index`, every other axis over its whole grid: what one task writes when tasks tile that axis."""
    meta = array.metadata
    grid = [range(-(-size // chunk)) for size, chunk in zip(meta.shape, meta.chunk_grid.chunk_shape)]
    grid[axis] = range(index, index + 1)
    return [meta.encode_chunk_key(coords) for coords in itertools.product(*grid)]


def write_bytes(url: str, data: bytes, options: dict[str, Any]) -> None:
    fs, path = filesystem(url, options)
    fs.mkdirs(posixpath.dirname(path), exist_ok=True)
    fs.pipe_file(path, data)


def read_bytes(url: str, options: dict[str, Any]) -> bytes:
    fs, path = filesystem(url, options)
    return fs.cat_file(path)


def write_json(url: str, obj: Any, options: dict[str, Any]) -> None:
    write_bytes(url, json.dumps(obj, indent=2, sort_keys=True, default=str).encode(), options)


def read_json(url: str, options: dict[str, Any]) -> Any:
    return json.loads(read_bytes(url, options))


def exists(url: str, options: dict[str, Any]) -> bool:
    fs, path = filesystem(url, options)
    return bool(fs.exists(path))


def remove(url: str, options: dict[str, Any]) -> None:
    """Delete a file or a directory tree if present."""
    fs, path = filesystem(url, options)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def list_names(url: str, options: dict[str, Any]) -> list[str]:
    """Base names of the entries under a directory or prefix; empty when it does not exist."""
    fs, path = filesystem(url, options)
    try:
        return [posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


PROBE_TIMEOUT = 3.0  # seconds: a preflight fails fast instead of after botocore's 60 s connect timeout and retries


def check_writable(url: str, options: dict[str, Any], field: str = "output_url", endpoint_field: str = "storage.endpoint_url") -> None:
    """Fail in seconds, naming the field, when the location cannot be written: no S3 credentials, a closed endpoint,
    a missing bucket, or a read-only directory. Writes one probe file and removes it, so nothing is left behind."""
    check_reachable(url, options, field, endpoint_field)
    fs, path = filesystem(url, options)
    if not is_remote(url):
        path = _existing_ancestor(Path(path), field)  # probe where the run would create its directory; create nothing
    probe = posixpath.join(path, f".write-probe-{uuid.uuid4().hex}")
    try:
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except OSError as exc:
        raise ConfigError(field, f"cannot write to {url!r} ({exc.strerror or exc})", f"point {field} at a writable location, or make it writable") from None


def check_reachable(url: str, options: dict[str, Any], field: str, endpoint_field: str = "storage.endpoint_url") -> None:
    """Fail in seconds, naming the field, when an S3 location cannot be reached (no credentials, a closed endpoint, a
    missing bucket) instead of after botocore's retries; a local path needs no probe."""
    if is_remote(url):
        _check_s3(url, options, field, endpoint_field)


def free_bytes(url: str) -> int | None:
    """Free space on the local disk that holds (or would hold) `url`; None for object stores, which do not fill up."""
    if is_remote(url):
        return None
    path = Path(validate_url(url))
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def megabytes(size: int) -> str:
    return f"{size / 2**20:,.1f} MB"


def _existing_ancestor(path: Path, field: str) -> str:
    """The directory itself, or the nearest parent that exists (where the run would create it)."""
    while not path.exists():
        path = path.parent
    if not path.is_dir():
        raise ConfigError(field, f"{str(path)!r} is a file, not a directory", f"point {field} at a directory")
    return str(path)


def _check_s3(url: str, options: dict[str, Any], field: str, endpoint_field: str) -> None:
    """Credentials in the environment, an endpoint that answers, and an existing bucket; each cheap."""
    import botocore.session

    bucket = url.split("://", 1)[1].split("/", 1)[0]
    endpoint = options.get("client_kwargs", {}).get("endpoint_url")
    if not options.get("anon") and botocore.session.get_session().get_credentials() is None:
        raise ConfigError(
            field,
            f"no S3 credentials to reach bucket {bucket!r}",
            "export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) where the flow runs; never put them in parameters",
        )
    if endpoint:
        _check_endpoint(endpoint, endpoint_field)
    where = endpoint or "the default AWS endpoint"
    fs, _ = filesystem(url, {**options, "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}})  # a wrong endpoint fails in seconds
    try:
        found = fs.exists(bucket)
    except PermissionError as exc:
        raise ConfigError(field, f"access to bucket {bucket!r} at {where} was denied ({exc})", "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment") from None
    except OSError as exc:
        raise ConfigError(field, f"cannot reach bucket {bucket!r} at {where} ({exc})", "check storage.endpoint_url and the network") from None
    if not found:
        raise ConfigError(field, f"S3 bucket {bucket!r} does not exist at {where}", f"create it (e.g. `aws s3 mb s3://{bucket} --endpoint-url {where}`) or point {field} at an existing bucket")


def _check_endpoint(endpoint: str, field: str) -> None:
    """A TCP connection to the endpoint within PROBE_TIMEOUT seconds; `field` names where the endpoint was given."""
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=PROBE_TIMEOUT).close()
    except OSError as exc:
        raise ConfigError(field, f"nothing answers at {endpoint} ({exc.strerror or exc})", f"start the S3 service there, or correct {field}") from None


def _stamp(info: dict[str, Any]) -> str:
    """What changes when an object is rewritten: its ETag on S3; on a local disk its modification and change times
    and inode (the change time moves even when a copy keeps the old modification time: `cp -p`, `rsync -t`)."""
    if info.get("ETag") or info.get("LastModified"):
        return str(info.get("ETag") or info.get("LastModified"))
    return f"{info.get('mtime')}:{info.get('created')}:{info.get('ino')}"


def object_stats(url: str, options: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """Size and stamp of every object under a directory or prefix, by path relative to it (one listing), or of the
    file itself under the key ""; empty when absent."""
    fs, path = filesystem(url, options)
    root = path.rstrip("/")
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    if not found and fs.isfile(root):
        found = {root: fs.info(root)}
    return {name[len(root) :].lstrip("/"): (int(info["size"]), _stamp(info)) for name, info in found.items() if name == root or name.startswith(root + "/")}


def object_stat(url: str, options: dict[str, Any]) -> tuple[int, str] | None:
    """Size and stamp of one object, without reading it; None when it is gone."""
    fs, path = filesystem(url, options)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    return int(info["size"]), _stamp(info)


HASH_BLOCK = 8 * 2**20  # bytes read per step when hashing a file: memory stays flat for any file size


def content_token(url: str, options: dict[str, Any]) -> str:
    """A digest of the content of the file, or of every file under the directory, with their relative names: S3
    objects by their ETag and version (the store's own content digest, nothing downloaded), local files by a
    streamed sha256 of their bytes. A file replaced by other bytes of the same size and modification time (`cp -p`,
    `rsync -t`, an archive with fixed stamps) changes it."""
    fs, path = filesystem(url, options)
    entries = fs.find(path, detail=True) if fs.isdir(path) else {path: fs.info(path)}
    digest = hashlib.sha256()
    for name, info in sorted(entries.items()):
        relative = name[len(path) :].lstrip("/")
        if is_remote(url):
            token = f"{info.get('ETag')}:{info.get('VersionId') or ''}:{info.get('size')}"
        else:
            token = file_sha256(name, fs)
        digest.update(f"{relative}\0{token}\0".encode())
    return digest.hexdigest()[:24]


def file_sha256(path: str, fs: fsspec.AbstractFileSystem) -> str:
    """sha256 of one file's bytes, read in HASH_BLOCK steps, the next block read while this one is hashed (both
    release the GIL): a cold read costs about the slower of the disk and the hash, not their sum."""
    digest = hashlib.sha256()
    with fs.open(path, "rb") as handle, ThreadPoolExecutor(max_workers=1) as reader:
        ahead = reader.submit(handle.read, HASH_BLOCK)
        while block := ahead.result():
            ahead = reader.submit(handle.read, HASH_BLOCK)
            digest.update(block)
    return digest.hexdigest()
