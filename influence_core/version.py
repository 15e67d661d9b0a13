"""Package version and the code version that enters every stage's cache key."""

from __future__ import annotations

import hashlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    __version__ = version("influence-pipeline")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"


def _source_digest() -> str:
    """Hash of the library's own source, so any code change invalidates cached stages."""
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


CODE_VERSION = f"{__version__}+{_source_digest()}"
