"""Numbers that cannot mean anything are refused where they are first seen (issue 52): a bool, a fractional float or
a NaN/infinity in a number field of the parameters; a λ that is not finite, or that swamps the fitted curvature; a
model whose forward pass is random (for MAGIC's replay) or cannot take one example alone (every per-example
gradient)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from pydantic import ValidationError
from torch import nn

from flows.messages import validation_lines
from flows.parameters import RunParameters
from influence_core import (
    ArnoldiInfluence, CgInfluence, ConfigError, DataInfInfluence, DirectInfluence, EkfacInfluence, KfacInfluence, LissaInfluence, NystroemSketchInfluence,
)
from influence_core.magic import check_deterministic, metagradients
from influence_core.task import Classification
from influence_core.training import AdamRecipe
from tests.plugin_models import random_forward


# -- the parameters ------------------------------------------------------------------------------------------------
def number_fields() -> Iterator[tuple[str, dict[str, Any], str, str]]:
    """Every number field of the run form, read from its JSON schema (what Prefect's server and UI see): (section, the
    variant's tag, field name, 'integer', 'number' or 'integer items')."""
    schema = RunParameters.model_json_schema()
    defs = schema["$defs"]
    for section, prop in schema["properties"].items():
        refs = [prop["$ref"]] if "$ref" in prop else [option["$ref"] for option in prop.get("anyOf", []) if "$ref" in option]
        for ref in refs:
            variant = defs[ref.split("/")[-1]]
            tag = {name: field["const"] for name, field in variant["properties"].items() if "const" in field}
            for name, field in variant["properties"].items():
                types = {option.get("type") for option in field.get("anyOf", [field])}
                if "integer" in types:
                    yield section, tag, name, "integer"
                elif "number" in types:
                    yield section, tag, name, "number"
                elif field.get("items", {}).get("type") == "integer":
                    yield section, tag, name, "integer items"


FIELDS = sorted({(section, json.dumps(tag), name, kind) for section, tag, name, kind in number_fields()})
BAD = {"integer": [True, False, 2.5], "number": [True, math.nan, math.inf, -math.inf, "inf"], "integer items": [[True], [2.5]]}


@pytest.mark.parametrize("section, tag, name, kind", FIELDS, ids=[f"{s}.{json.loads(t).get('name') or json.loads(t).get('source') or ''}.{n}" for s, t, n, _ in FIELDS])
def test_a_bool_a_fraction_or_a_non_finite_number_is_never_a_number(section, tag, name, kind):
    for value in BAD[kind]:
        with pytest.raises(ValidationError) as refused:
            RunParameters.model_validate({section: {**json.loads(tag), name: value}})
        errors = [err for err in refused.value.errors() if err["loc"][-1] == name]
        assert [err["type"] for err in errors] == ["number_wanted"], (value, refused.value.errors())
        wanted = errors[0]["ctx"]["wanted"]
        assert wanted.startswith("a whole number" if kind != "number" else "a finite number"), wanted


def test_the_field_list_covers_the_form():
    names = {(section, name) for section, _, name, _ in FIELDS}
    assert {("aggregate", "top_k"), ("method", "regularization"), ("method", "maxiter"), ("model", "hidden"), ("training", "learning_rate"), ("compute", "index_side")} <= names
    assert len(FIELDS) > 60


@pytest.mark.parametrize("value, line", [
    (".nan", "method.regularization: Input should be a finite number ≥ 0. Fix: set method.regularization to a finite number ≥ 0"),
    (".inf", "method.regularization: Input should be a finite number ≥ 0. Fix: set method.regularization to a finite number ≥ 0"),
    ("{'0': 1.0e-3, '2': .nan}", "method.regularization: Input should be a finite number ≥ 0. Fix: set method.regularization to a finite number ≥ 0"),
])
def test_a_lambda_that_is_not_finite_names_what_is_wanted(value, line):
    config = yaml.safe_load(f"method: {{name: direct, block_structure: layer_wise, regularization: {value}}}")
    with pytest.raises(ValidationError) as refused:
        RunParameters.model_validate(config)
    assert validation_lines(refused.value, RunParameters) == [line]


def test_top_k_true_is_refused_not_read_as_one():
    with pytest.raises(ValidationError) as refused:
        RunParameters.model_validate(yaml.safe_load("aggregate: {top_k: true}"))
    assert validation_lines(refused.value, RunParameters) == ["aggregate.top_k: Input should be a whole number ≥ 1. Fix: set aggregate.top_k to a whole number ≥ 1"]


def test_yaml_and_json_integers_still_work():
    from_yaml = RunParameters.model_validate(yaml.safe_load("aggregate: {top_k: 3}\nmethod: {name: cg, maxiter: 50, regularization: 1.0e-2}\nmodel: {hidden: [8, 4]}"))
    from_json = RunParameters.model_validate_json('{"aggregate": {"top_k": 3}, "method": {"name": "cg", "maxiter": 50.0, "regularization": 0}, "model": {"hidden": [8, 4]}}')
    for params in (from_yaml, from_json):
        assert params.aggregate.top_k == 3 and params.method.maxiter == 50 and params.model.hidden == [8, 4]  # type: ignore[union-attr]
        assert type(params.aggregate.top_k) is int and type(params.method.maxiter) is int  # type: ignore[union-attr]


# -- λ in the library ----------------------------------------------------------------------------------------------
def problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A small untrained MLP in float64 and its data."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (24,), generator=gen)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).double(), x, y


@pytest.mark.parametrize("lam", [math.inf, math.nan, {"0": 1e-3, "2": math.inf}])
def test_the_library_refuses_a_lambda_that_is_not_finite(lam):
    model, _, _ = problem()
    structure = {"block_structure": "layer_wise"} if isinstance(lam, dict) else {}
    with pytest.raises(ConfigError, match=r"^method.regularization: direct got λ=(inf|nan) for block .* Fix: use a finite number ≥ 0"):
        DirectInfluence(model, "cross_entropy", lam, **structure)


def largest_gauss_newton_eigenvalue(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The reference: the largest eigenvalue of the mean loss's Gauss-Newton matrix (1/n) Σ Jᵢᵀ (diag(pᵢ) − pᵢpᵢᵀ) Jᵢ,
    from the Jacobians of the logits by torch.func, eigenvalues by torch.linalg.eigvalsh."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    jacobians = torch.func.vmap(torch.func.jacrev(lambda p, xi: torch.func.functional_call(model, p, (xi[None],))[0]), in_dims=(None, 0))(params, x)
    j = torch.cat([jacobians[name].reshape(len(x), 3, -1) for name in params], dim=2)  # (n, classes, p)
    probs = F.softmax(model(x), dim=1).detach()
    output_hessian = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
    matrix = torch.einsum("nop,noq,nqr->pr", j, output_hessian, j) / len(x)
    return float(torch.linalg.eigvalsh(matrix)[-1])


METHODS = {
    "direct": lambda m, lam: DirectInfluence(m, "cross_entropy", lam),
    "cg": lambda m, lam: CgInfluence(m, "cross_entropy", lam),
    "lissa": lambda m, lam: LissaInfluence(m, "cross_entropy", lam, depth=50),
    "arnoldi": lambda m, lam: ArnoldiInfluence(m, "cross_entropy", lam, rank=27, krylov_dim=27),
    "nystroem": lambda m, lam: NystroemSketchInfluence(m, "cross_entropy", lam, rank=27),
    "datainf": lambda m, lam: DataInfInfluence(m, "cross_entropy", lam),
    "kfac": lambda m, lam: KfacInfluence(m, "cross_entropy", lam),
    "ekfac": lambda m, lam: EkfacInfluence(m, "cross_entropy", lam),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_a_lambda_that_swamps_the_fitted_curvature_is_refused(name):
    """λ = 1e12 × the largest curvature eigenvalue leaves (C + λI)⁻¹ = I/λ (λ=1e300: every score 0 in float32): refused
    when fitted, naming method.regularization and a bound; 10 × that eigenvalue (heavy damping, still meaningful) fits."""
    model, x, y = problem()
    top = largest_gauss_newton_eigenvalue(model, x, y)
    for lam in (1e12 * top, 1e300):
        with pytest.raises(ConfigError) as refused:
            METHODS[name](model, lam).fit((x, y))
        assert refused.value.field == "method.regularization" and "swamps the curvature" in refused.value.problem
        assert "set method.regularization below" in refused.value.fix and "\n" not in str(refused.value)
    im = METHODS[name](model, 10 * top).fit((x, y))
    assert bool(torch.isfinite(im.influences(x[:2], y[:2], x, y)).all())


@pytest.mark.parametrize("name", ["direct", "arnoldi"])
def test_the_bound_is_above_the_largest_eigenvalue(name):
    """Direct's ‖C‖_F bounds the largest eigenvalue from above; Arnoldi at full rank finds it."""
    model, x, y = problem()
    top = largest_gauss_newton_eigenvalue(model, x, y)
    scale = METHODS[name](model, 1e-3).fit((x, y)).solvers["all"].curvature_scale()
    assert scale >= top * (1 - 1e-9)
    if name == "arnoldi":
        assert scale == pytest.approx(top, rel=1e-8)


# -- models ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dropout", "noise"])
def test_a_random_forward_pass_is_refused_before_any_replay(kind):
    torch.manual_seed(0)
    x, y, model = torch.randn(16, 4), torch.randint(0, 3, (16,)), random_forward(4, 3, kind)
    before = torch.random.get_rng_state()
    with pytest.raises(ConfigError, match=r"^model: its forward pass in training mode is random: .* Fix: set every dropout probability to 0"):
        check_deterministic(model, x)
    assert torch.equal(torch.random.get_rng_state(), before)  # the probe leaves the random state as it was
    with pytest.raises(ConfigError, match="training mode is random"):
        metagradients(random_forward(4, 3, kind), Classification(), AdamRecipe(1, 8, 1e-2, 0.0, 0), x, y, x[:2], y[:2])


def test_a_deterministic_forward_pass_is_accepted_and_left_in_its_mode():
    torch.manual_seed(0)
    model = random_forward(4, 3, "none").eval()
    check_deterministic(model, torch.randn(16, 4))
    assert not model.training


@pytest.mark.parametrize("method", [DirectInfluence, KfacInfluence])
def test_batch_norm_without_running_statistics_is_refused_in_one_line(method):
    """Such a norm normalises each example by its batch, so one example alone, as per-example gradients take it, has
    no loss of its own: refused at fit, naming the module and the fix; with running statistics the same model fits."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    for running in (False, True):
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, track_running_stats=running), nn.Tanh(), nn.Linear(8, 3))
        if running:
            method(model, "cross_entropy", 1e-2).fit((x, y))
            continue
        with pytest.raises(ConfigError, match=r"^model: its forward pass fails on one example alone .*batch norm \['1'\] keeps no running statistics.* Fix: keep batch norm's running statistics"):
            method(model, "cross_entropy", 1e-2).fit((x, y))
