"""The built-in `transformer` architecture through the flow: a causal byte-level language model (EK-FAC) and an
encoder classifier (CG), each scored as the library scores the same stored model; bad token ids and a width that
does not split into heads are refused naming their field, before anything is trained."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import torch

from flows.influence_run import influence_run
from influence_core import CgInfluence, ConfigError, EkfacInfluence
from influence_core.pipeline.store.publish import read_run
from influence_core.pipeline.model.transformer import TokenTransformer
from influence_core.task import LanguageModelling
from tests.helpers import read_outputs, small_params, stored_model_and_data

pytestmark = pytest.mark.usefixtures("prefect_api")

WINDOW = 12
MODEL = {"architecture": "transformer", "d_model": 16, "heads": 2, "layers": 1}


def byte_windows(n: int) -> np.ndarray:
    """Windows of WINDOW bytes of text that ships with Python (json's docstring), as int64 token ids."""
    text = textwrap.dedent(json.__doc__ or "").encode()
    starts = np.linspace(0, len(text) - WINDOW - 1, n).astype(int)
    return np.stack([np.frombuffer(text[s : s + WINDOW], dtype=np.uint8) for s in starts]).astype(np.int64)


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory) -> str:
    tokens = byte_windows(60)
    path = tmp_path_factory.mktemp("tokens") / "bytes.npz"
    np.savez(path, x_train=tokens[:48], y_train=tokens[:48], x_test=tokens[48:], y_test=tokens[48:])
    return str(path)


def run(tmp_path, name: str, dataset: dict, model: dict, method: dict):  # type: ignore[no-untyped-def]
    params = small_params(str(tmp_path / name), dataset=dataset, model=model, method=method, training={"epochs": 3, "learning_rate": 3e-3})
    influence_run(**params.sections())
    store = params.store()
    group, arrays = read_outputs(store)
    model_, data = stored_model_and_data(store, group)
    return arrays, model_, data, store


def test_causal_language_model_scores_equal_the_library(tmp_path, lm_data):
    """Task language_modelling builds a causal LM ((B, T, 256) logits; a later token never changes earlier logits),
    and the pipeline's EK-FAC scores equal the library's on the stored model (rtol 1e-5)."""
    method = {"name": "ekfac", "regularization": 1e-2, "fisher": "sampled", "batch_size": 64}
    arrays, model, data, store = run(tmp_path, "lm", {"source": "npz", "path": lm_data, "chunk_rows": 16}, {**MODEL, "task": "language_modelling"}, method)
    scores = arrays["scores"]
    assert isinstance(model, TokenTransformer) and model.causal
    x = data["x_test"][:2]
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    with torch.no_grad():
        logits, logits_changed = model(x), model(changed)
    assert logits.shape == (2, WINDOW, 256)
    torch.testing.assert_close(logits[:, :-1], logits_changed[:, :-1], rtol=0, atol=0)
    assert not torch.equal(logits[:, -1], logits_changed[:, -1])
    train = (data["x_train"], data["y_train"])
    expected = EkfacInfluence(model, LanguageModelling(), 1e-2, fisher="sampled", batch_size=64).fit(train).influences(data["x_test"], data["y_test"], *train)
    assert scores.shape == (12, 48) and np.isfinite(scores).all()
    np.testing.assert_allclose(scores, expected.numpy(), rtol=1e-5, atol=1e-5 * float(np.abs(scores).max()))

    _, rows = read_run(store, 2, 1)  # the table `show` prints and the artifact holds: the examples as text
    as_text = lambda ids: bytes(ids.tolist()).decode().replace("\n", "⏎")  # noqa: E731
    assert rows[0].label == as_text(data["y_test"][0])
    assert rows[1].helpful[0].label == as_text(data["y_train"][int(arrays["topk_helpful_indices"][1, 0])])


def test_encoder_classifier_scores_equal_the_library(tmp_path):
    """Any other task builds a bidirectional encoder, mean-pooled to (B, classes); CG scores equal the library's."""
    tokens = byte_windows(56)
    labels = (tokens[:, 0] % 3).astype(np.int64)  # a label readable from the first byte
    path = tmp_path / "classes.npz"
    np.savez(path, x_train=tokens[:44], y_train=labels[:44], x_test=tokens[44:], y_test=labels[44:])
    method = {"name": "cg", "regularization": 1e-2, "rtol": 1e-8, "second_order_mode": "gauss_newton", "batch_size": 64}
    arrays, model, data, _ = run(tmp_path, "encoder", {"source": "npz", "path": str(path), "chunk_rows": 16}, MODEL, method)
    scores = arrays["scores"]
    assert isinstance(model, TokenTransformer) and not model.causal
    assert model(data["x_test"]).shape == (12, 3)
    train = (data["x_train"], data["y_train"])
    expected = CgInfluence(model, "cross_entropy", 1e-2, rtol=1e-8, second_order_mode="gauss_newton", batch_size=64).fit(train).influences(data["x_test"], data["y_test"], *train)
    np.testing.assert_allclose(scores, expected.numpy(), rtol=1e-5, atol=1e-5 * float(np.abs(scores).max()))


def test_token_ids_beyond_the_vocabulary_are_refused_naming_the_field(tmp_path, lm_data):
    params = small_params(str(tmp_path / "vocab"), dataset={"source": "npz", "path": lm_data}, model={**MODEL, "task": "language_modelling", "vocab_size": 100})
    with pytest.raises(ConfigError) as raised:
        influence_run(**params.sections())
    assert raised.value.field == "model.vocab_size" and "not a token id in [0, 100)" in str(raised.value)
    assert not (tmp_path / "vocab" / "influence.zarr").exists()


def test_a_width_that_does_not_split_into_heads_is_refused():
    with pytest.raises(ValueError, match="model.heads: d_model=10 does not split into 4 heads"):
        small_params("unused", model={**MODEL, "d_model": 10, "heads": 4})
