"""The `python_docs` source (the text of `make demo-text`): byte windows of the standard library's docstrings, and
'prompt|completion' queries whose measurement is the completion's log-probability after the prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flows.influence_run import influence_run
from influence_core import EkfacInfluence
from influence_core.pipeline.store.publish import read_run
from influence_core.task import LanguageModelling
from tests.helpers import read_outputs, small_params, stored_model_and_data

pytestmark = pytest.mark.usefixtures("prefect_api")

QUERIES = ["Return a| list", "Compile a| regular expression"]


def test_prompted_queries_measure_the_completion_and_score_as_the_library(tmp_path):
    """Queries are padded to the window with their labels scored on the completion only; the task's measurement is
    −Σ log p(completion byte | the bytes before it), computed here from the logits; the flow's EK-FAC scores equal the
    library's, and the table shows each query as 'prompt|completion' and each training example as its text."""
    params = small_params(
        str(tmp_path / "text"), dataset={"source": "python_docs", "window": 32, "n_train": 64, "queries": QUERIES, "chunk_rows": 32},
        model={"architecture": "transformer", "task": "language_modelling", "d_model": 16, "heads": 2, "layers": 1},
        training={"epochs": 2, "learning_rate": 3e-3}, method={"name": "ekfac", "regularization": 1e-2, "fisher": "sampled", "batch_size": 64},
    )
    influence_run(**params.sections())
    store = params.store()
    group, arrays = read_outputs(store)
    model, data = stored_model_and_data(store, group)
    x, y = data["x_test"], data["y_test"]
    assert x.dtype == y.dtype == torch.int64 and x.shape == (2, 32)
    text = bytes(x[1, :29].tolist()).decode()
    assert text == "Compile a regular expression" + " " and (y[1, :9] == -100).all() and (y[1, 28:] == -100).all()
    assert bytes(y[1, 9:28].tolist()).decode() == " regular expression"

    with torch.no_grad():
        logits = model(x)
    log_p = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, x[:, 1:, None]).squeeze(-1)
    scored = y[:, 1:] != -100
    expected = -(log_p * scored).sum(1)
    torch.testing.assert_close(LanguageModelling().measurement(logits.double(), y), expected)

    train = (data["x_train"], data["y_train"])
    library = EkfacInfluence(model, LanguageModelling(), 1e-2, fisher="sampled", batch_size=64).fit(train).influences(x, y, *train)
    np.testing.assert_allclose(arrays["scores"], library.numpy(), rtol=1e-5, atol=1e-5 * float(np.abs(arrays["scores"]).max()))

    _, rows = read_run(store, 2, 1)
    assert [row.label for row in rows] == QUERIES
    best = int(arrays["topk_helpful_indices"][1, 0])
    assert rows[1].helpful[0].label == bytes(data["x_train"][best].tolist()).decode(errors="replace").replace("\n", "⏎").replace("\t", " ")  # 32 bytes: not cut


@pytest.mark.parametrize(
    "queries, window, words",
    [(["no bar here"], 64, "is not 'prompt|completion'"), (["a|"], 64, "is not 'prompt|completion'"), (["Return the| absolute value"], 8, "longer than window=8 bytes")],
    ids=["no bar", "empty completion", "too long"],
)
def test_bad_queries_are_refused_naming_the_field(queries, window, words):
    with pytest.raises(ValueError, match="dataset.queries") as raised:
        small_params("unused", dataset={"source": "python_docs", "window": window, "queries": queries})
    assert words in str(raised.value)
