"""Package version, the code version that enters every stage's cache key, and the commit the code came from."""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from importlib.metadata import PackageNotFoundError, distribution, version
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


@functools.cache
def source_commit() -> str:
    """The git commit of this source: HEAD of the checkout it runs from (an editable install), else the commit pip
    recorded when installing from a git URL (direct_url.json, PEP 610), else "unknown". Not part of any cache key."""
    root = Path(__file__).resolve().parent.parent
    try:
        found = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True, timeout=10)
        toplevel, commit = found.stdout.split()
        if found.returncode == 0 and Path(toplevel).resolve() == root:  # this source's own checkout, not one it sits in
            return commit
    except (OSError, ValueError, subprocess.TimeoutExpired):  # no git, not a checkout
        pass
    try:
        recorded = json.loads(distribution("influence-pipeline").read_text("direct_url.json") or "{}")
    except (PackageNotFoundError, ValueError):
        recorded = {}
    return recorded.get("vcs_info", {}).get("commit_id", "unknown")
