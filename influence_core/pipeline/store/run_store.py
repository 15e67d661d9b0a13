"""The locations of one run: its output URL, the stage cache, and the fsspec options to reach them."""

from __future__ import annotations

import errno
from contextlib import contextmanager
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, field_validator

from . import storage
from ...errors import ConfigError
from ..specs import StorageSpec

CACHE_PREFIX = "{cache}/"  # a recorded URL inside a separate stage store (storage.cache_url), relative to its root
UNWRITABLE = {errno.ENOSPC: "full", errno.EDQUOT: "over its quota", errno.EROFS: "read-only", errno.EACCES: "not writable", errno.EPERM: "not writable"}


class RunStore(BaseModel):
    """Output URL plus storage settings; the options never contain credentials."""

    model_config = ConfigDict(frozen=True)

    output_url: str
    storage: StorageSpec = StorageSpec()

    @field_validator("output_url")
    @classmethod
    def _normalise(cls, value: str) -> str:
        return storage.validate_url(value)

    @property
    def options(self) -> dict[str, Any]:
        return self.storage.fsspec_options()

    @property
    def cache_url(self) -> str:
        return storage.validate_url(self.storage.cache_url, "storage.cache_url") if self.storage.cache_url else storage.join(self.output_url, "stages")

    @property
    def influence_url(self) -> str:
        return storage.join(self.output_url, "influence.zarr")

    def url(self, name: str) -> str:
        return storage.join(self.output_url, name)

    def relative(self, url: str) -> str:
        """`url` as recorded in manifests and a run's attributes: relative to the output's root when it lies inside it
        (so the output can be moved or copied), else relative to a separate stage store as `{cache}/...` (so the
        stage store can be moved: pointed at its new place, every manifest still finds its outputs), else as is."""
        for root, prefix in ((self.output_url, ""), (self.cache_url, CACHE_PREFIX)):
            if url.startswith(root.rstrip("/") + "/"):
                return prefix + url[len(root.rstrip("/")) + 1 :]
        return url

    def resolve(self, url: str) -> str:
        """The inverse of `relative`: `{cache}/...` is taken from the stage store, another relative URL from the
        output's root; an absolute one stays."""
        if url.startswith(CACHE_PREFIX):
            return storage.join(self.cache_url, url.removeprefix(CACHE_PREFIX))
        return url if storage.is_absolute(url) else storage.join(self.output_url, url)

    def check(self) -> None:
        """Fail early when a bucket is missing or unreachable."""
        storage.check_writable(self.output_url, self.options, "output_url")
        if self.storage.cache_url:
            storage.check_writable(self.cache_url, self.options, "storage.cache_url")

    def write_failed(self, exc: OSError, writer: str, need: str) -> ConfigError:
        """A write that found the disk full (or read-only) as one line naming the location's field, where it was
        writing, the free space and what is needed. `need` is e.g. "12.0 MB for compute_influences's output"."""
        where = str(exc.filename or "")
        separate_cache = bool(self.storage.cache_url) and where.startswith(self.cache_url)
        field, url = ("storage.cache_url", self.cache_url) if separate_cache else ("output_url", self.output_url)
        free = storage.free_bytes(url)
        place = f"the bucket path {url}" if free is None else f"the disk under {url}"
        room = "" if free is None else f"; {storage.megabytes(free)} free"
        return ConfigError(
            field, f"{place} is {UNWRITABLE.get(exc.errno or 0, 'not writable')} ({exc.strerror or exc} while {writer} wrote{f' {where}' if where else ''}{room})",
            f"free at least {need} there (or make it writable), or point {field} at another disk, then run again (completed stages are kept)",
        )

    @contextmanager
    def writing(self, writer: str, need: str) -> Iterator[None]:
        """Turn a full or read-only disk under this store into `write_failed`'s one line; other errors pass (retried)."""
        try:
            yield
        except OSError as exc:
            if exc.errno in UNWRITABLE:
                raise self.write_failed(exc, writer, need) from None
            raise
