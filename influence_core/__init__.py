"""influence_core: influence functions for PyTorch models, usable on its own (no Prefect needed).

score[t, i] = ∇ℓ(z_t)ᵀ (H + λI)⁻¹ ∇ℓ(z_i); positive means training example i helped query t.

The methods, `Objective` and `Projection` load on first use (PEP 562), so `influence_core.version` and the errors
import without torch: `influence-pipeline --version` answers at once.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, NumericalError
from .version import CODE_VERSION, __version__

if TYPE_CHECKING:
    from .methods import (
        ArnoldiInfluence,
        CgInfluence,
        DataInfInfluence,
        DirectInfluence,
        EkfacInfluence,
        IdentityInfluence,
        InfluenceFunctionModel,
        KfacInfluence,
        LissaInfluence,
        NystroemSketchInfluence,
    )
    from .objective import Objective
    from .projection import Projection

_LAZY = {
    **dict.fromkeys(
        ["ArnoldiInfluence", "CgInfluence", "DataInfInfluence", "DirectInfluence", "EkfacInfluence", "IdentityInfluence",
         "InfluenceFunctionModel", "KfacInfluence", "LissaInfluence", "NystroemSketchInfluence"],
        ".methods",
    ),
    "Objective": ".objective",
    "Projection": ".projection",
}


def __getattr__(name: str) -> Any:
    """The public classes, imported when first asked for."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


__all__ = ["CODE_VERSION", "ConfigError", "NumericalError", "__version__", *_LAZY]
