"""Integer features stay integers (issue "own model", item 3): token ids and pixel counts are stored as int64, and
the built-in architectures read them as their weights' dtype, so the scores are those of the float features."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits

from flows.influence_run import influence_run
from influence_core import DirectInfluence
from tests.helpers import read_outputs, small_params, stored_model_and_data

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_pixel_counts_stay_integers_and_score_as_floats(tmp_path):
    """Digits as uint8 pixel counts (0-16) through npz: x_train is int64 in the store, equal to the source, and the
    flow's scores equal the library's on the same model fed the counts as float32 (rtol 1e-5)."""
    x, y = load_digits(return_X_y=True)
    np.savez(tmp_path / "counts.npz", x=x.astype(np.uint8), y=y)
    params = small_params(str(tmp_path / "run"), dataset={"source": "npz", "path": str(tmp_path / "counts.npz"), "n_train": 240, "n_test": 12, "chunk_rows": 64})
    influence_run(**params.sections())
    group, arrays = read_outputs(params.store())
    model, data = stored_model_and_data(params.store(), group)
    assert str(data["x_train"].dtype) == str(data["x_test"].dtype) == "torch.int64"
    assert int(data["x_train"].max()) == 16 and set(np.unique(data["x_train"].numpy())) <= set(range(17))
    train = (data["x_train"].float(), data["y_train"])
    expected = DirectInfluence(model, "cross_entropy", 1e-3, second_order_mode="gauss_newton").fit(train).influences(data["x_test"].float(), data["y_test"], *train)
    np.testing.assert_allclose(arrays["scores"], expected.numpy(), rtol=1e-5, atol=1e-5 * float(np.abs(arrays["scores"]).max()))
