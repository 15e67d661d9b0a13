"""`aggregate.token_scores`: each query's top-k helpful and harmful passages scored per training token, stored as
(n_test, k, T) float32 beside the top-k, equal to the library's per-token scores of those rows (an independent
EK-FAC fitted here), summing to the stored scores (as `verify` checks), read back by `show --tokens`."""

from __future__ import annotations

import numpy as np
import pytest

from flows.influence_run import influence_run
from flows.parameters import RunParameters
from influence_core import EkfacInfluence
from influence_core.errors import ConfigError
from influence_core.projection import Projection
from influence_core.pipeline.store.publish import read_run
from influence_core.pipeline.report.verify import verify_run
from influence_core.task import LanguageModelling
from tests.helpers import read_outputs, small_params, stored_model_and_data

pytestmark = pytest.mark.usefixtures("prefect_api")

QUERIES = ["Return a| list", "Compile a| regular expression"]


@pytest.mark.parametrize("projection", [None, {"kind": "logra", "dim": 16}], ids=["ekfac", "ekfac+logra"])
def test_top_k_token_scores_equal_the_library_and_sum_to_the_scores(tmp_path, projection):
    params = small_params(
        str(tmp_path / "text"), dataset={"source": "python_docs", "window": 32, "n_train": 64, "queries": QUERIES, "chunk_rows": 32},
        model={"architecture": "transformer", "task": "language_modelling", "d_model": 16, "heads": 2, "layers": 1},
        training={"epochs": 2, "learning_rate": 3e-3}, method={"name": "ekfac", "regularization": 1e-2, "fisher": "sampled", "batch_size": 64, "projection": projection},
        aggregate={"top_k": 3, "report_queries": 2, "token_scores": True},
    )
    influence_run(**params.sections())
    store = params.store()
    group, arrays = read_outputs(store)
    model, data = stored_model_and_data(store, group)
    train = (data["x_train"], data["y_train"])
    library = EkfacInfluence(model, LanguageModelling(), 1e-2, fisher="sampled", batch_size=64, projection=projection and Projection(**projection)).fit(train).influences(data["x_test"], data["y_test"], *train, per_token=True)
    scale = float(np.abs(library.numpy()).max())
    for kind in ("helpful", "harmful"):
        stored, indices = arrays[f"topk_{kind}_token_scores"], arrays[f"topk_{kind}_indices"]
        assert stored.shape == (2, 3, 32) and stored.dtype == np.float32
        expected = library.numpy()[np.arange(2)[:, None], indices]
        np.testing.assert_allclose(stored, expected, rtol=1e-4, atol=1e-5 * scale)
        sums = stored.astype(np.float64).sum(2)
        np.testing.assert_allclose(sums, arrays[f"topk_{kind}_scores"], rtol=1e-4, atol=1e-4 * np.abs(stored).sum(2).max())
    checks = {check.name: check for check in verify_run(store)}
    assert checks["topk_helpful_token_scores"].ok and checks["topk_harmful_token_scores"].ok and all(c.ok for c in checks.values())

    _, rows = read_run(store, 2, 2)
    pieces = rows[1].helpful[0].tokens
    best = int(arrays["topk_helpful_indices"][1, 0])
    assert "".join(text for text, _ in pieces) == rows[1].helpful[0].label  # 32 bytes of ASCII docstrings: one char per token
    assert [score for _, score in pieces] == pytest.approx(arrays["topk_helpful_token_scores"][1, 0].tolist())
    assert best == rows[1].helpful[0].index


def test_token_scores_of_a_classifier_are_refused_before_any_stage(tmp_path):
    with pytest.raises(ConfigError, match=r"^aggregate.token_scores: per-token scores split a language model's scores .* the task is classification. Fix: .*model.task: language_modelling"):
        RunParameters.from_sections(output_url=str(tmp_path / "digits"), aggregate={"top_k": 2, "token_scores": True})


def test_cg_is_refused_before_training_naming_method_modules_and_runs_with_the_modules_named(tmp_path):
    """cg attributes every parameter: position embeddings and norms take vmap gradients, without positions. Refused
    after prepare_data, before any training, naming method.modules and the layers that split; with those, the run's
    per-token scores sum to its scores (`verify`)."""
    settings = {
        "dataset": {"source": "python_docs", "window": 16, "n_train": 32, "n_test": 2, "chunk_rows": 32},
        "model": {"architecture": "transformer", "task": "language_modelling", "d_model": 8, "heads": 2, "layers": 1},
        "training": {"epochs": 1}, "aggregate": {"top_k": 2, "report_queries": 2, "token_scores": True},
    }
    params = small_params(str(tmp_path / "text"), method={"name": "cg", "regularization": 1e-2}, **settings)
    with pytest.raises(ConfigError) as refused:
        influence_run(**params.sections())
    assert refused.value.field == "method.modules" and "positions.weight" in refused.value.problem
    assert not (tmp_path / "text" / "stages" / "fit_model").exists()
    modules = refused.value.fix.split("[")[1].split("]")[0].split(", ")
    assert modules == ["tokens", "blocks.0.attention.query", "blocks.0.attention.key", "blocks.0.attention.value", "blocks.0.attention.out", "blocks.0.up", "blocks.0.down", "head"]
    named = small_params(str(tmp_path / "text"), method={"name": "cg", "regularization": 1e-2, "modules": modules}, **settings)
    influence_run(**named.sections())
    checks = {check.name: check for check in verify_run(named.store())}
    assert checks["topk_helpful_token_scores"].ok and all(c.ok for c in checks.values())
