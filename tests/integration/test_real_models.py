"""Real models end to end (issue "own model", item 6): transformers' GPT-2 through the CLI on a local Dask cluster
(EK-FAC), a BERT sequence classifier (CG) and a ResNet-style CNN with BatchNorm (EK-FAC and CG) through the flow on
a Dask cluster by address, each trained by the pipeline and scored as the library scores the same stored model."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from flows.influence_run import influence_run
from influence_core import CgInfluence, EkfacInfluence
from influence_core.pipeline.store.publish import read_run
from influence_core.task import LanguageModelling
from tests.helpers import read_outputs, small_params, stored_model_and_data

pytest.importorskip("transformers", reason="transformers is in the dev extra")
pytestmark = pytest.mark.usefixtures("prefect_api")

EKFAC = {"name": "ekfac", "regularization": 1e-2, "fisher": "sampled", "batch_size": 64}
CG = {"name": "cg", "regularization": 1e-2, "rtol": 1e-6, "second_order_mode": "gauss_newton", "batch_size": 64}


def byte_windows(n: int, width: int) -> np.ndarray:
    """Windows of `width` bytes of text that ships with Python (json's docstring), as int64 token ids."""
    text = textwrap.dedent(json.__doc__ or "").encode()
    starts = np.linspace(0, len(text) - width - 1, n).astype(int)
    return np.stack([np.frombuffer(text[s : s + width], dtype=np.uint8) for s in starts]).astype(np.int64)


def library_scores(method: dict, model, task, data):  # type: ignore[no-untyped-def]
    """The library's scores of the stored model on the stored arrays, with the run's method settings."""
    train = (data["x_train"], data["y_train"])
    options = {k: v for k, v in method.items() if k not in ("name", "regularization")}
    cls = EkfacInfluence if method["name"] == "ekfac" else CgInfluence
    return cls(model, task, method["regularization"], **options).fit(train).influences(data["x_test"], data["y_test"], *train).numpy()


def assert_scores_equal(scores: np.ndarray, expected: np.ndarray) -> None:
    assert np.isfinite(scores).all() and np.abs(scores).max() > 0
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-5 * float(np.abs(scores).max()))


def test_gpt2_through_the_cli_on_a_local_cluster_equals_the_library(tmp_path):
    """A 2-layer GPT-2 (n_embd 64, byte vocabulary) trained two epochs by fit_model, EK-FAC over its Conv1D
    projections (the tied lm_head left out), scored on a 2-worker LocalCluster; the summary lists what was attributed."""
    tokens = byte_windows(72, 16)
    np.savez(tmp_path / "bytes.npz", x_train=tokens[:64], y_train=tokens[:64], x_test=tokens[64:], y_test=tokens[64:])
    params = small_params(
        str(tmp_path / "gpt2"), dataset={"source": "npz", "path": str(tmp_path / "bytes.npz"), "chunk_rows": 16},
        model={"factory": "tests.plugin_models:gpt2_lm", "options": {"n_positions": 16}, "task": "language_modelling"},
        training={"epochs": 2, "learning_rate": 1e-3, "batch_size": 16}, method=EKFAC, compute={"cluster": "local", "n_workers": 2, "train_chunk_rows": 16},
    )
    config = tmp_path / "gpt2.yaml"
    config.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["run", "--config", str(config)], terminal_width=200)
    assert result.exit_code == 0, result.output
    group, arrays = read_outputs(params.store())
    model, data = stored_model_and_data(params.store(), group)
    assert_scores_equal(arrays["scores"], library_scores(EKFAC, model, LanguageModelling(), data))
    summary = json.loads((tmp_path / "gpt2" / "summary.json").read_text())
    assert summary["parameters"]["captured"]["tensors"] == 16  # 8 Conv1D projections, weight and bias each
    assert "model.transformer.wte.weight" in summary["parameters"]["excluded"]["names"]
    _, rows = read_run(params.store(), 1, 1)  # a language model's examples read as text, the query as its window
    assert rows[0].label == bytes(data["y_test"][0].tolist()).decode(errors="replace").replace("\n", "⏎").replace("\t", " ")


def test_bert_classifier_through_the_flow_equals_the_library(tmp_path, dask_address):
    """A 2-layer BERT sequence classifier with CG on the Gauss-Newton curvature, on a Dask cluster by address."""
    tokens = byte_windows(56, 12)
    labels = tokens[:, 0] % 3
    np.savez(tmp_path / "classes.npz", x_train=tokens[:44], y_train=labels[:44], x_test=tokens[44:], y_test=labels[44:])
    params = small_params(
        str(tmp_path / "bert"), dataset={"source": "npz", "path": str(tmp_path / "classes.npz"), "chunk_rows": 16},
        model={"factory": "tests.plugin_models:bert_classifier"}, training={"epochs": 2, "learning_rate": 1e-3},
        method=CG, compute={"cluster": "address", "address": dask_address, "train_chunk_rows": 16},
    )
    influence_run(**params.sections())
    group, arrays = read_outputs(params.store())
    model, data = stored_model_and_data(params.store(), group)
    assert_scores_equal(arrays["scores"], library_scores(CG, model, "cross_entropy", data))


@pytest.mark.parametrize("method", [EKFAC, CG], ids=["ekfac", "cg"])
def test_resnet_with_batchnorm_through_the_flow_equals_the_library(tmp_path, dask_address, method):
    """A ResNet-style CNN (convolution stem, a residual block, BatchNorm, global pooling) on digits, in eval mode."""
    params = small_params(
        str(tmp_path / method["name"]), model={"factory": "tests.plugin_models:resnet"}, training={"epochs": 2},
        method=method, compute={"cluster": "address", "address": dask_address, "train_chunk_rows": 64},
    )
    influence_run(**params.sections())
    group, arrays = read_outputs(params.store())
    model, data = stored_model_and_data(params.store(), group)
    assert not model.training
    assert_scores_equal(arrays["scores"], library_scores(method, model, "cross_entropy", data))
