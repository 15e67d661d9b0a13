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
from tests.helpers import read_outputs, small_params

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
