"""`model.task_class`: the user's own Task, named by dotted path, is what the pipeline trains, attributes and
measures, the same definition the library takes; a path or object that is no Task is refused naming its field."""

from __future__ import annotations

import numpy as np
import pytest

from flows.influence_run import influence_run
from influence_core import ConfigError, DirectInfluence
from tests.helpers import read_outputs, small_params, stored_model_and_data
from tests.plugin_tasks import WeightedClassification

pytestmark = pytest.mark.usefixtures("prefect_api")

WEIGHTS = [1.0, 1.0, 1.0, 4.0, 1.0, 1.0, 1.0, 1.0, 0.25, 1.0]
METHOD = {"name": "direct", "regularization": 1e-2, "second_order_mode": "gauss_newton"}


def test_a_task_class_is_trained_and_attributed_as_the_library_does(tmp_path):
    """The weighted task's scores equal the library's with the same Task (rtol 1e-4), and differ from the built-in
    classification's on the same data."""
    model = {"task_class": "tests.plugin_tasks:WeightedClassification", "task_options": {"weights": WEIGHTS}}
    params = small_params(str(tmp_path / "weighted"), model=model, method=METHOD)
    influence_run(**params.sections())
    group, arrays = read_outputs(params.store())
    trained, data = stored_model_and_data(params.store(), group)
    train = (data["x_train"], data["y_train"])
    task = WeightedClassification(WEIGHTS)
    expected = DirectInfluence(trained, task, 1e-2, second_order_mode="gauss_newton").fit(train).influences(data["x_test"], data["y_test"], *train)
    np.testing.assert_allclose(arrays["scores"], expected.numpy(), rtol=1e-4, atol=1e-4 * float(np.abs(arrays["scores"]).max()))
    plain = DirectInfluence(trained, "cross_entropy", 1e-2, second_order_mode="gauss_newton").fit(train).influences(data["x_test"], data["y_test"], *train)
    assert not np.allclose(arrays["scores"], plain.numpy(), rtol=1e-2)
    assert group.attrs["config"]["model"]["task_class"] == "tests.plugin_tasks:WeightedClassification"


@pytest.mark.parametrize(
    "model, field, words",
    [
        ({"task_class": "tests.plugin_tasks:not_a_task"}, "model.task_class", "returned a object, not an influence_core.task.Task"),
        ({"task_class": "tests.plugin_tasks:Nothing"}, "model.task_class", "cannot load 'tests.plugin_tasks:Nothing'"),
        ({"task_class": "tests.plugin_tasks:WeightedClassification", "task_options": {"scale": 2}}, "model.task_options", "does not take these options"),
    ],
    ids=["not a task", "missing", "bad options"],
)
def test_a_task_class_that_is_no_task_is_refused_before_training(tmp_path, model, field, words):
    params = small_params(str(tmp_path / "bad"), model=model, method=METHOD)
    with pytest.raises(ConfigError) as raised:
        influence_run(**params.sections())
    assert raised.value.field == field and words in str(raised.value)
    assert not (tmp_path / "bad" / "influence.zarr").exists()


def test_a_built_in_measurement_with_a_task_class_is_refused():
    with pytest.raises(ValueError, match="model.measurement: margin is a built-in task's measurement"):
        small_params("unused", model={"task_class": "tests.plugin_tasks:WeightedClassification", "measurement": "margin"})
