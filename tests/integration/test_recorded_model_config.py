"""summary.json and influence.zarr's attributes record only the model fields that apply: a factory's name and
options, not the built-in architecture's settings it replaces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.influence_run import influence_run
from tests.helpers import read_outputs, small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
COMMON = {"loss": "cross_entropy", "task": "auto", "measurement": "loss", "checkpoint": None, "dtype": "float32"}


def test_a_factory_model_records_the_factory_and_not_the_architecture(tmp_path):
    model = {"factory": "tests.plugin_models:dropout_batchnorm_mlp", "options": {"in_features": 64, "classes": 10, "hidden": 8}}
    params = small_params(str(tmp_path / "out"), model=model)
    influence_run(**params.sections())
    group, _ = read_outputs(params.store())
    summary = json.loads((Path(params.store().output_url) / "summary.json").read_text())
    for config in (summary["config"]["model"], group.attrs["config"]["model"]):
        assert config == {**model, **COMMON}


def test_a_built_in_model_records_only_its_architectures_fields():
    """mlp: its widths and activation, no cnn channels or transformer sizes; cnn: its channels and pools, no hidden widths."""
    mlp, cnn = small_params("/tmp/unused").public_config()["model"], small_params("/tmp/unused", model={"architecture": "cnn"}).public_config()["model"]
    assert mlp == {"architecture": "mlp", "hidden": [8], "activation": "tanh", "output_dim": None, **COMMON}
    assert cnn == {"architecture": "cnn", "channels": [8, 16], "activation": "tanh", "pooling": "max", "output_dim": None, **COMMON}
