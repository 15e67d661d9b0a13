"""The user's own model through the pipeline's stages: `model.factory` with `model.options`, a .safetensors
checkpoint, influence in eval mode (Dropout and BatchNorm deterministic), the task's measurement, and a model whose
outputs do not fit the task refused before training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from influence_core import ConfigError, DirectInfluence
from influence_core.pipeline.runtime.cluster import dask_client
from influence_core.pipeline.stages import preconditioner, prepare, query_factors, training
from influence_core.pipeline.score import scoring
from influence_core.pipeline.score.score_input import ScoringInput
from influence_core.task import Classification
from influence_core.pipeline.store.loading import load_model, open_data
from tests.helpers import read_outputs, small_params
from tests.plugin_models import dropout_batchnorm_mlp

FACTORY = "tests.plugin_models:dropout_batchnorm_mlp"
OPTIONS = {"in_features": 64, "classes": 10, "hidden": 12}
METHOD = {"name": "direct", "regularization": 1e-2, "second_order_mode": "gauss_newton"}


def run_stages(params):  # type: ignore[no-untyped-def]
    """Every stage of a run, on the sequential cluster; returns the store and the model and data refs."""
    store, threads = params.store(), params.compute.torch_threads
    client = lambda: dask_client(params.compute, False)  # noqa: E731
    data = prepare.run(prepare.PrepareInput(params.dataset, store))
    model = training.run(training.TrainingInput(params.model, params.training, data, store, threads))
    curvature = preconditioner.run(preconditioner.PreconditionerInput(params.method, model, data, store, params.compute), client)
    facts = query_factors.run(query_factors.QueryFactorsInput(params.method, model, data, curvature, store, threads))
    scoring.run(ScoringInput(params.compute, params.method, params.aggregate, model, data, curvature, facts, store), client)
    return store, model, data


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A trained state_dict of the factory's model (running BatchNorm statistics included), as .safetensors."""
    torch.manual_seed(0)
    model = dropout_batchnorm_mlp(**OPTIONS)
    x = torch.randn(256, 64)
    model(x)  # one train-mode pass: non-trivial running statistics
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)


def test_factory_model_with_dropout_and_batchnorm_scores_the_same_twice(tmp_path, checkpoint):
    """Two runs of a Dropout + BatchNorm model loaded from .safetensors give bit-identical scores (influence is taken
    in eval mode), equal to the library's on the eval-mode model; with measurement: margin, the queries' scores are
    the margin's, as the library's Classification('margin') computes them."""
    model_spec = {"factory": FACTORY, "options": OPTIONS, "checkpoint": checkpoint}
    runs = [small_params(str(tmp_path / f"run{i}"), model=model_spec, method=METHOD) for i in range(2)]
    results = [run_stages(params) for params in runs]
    first, second = (read_outputs(store)[1]["scores"] for store, _, _ in results)
    np.testing.assert_array_equal(first, second)
    store, model_ref, data_ref = results[0]
    model = load_model(model_ref, store.options)
    arrays = {name: torch.from_numpy(np.asarray(a[...])) for name, a in open_data(data_ref, store.options).items()}
    assert not model.training and any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    train = (arrays["x_train"], arrays["y_train"])
    expected = DirectInfluence(model, "cross_entropy", 1e-2, second_order_mode="gauss_newton").fit(train).influences(arrays["x_test"], arrays["y_test"], *train)
    np.testing.assert_allclose(first, expected.numpy(), rtol=1e-4, atol=1e-4 * float(np.abs(first).max()))

    margin = small_params(str(tmp_path / "margin"), model={**model_spec, "measurement": "margin"}, method=METHOD)
    scores = read_outputs(run_stages(margin)[0])[1]["scores"]
    expected = DirectInfluence(model, Classification("margin"), 1e-2, second_order_mode="gauss_newton").fit(train).influences(arrays["x_test"], arrays["y_test"], *train)
    np.testing.assert_allclose(scores, expected.numpy(), rtol=1e-4, atol=1e-4 * float(np.abs(scores).max()))
    assert not np.allclose(scores, first, rtol=1e-2)


@pytest.mark.parametrize(
    "options, field, words",
    [
        ({**OPTIONS, "classes": 5}, "model.options", ("does not fit the classification task", "5 columns", "up to 9")),
        ({**OPTIONS, "width": 3}, "model.options", ("does not take these options", "width")),
    ],
    ids=["too few outputs", "unknown option"],
)
def test_factory_model_that_does_not_fit_is_refused_before_training(tmp_path, options, field, words):
    """A factory whose model cannot be scored by the task, or that refuses its options, fails fit_model before any
    training step, naming model.options; nothing of the stage is written as complete."""
    params = small_params(str(tmp_path / "run"), model={"factory": FACTORY, "options": options}, training={"epochs": 500})
    store = params.store()
    data = prepare.run(prepare.PrepareInput(params.dataset, store))
    with pytest.raises(ConfigError) as info:
        training.run(training.TrainingInput(params.model, params.training, data, store, 1))
    assert info.value.field == field and all(w in str(info.value) for w in words), str(info.value)


def test_unimportable_factory_names_the_field(tmp_path):
    params = small_params(str(tmp_path / "run"), model={"factory": "tests.no_such_module:make"})
    store = params.store()
    data = prepare.run(prepare.PrepareInput(params.dataset, store))
    with pytest.raises(ConfigError, match=r"^model.factory: cannot load 'tests.no_such_module:make'"):
        training.run(training.TrainingInput(params.model, params.training, data, store, 1))


def test_builtin_cnn_on_images_equals_the_library(tmp_path):
    """architecture: cnn on (1, 8, 8) digit images (an npz keeps their shape): trained in fit_model, rebuilt on the
    workers from the stored feature shape, and scored as the library scores the same stored model."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images = (x / 16.0).reshape(-1, 1, 8, 8).astype(np.float32)
    path = tmp_path / "images.npz"
    np.savez(path, x_train=images[:200], y_train=y[:200], x_test=images[200:208], y_test=y[200:208])
    params = small_params(str(tmp_path / "run"), dataset={"source": "npz", "path": str(path), "chunk_rows": 64}, model={"architecture": "cnn", "channels": [4]}, method=METHOD)
    store, model_ref, data_ref = run_stages(params)
    model = load_model(model_ref, store.options)
    assert model_ref.feature_shape == [1, 8, 8] and any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    arrays = {name: torch.from_numpy(np.asarray(a[...])) for name, a in open_data(data_ref, store.options).items()}
    train = (arrays["x_train"], arrays["y_train"])
    expected = DirectInfluence(model, "cross_entropy", 1e-2, second_order_mode="gauss_newton").fit(train).influences(arrays["x_test"], arrays["y_test"], *train)
    scores = read_outputs(store)[1]["scores"]
    np.testing.assert_allclose(scores, expected.numpy(), rtol=1e-4, atol=1e-4 * float(np.abs(scores).max()))


def test_damaged_safetensors_checkpoint_names_the_field(tmp_path):
    """Bytes that are not a .safetensors file are refused naming model.checkpoint, never unpickled."""
    from influence_core.pipeline.model.models import load_state

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x00" * 16)
    with pytest.raises(ConfigError, match=r"^model.checkpoint: .*is not a valid \.safetensors file"):
        load_state(str(path), {})


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_checkpoint_on_s3_gives_the_scores_of_the_local_file(tmp_path, checkpoint, s3_endpoint, s3_bucket, suffix):
    """model.checkpoint may be an s3:// URL (reached through storage.endpoint_url, credentials from the environment):
    a run from the checkpoint copied to S3 scores bit-identically to a run from the local file; a missing object
    is refused naming the field."""
    import s3fs
    from safetensors.torch import load_file

    local = str(tmp_path / f"model{suffix}")
    state = load_file(checkpoint)
    save_file(state, local) if suffix == ".safetensors" else torch.save(state, local)
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).put_file(local, f"{s3_bucket}/ckpt/model{suffix}")
    runs = {
        where: small_params(str(tmp_path / where), model={"factory": FACTORY, "options": OPTIONS, "checkpoint": url}, method=METHOD, storage={"endpoint_url": s3_endpoint})
        for where, url in (("local", local), ("s3", f"s3://{s3_bucket}/ckpt/model{suffix}"))
    }
    scores = {where: read_outputs(run_stages(params)[0])[1]["scores"] for where, params in runs.items()}
    np.testing.assert_array_equal(scores["s3"], scores["local"])
    assert np.abs(scores["local"]).max() > 0

    missing = small_params(str(tmp_path / "missing"), model={"factory": FACTORY, "options": OPTIONS, "checkpoint": f"s3://{s3_bucket}/ckpt/none{suffix}"}, method=METHOD, storage={"endpoint_url": s3_endpoint})
    with pytest.raises(ConfigError, match=r"^model.checkpoint: no checkpoint at 's3://"):
        run_stages(missing)
