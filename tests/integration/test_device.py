"""`compute.device` (issue "own model", item 7): the model, the curvature state, the query factors and the scores
compute on the device it names (cuda with cluster: cuda by default). No GPU is lent to this suite, so the path is
run with the device set explicitly to the CPU, and a CUDA request on a machine without one is refused up front."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flows.influence_run import influence_run
from influence_core import ConfigError
from influence_core.pipeline.specs import ComputeSpec
from tests.helpers import read_outputs, small_params, stored_model_and_data

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_the_device_follows_the_cluster_unless_named():
    assert ComputeSpec().torch_device == "cpu" and ComputeSpec(cluster="sequential").torch_device == "cpu"
    assert ComputeSpec(device="cuda").torch_device == "cuda"
    assert ComputeSpec(device="cpu", cluster="address", address="tcp://127.0.0.1:1").torch_device == "cpu"


@pytest.mark.parametrize("method", [{"name": "ekfac", "regularization": 1e-3}, {"name": "cg", "regularization": 1e-3, "rtol": 1e-5}], ids=["ekfac", "cg"])
def test_an_explicit_device_gives_the_bits_of_the_default(tmp_path, method):
    """Training, the curvature (K-FAC's factor blocks as tasks), the query factors and the scores on the named device
    (here the CPU) give exactly the default run's arrays, with a different run fingerprint kept out of the way."""
    runs = {}
    for name, compute in (("default", {}), ("named", {"device": "cpu"})):
        params = small_params(str(tmp_path / name), method=method, compute={"cluster": "sequential", "train_chunk_rows": 64, **compute})
        influence_run(**params.sections())
        runs[name] = read_outputs(params.store())[1]
    assert runs["default"].keys() == runs["named"].keys()
    for array, values in runs["default"].items():
        np.testing.assert_array_equal(values, runs["named"][array], err_msg=array)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the request would be honoured")
def test_cuda_without_a_gpu_is_refused_before_anything_runs(tmp_path):
    params = small_params(str(tmp_path / "cuda"), compute={"cluster": "sequential", "device": "cuda"})
    with pytest.raises(ConfigError) as raised:
        influence_run(**params.sections())
    assert raised.value.field == "compute.device" and "no CUDA device is visible" in str(raised.value)
    assert not (tmp_path / "cuda").exists() or not any((tmp_path / "cuda").iterdir())


def _has_dask_cuda() -> bool:
    try:
        import dask_cuda  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not torch.cuda.is_available() or not _has_dask_cuda(), reason="needs a CUDA device and the gpu extra (dask-cuda)")
@pytest.mark.parametrize(
    ("model", "method"),
    [
        ({"hidden": [16]}, {"name": "ekfac", "regularization": 1e-3}),
        ({"hidden": [16]}, {"name": "cg", "regularization": 1e-3, "rtol": 1e-10}),
        ({"architecture": "cnn", "channels": [4, 8]}, {"name": "ekfac", "regularization": 1e-3}),
    ],
    ids=["mlp-ekfac", "mlp-cg", "cnn-ekfac"],
)
def test_cluster_cuda_gives_the_cpu_scores(tmp_path, model, method):
    """cluster: cuda (dask-cuda's LocalCUDACluster, everything on the GPU) scores the same float64 checkpoint of a
    model of (1, 8, 8) digit images as a local CPU cluster does, to float64 rounding: the device changes where the
    work runs, not what it computes."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    np.savez(tmp_path / "images.npz", x_train=(x[:240] / 16).reshape(-1, 1, 8, 8), y_train=y[:240], x_test=(x[240:252] / 16).reshape(-1, 1, 8, 8), y_test=y[240:252])
    dataset = {"source": "npz", "path": str(tmp_path / "images.npz"), "chunk_rows": 64}
    spec = {**model, "dtype": "float64"}
    trained = small_params(str(tmp_path / "trained"), dataset=dataset, model=spec, compute={"cluster": "sequential", "train_chunk_rows": 64})
    influence_run(**trained.sections())
    group, _ = read_outputs(trained.store())
    weights, _ = stored_model_and_data(trained.store(), group)
    torch.save(weights.state_dict(), tmp_path / "model.pt")
    runs = {}
    for name, compute in (("cpu", {"cluster": "local", "n_workers": 1, "device": "cpu"}), ("cuda", {"cluster": "cuda"})):
        params = small_params(str(tmp_path / name), dataset=dataset, model={**spec, "checkpoint": str(tmp_path / "model.pt")}, method=method, compute={"train_chunk_rows": 64, **compute})
        influence_run(**params.sections())
        runs[name] = read_outputs(params.store())[1]
    assert runs["cpu"].keys() == runs["cuda"].keys()
    for array in ("scores", "self_influence", "train_totals"):
        cpu, cuda = runs["cpu"][array], runs["cuda"][array]
        np.testing.assert_allclose(cuda, cpu, rtol=1e-7, atol=1e-9 * np.abs(cpu).max(), err_msg=array)
    np.testing.assert_array_equal(runs["cuda"]["topk_helpful_indices"], runs["cpu"]["topk_helpful_indices"])
