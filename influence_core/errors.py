"""Errors that tell the user which setting is wrong and how to fix it."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad input, found before (or instead of) expensive work; never worth retrying.

    `field` is the dotted name of the offending setting, e.g. ``aggregate.top_k``.
    """

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")


class NumericalError(RuntimeError):
    """A solver or factorisation failed for numerical reasons (indefinite curvature, divergence)."""
