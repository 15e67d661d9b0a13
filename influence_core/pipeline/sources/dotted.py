"""User code named by a dotted path, `package.module:attribute` (a dataset or model factory)."""

from __future__ import annotations

import importlib
import re
from typing import Any

from ...errors import ConfigError, raised

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
    except Exception as exc:  # the user's code failed: one line, and never retried
        if isinstance(exc, TypeError) and exc.__traceback__ is not None and exc.__traceback__.tb_next is None:  # raised by the call itself: the options
            raise ConfigError(options_field, f"{path} does not take these options ({exc})", f"give the keyword arguments {path} accepts") from None
        raise user_error(field, path, exc, f"correct {path}; it is called as {path}(**{options_field})") from None
    if not isinstance(made, expected):
        raise ConfigError(field, f"{path} returned a {type(made).__name__}, not {kind}", fix)
    return made


def user_error(field: str, path: str, exc: BaseException, fix: str) -> ConfigError:
    """An exception raised by the user's code that `path` names, as the one line `field: path raised Type: message
    (at file:line). Fix: ...`."""
    return ConfigError(field, f"{path} raised {raised(exc)}", fix)
