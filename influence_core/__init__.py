"""influence_core: influence functions for PyTorch models, usable on its own (no Prefect needed).

score[t, i] = ∇ℓ(z_t)ᵀ (H + λI)⁻¹ ∇ℓ(z_i); positive means training example i helped query t.
"""

from .errors import ConfigError, NumericalError
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
from .version import CODE_VERSION, __version__

__all__ = [
    "CODE_VERSION",
    "ArnoldiInfluence",
    "CgInfluence",
    "ConfigError",
    "DataInfInfluence",
    "DirectInfluence",
    "EkfacInfluence",
    "IdentityInfluence",
    "InfluenceFunctionModel",
    "KfacInfluence",
    "LissaInfluence",
    "NystroemSketchInfluence",
    "NumericalError",
    "Objective",
    "Projection",
    "__version__",
]
