"""Curvature methods, each an `InfluenceFunctionModel`."""

from .influence_model import BlockSolver, InfluenceFunctionModel
from .cg import CgInfluence
from .datainf import DataInfInfluence
from .direct import DirectInfluence
from .identity import IdentityInfluence
from .kfac import EkfacInfluence, KfacInfluence
from .lissa import LissaInfluence
from .lowrank import ArnoldiInfluence, NystroemSketchInfluence

# Every method, in the order the parameter form offers them; adding a method is its file and a line here.
METHODS: tuple[type[InfluenceFunctionModel], ...] = (
    DirectInfluence,
    CgInfluence,
    LissaInfluence,
    ArnoldiInfluence,
    NystroemSketchInfluence,
    DataInfInfluence,
    IdentityInfluence,
    KfacInfluence,
    EkfacInfluence,
)

__all__ = [
    "ArnoldiInfluence",
    "BlockSolver",
    "CgInfluence",
    "DataInfInfluence",
    "DirectInfluence",
    "EkfacInfluence",
    "IdentityInfluence",
    "KfacInfluence",
    "InfluenceFunctionModel",
    "LissaInfluence",
    "METHODS",
    "NystroemSketchInfluence",
]
