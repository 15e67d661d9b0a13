"""Each method's options are declared once, in its library class: the pipeline's specs are derived from them, so
their defaults cannot diverge, and the specs still dump (and so key stages) exactly as before the derivation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from influence_core import CgInfluence, ConfigError, LissaInfluence
from influence_core.methods import METHODS
from influence_core.pipeline import specs

# method.model_dump(mode="json") of each default spec as the hand-written specs gave it at ad59de1: stage keys hash
# these dumps, so any change here would recompute (and re-key) every stored stage.
DUMPS_AT_AD59DE1 = {
    "direct": {"projection": None, "regularization": 0.001, "batch_size": 256, "modules": None, "query_rank": None, "second_order_mode": "gauss_newton", "block_structure": "full", "name": "direct"},
    "cg": {"projection": None, "regularization": 0.001, "batch_size": 256, "modules": None, "query_rank": None, "second_order_mode": "gauss_newton", "block_structure": "full", "name": "cg", "rtol": 1e-06, "maxiter": None, "preconditioner": "none", "preconditioner_rank": 20, "hutchinson_probes": 32, "seed": 0, "block": True},
    "lissa": {"regularization": 0.001, "batch_size": 256, "modules": None, "query_rank": None, "second_order_mode": "gauss_newton", "block_structure": "full", "name": "lissa", "depth": 1000, "repeats": 1, "lissa_batch_size": 64, "scale": 10.0, "damping": 0.0, "rtol": 0.0001, "seed": 0},
    "arnoldi": {"projection": None, "regularization": 0.001, "batch_size": 256, "modules": None, "query_rank": None, "second_order_mode": "gauss_newton", "block_structure": "full", "name": "arnoldi", "rank": 10, "krylov_dim": None, "seed": 0, "complement": False},
    "nystroem": {"projection": None, "regularization": 0.001, "batch_size": 256, "modules": None, "query_rank": None, "second_order_mode": "gauss_newton", "block_structure": "full", "name": "nystroem", "rank": 10, "seed": 0},
    "datainf": {"projection": None, "regularization": 0.001, "batch_size": 256, "modules": None, "query_rank": None, "second_order_mode": "gauss_newton", "block_structure": "layer_wise", "name": "datainf"},
    "identity": {"projection": None, "batch_size": 256, "modules": None, "query_rank": None, "name": "identity"},
    "kfac": {"projection": None, "regularization": 0.001, "batch_size": 256, "modules": None, "query_rank": None, "name": "kfac", "fisher": "auto", "fisher_samples": 1, "seed": 0},
    "ekfac": {"projection": None, "regularization": 0.001, "batch_size": 256, "modules": None, "query_rank": None, "name": "ekfac", "fisher": "auto", "fisher_samples": 1, "seed": 0},
}
TITLES_AT_AD59DE1 = {
    "direct": "Direct (exact; TRAK with a projection)", "cg": "Conjugate gradients", "lissa": "LiSSA", "arnoldi": "Arnoldi", "nystroem": "Nyström sketch",
    "datainf": "DataInf", "identity": "Gradient dot product", "kfac": "K-FAC", "ekfac": "EK-FAC",
}


@pytest.mark.parametrize("name", list(DUMPS_AT_AD59DE1))
def test_default_specs_dump_as_before(name):
    spec = specs.METHOD_SPECS[name]
    dump = spec().model_dump(mode="json")
    assert dump == DUMPS_AT_AD59DE1[name]
    assert list(dump) == list(DUMPS_AT_AD59DE1[name])  # the form shows the fields in this order
    assert spec.model_json_schema()["title"] == TITLES_AT_AD59DE1[name]


def test_set_specs_dump_as_before():
    """Settings away from the defaults (a projection, λ per layer, a Literal) dump as at ad59de1 too."""
    cg = specs.CgMethod(regularization={"0": 0.1, "2": 0.2}, block_structure="layer_wise", preconditioner="nystroem", maxiter=50, projection={"kind": "gaussian", "dim": 32})
    assert cg.model_dump(mode="json") == {
        "projection": {"kind": "gaussian", "dim": 32, "seed": 0, "block_mb": 256.0}, "regularization": {"0": 0.1, "2": 0.2}, "batch_size": 256, "modules": None, "query_rank": None,
        "second_order_mode": "gauss_newton", "block_structure": "layer_wise", "name": "cg", "rtol": 1e-06, "maxiter": 50, "preconditioner": "nystroem",
        "preconditioner_rank": 20, "hutchinson_probes": 32, "seed": 0, "block": True,
    }
    kfac = specs.KfacMethod(projection={"dim": 64}, fisher="sampled", fisher_samples=3, modules=["3"])
    assert kfac.model_dump(mode="json") == {
        "projection": {"kind": "logra", "dim": 64, "seed": 0, "block_mb": 256.0}, "regularization": 0.001, "batch_size": 256, "modules": ["3"], "query_rank": None,
        "name": "kfac", "fisher": "sampled", "fisher_samples": 3, "seed": 0,
    }


def test_registry_is_the_library_list():
    assert list(specs.METHOD_CLASSES) == [method.name for method in METHODS] == list(DUMPS_AT_AD59DE1)
    assert all(specs.METHOD_CLASSES[name] is method for name, method in zip(specs.METHOD_CLASSES, METHODS))


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_defaults_cannot_diverge(method):
    """Every field of the pipeline's spec has the library options' default, and so does the class built bare."""
    spec, options = specs.METHOD_SPECS[method.name](), method.Options()
    for option in dataclasses.fields(method.Options):
        assert getattr(spec, option.name) == getattr(options, option.name), option.name
    assert set(type(spec).model_fields) == {f.name for f in dataclasses.fields(method.Options)} | {"name"}
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    assert method(model, "cross_entropy").options == options


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_spec_bounds_come_from_the_options(method):
    """A bound in the options' metadata is enforced by the spec: batch_size ≥ 1 everywhere."""
    with pytest.raises(ValidationError, match="batch_size"):
        specs.METHOD_SPECS[method.name](batch_size=0)


def test_unknown_option_is_a_config_error():
    model = nn.Linear(3, 2)
    with pytest.raises(ConfigError, match=r"method\.tolerance: cg has no option 'tolerance'\. Fix: use one of .*rtol") as caught:
        CgInfluence(model, "cross_entropy", 1e-3, tolerance=1e-3)
    assert isinstance(caught.value, TypeError)  # what Python raises for an unexpected keyword, as before
    with pytest.raises(ConfigError, match=r"method\.projection: lissa has no option"):
        LissaInfluence(model, "cross_entropy", 1e-3, projection=None)


def test_spec_builds_the_class_with_its_options():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    im = specs.CgMethod(rtol=1e-9, preconditioner="jacobi").build(model, "cross_entropy")
    assert isinstance(im, CgInfluence) and im.options == CgInfluence.Options(rtol=1e-9, preconditioner="jacobi")
    x, y = torch.randn(20, 3, dtype=torch.float64), torch.randint(0, 2, (20,))
    assert set(im.fit((x, y)).state_dict()) == {"all/diagonal"}  # the key stored preconditioners are read back by


@pytest.mark.parametrize("preconditioner, keys", [("jacobi", {"all/diagonal"}), ("nystroem", {"all/eigenvalues", "all/basis"})])
def test_preconditioner_state_keys_and_reload(preconditioner, keys):
    """The preconditioner objects store what CgSolver stored before (so stored states still load), and a reloaded
    state scores bit for bit as the fitted one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(20, 3, dtype=torch.float64), torch.randint(0, 2, (20,))
    fitted = CgInfluence(model, "cross_entropy", 1e-2, preconditioner=preconditioner, preconditioner_rank=4).fit((x, y))
    assert set(fitted.state_dict()) == keys
    loaded = CgInfluence(model, "cross_entropy", 1e-2, preconditioner=preconditioner, preconditioner_rank=4).load_state_dict(fitted.state_dict(), (x, y))
    assert torch.equal(loaded.influences(x[:3], y[:3], x, y), fitted.influences(x[:3], y[:3], x, y))
