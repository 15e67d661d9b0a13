"""User code named by a dotted path, `package.module:attribute` (a dataset or model factory)."""

from __future__ import annotations

import importlib
import re
from typing import Any

from ..errors import ConfigError

DOTTED = re.compile(r"[\w.]+:\w+")


def load_attribute(path: str, field: str) -> Any:
    """The attribute `path` names, imported now; a path that does not import is a ConfigError naming `field`."""
    module_name, _, attribute = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(field, f"cannot load {path!r} ({exc})", "give an importable `package.module:factory`") from None
