"""The locations of one run: its output URL, the stage cache, and the fsspec options to reach them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from . import storage
from .specs import StorageSpec


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
        """`url` relative to the output's root when it lies inside it (so the output can be moved or copied), else as is."""
        root = self.output_url.rstrip("/") + "/"
        return url.removeprefix(root) if url.startswith(root) else url

    def resolve(self, url: str) -> str:
        """The inverse of `relative`: a relative URL is taken from the output's root; an absolute one stays."""
        return url if storage.is_absolute(url) else storage.join(self.output_url, url)

    def check(self) -> None:
        """Fail early when a bucket is missing or unreachable."""
        storage.check_writable(self.output_url, self.options, "output_url")
        if self.storage.cache_url:
            storage.check_writable(self.cache_url, self.options, "storage.cache_url")
