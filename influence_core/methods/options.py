"""Typed method options, declared once: each method's dataclass is its keyword API, and the pipeline derives its
parameter form (titles, descriptions, bounds, defaults) from the same fields, so the two cannot diverge.

Option groups shared by several methods are dataclasses of their own; a method's options inherit the groups it
takes and add its own fields. Field metadata carries `title`, `description` and numeric bounds (`ge`, `gt`, `lt`,
`le`), which apply to every number in the field's type (each λ of a per-layer dict, say).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..blocks import BlockStructure, Regularization
from ..curvature import SecondOrderMode
from ..errors import ConfigError
from ..projection import Projection


def option(default: Any, title: str, description: str, **bounds: float) -> Any:
    """A dataclass field with its default, its form title and description, and its numeric bounds."""
    return dataclasses.field(default=default, metadata={"title": title, "description": description, **bounds})


@dataclass(frozen=True, kw_only=True)
class MethodOptions:
    """What every method takes: how many examples per batch, which modules, and the query factors' rank."""

    batch_size: int = option(256, "Batch size", "Examples per vectorised gradient or curvature product; bounds memory.", ge=1)
    modules: list[str] | None = option(None, "Modules", "Restrict influence to these modules' parameters (names as in model.named_modules(), e.g. the last layers); empty: all.")
    query_rank: int | None = option(
        None, "Query factor rank",
        "Keep each query's preconditioned gradient per Linear/Conv2d layer as a rank-r product (Kronfluence's query_gradient_low_rank): "
        "less memory, and r·(out+in) instead of out·in per scored pair when that is smaller. Empty: full rank. Not with a projection or arnoldi.",
        ge=1,
    )


@dataclass(frozen=True, kw_only=True)
class DampedOptions:
    """λ, added to the curvature."""

    regularization: Regularization = option(
        1e-3, "λ (damping)", "Added to the curvature: scores use (C + λI)⁻¹. A number, or one per layer (a dict keyed by module name) with block_structure=layer_wise.", ge=0,
    )


@dataclass(frozen=True, kw_only=True)
class ProjectedOptions:
    """An optional gradient projection (methods that support one)."""

    projection: Projection | None = option(None, "Gradient projection", "Compress gradients to a few coordinates per layer (TRAK, LoGra); the curvature is then taken in the projected space.")


@dataclass(frozen=True, kw_only=True)
class CurvatureOptions(MethodOptions, DampedOptions):
    """Methods that work on the model's curvature: which curvature, and how it is split into blocks."""

    second_order_mode: SecondOrderMode = option("gauss_newton", "Curvature", "hessian: exact Hessian of the mean loss; gauss_newton: its positive semi-definite Gauss-Newton part.")
    block_structure: BlockStructure = option("full", "Blocks", "full: the whole curvature; layer_wise: block-diagonal, one block per layer.")


GROUPS: tuple[type, ...] = (MethodOptions, DampedOptions, ProjectedOptions, CurvatureOptions)


def group_fields() -> set[str]:
    """Names of the fields the shared groups declare (a method's own fields follow them)."""
    return {f.name for group in GROUPS for f in dataclasses.fields(group)}


class UnknownOption(ConfigError, TypeError):
    """A keyword the method does not take: a ConfigError naming it, and the TypeError Python raises for one."""


def parse_options(options_class: type[MethodOptions], method: str, given: dict[str, Any]) -> MethodOptions:
    """The options of `method` from keyword arguments; an unknown keyword is a ConfigError naming it."""
    known = {f.name for f in dataclasses.fields(options_class)}
    for key in given:
        if key not in known:
            raise UnknownOption(f"method.{key}", f"{method} has no option {key!r}", f"use one of {', '.join(sorted(known))}")
    return options_class(**given)
