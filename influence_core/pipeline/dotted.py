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


def make_from(path: str, options: dict[str, Any], field: str, options_field: str, expected: type, kind: str, fix: str) -> Any:
    """Call the callable `path` names with `options` and check it made an `expected` (`kind` names it); errors name
    `field`, or `options_field` for options it does not take. User code (a model factory, a task class) runs here."""
    make = load_attribute(path, field)
    try:
        made = make(**options)
    except TypeError as exc:
        raise ConfigError(options_field, f"{path} does not take these options ({exc})", f"give the keyword arguments {path} accepts") from None
    if not isinstance(made, expected):
        raise ConfigError(field, f"{path} returned a {type(made).__name__}, not {kind}", fix)
    return made
