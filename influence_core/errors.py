"""Errors that tell the user which setting is wrong and how to fix it."""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

LIBRARIES = tuple({sysconfig.get_paths()[kind] for kind in ("stdlib", "platstdlib", "purelib", "platlib")} | {str(Path(__file__).parent)})


class ConfigError(ValueError):
    """Bad input, found before (or instead of) expensive work; never worth retrying.

    `field` is the dotted name of the offending setting, e.g. ``aggregate.top_k``.
    """

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")

    def __reduce__(self) -> tuple:
        """Rebuilt from its three parts, so a refusal raised in a Dask worker reaches the driver whole (the default
        pickling passes the one formatted message to __init__, which takes three)."""
        return _rebuild, (type(self), self.field, self.problem, self.fix)


def _rebuild(cls: type[ConfigError], field: str, problem: str, fix: str) -> ConfigError:
    """A ConfigError (or subclass, whose own __init__ formats other arguments) from the parts it stored."""
    error = cls.__new__(cls)
    ConfigError.__init__(error, field, problem, fix)
    return error


class NumericalError(RuntimeError):
    """A solver or factorisation failed for numerical reasons (indefinite curvature, divergence)."""


class RegularizationError(ConfigError, NumericalError):
    """λ too small for the curvature in force: a numerical failure whose fix is a setting, so it reads as bad input
    (one line naming `method.regularization` and a value that works) and is never retried."""

    def __init__(self, problem: str, lam: float, suggested: float, mode: str | None = None, also: str = "") -> None:
        other = " or second_order_mode: gauss_newton (positive semi-definite)" if mode == "hessian" else ""
        super().__init__("method.regularization", f"{problem} (λ={lam:g})", f"set method.regularization to {suggested:.1e} or more{other}{also}")


def raised(exc: BaseException) -> str:
    """`Type: message (at file:line)`, one line: an exception of the user's code (a model factory, a forward pass, a
    dataset), placed at its innermost frame outside the libraries and this package (else its innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [frame for frame in frames if not frame.filename.startswith(LIBRARIES)]
    where = (own or frames)[-1:]
    message = " ".join(str(exc).split())[:300]
    at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    return f"{type(exc).__name__}: {message}{at}"
