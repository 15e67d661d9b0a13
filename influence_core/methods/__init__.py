"""Curvature methods, each an `InfluenceFunctionModel`."""

from .influence_model import BlockSolver, InfluenceFunctionModel
from .cg import CgInfluence
from .datainf import DataInfInfluence
from .direct import DirectInfluence
from .identity import IdentityInfluence
from .kfac import EkfacInfluence, KfacInfluence
from .lissa import LissaInfluence
from .lowrank import ArnoldiInfluence, NystroemSketchInfluence

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
    "NystroemSketchInfluence",
]
