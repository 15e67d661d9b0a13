"""CG's query blocks are Dask tasks spread over the cluster's workers: the same blocks and bits as the sequential
run, the solution Direct's exact solve gives, and the workers' progress lines in the driver's logs."""

from __future__ import annotations

import logging
import os
import re

import numpy as np
import pytest

from flows.influence_run import influence_run
from influence_core import solvers
from influence_core.pipeline.stages import query_factors
from influence_core.pipeline.store import storage
from influence_core.pipeline.runtime.cluster import dask_client
from influence_core.pipeline.store.publish import stored_refs
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.specs import ComputeSpec
from tests.helpers import read_outputs, small_params, stored_model_and_data

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.filterwarnings("ignore:Logger .influence_core.solvers. attempted to send logs:UserWarning")]  # the stage runs outside a flow here
SYSTEMS = re.compile(r"^block CG: iteration \d+ of at most \d+ \(method\.maxiter\), \d+ of (\d+) systems above tolerance")


def test_cg_query_blocks_run_on_the_workers_with_the_sequential_bits_and_report_progress_to_the_driver(tmp_path, dask_address, caplog, monkeypatch):
    """40 queries: blocks of 16, 16 and 8 (at least 16 rows, MIN_TASKS blocks at most), solved sequentially by the
    flow and then as tasks on a 2-worker LocalCluster."""
    params = small_params(str(tmp_path / "run"), dataset={"n_train": 240, "n_test": 40, "chunk_rows": 64}, method={"name": "cg", "regularization": 1e-3, "rtol": 1e-8}, aggregate={"top_k": 4, "self_influence": "off"})
    summary = influence_run(**params.sections())
    stage = summary["stages"]["compute_test_factors"]
    assert stage["outcome"] == "computed" and stage["work"]["solves"] == 40
    sequential = np.asarray(storage.open_array(stage["url"], {})[...])
    group, _ = read_outputs(params.store())
    refs = stored_refs(params.store(), group.attrs)
    monkeypatch.setattr(solvers, "PROGRESS_SECONDS", 0.0)  # the driver's cadence, which the tasks take: a line per iteration
    caplog.set_level(logging.INFO, logger="influence_core")
    on_cluster = ComputeSpec(cluster="address", address=dask_address)
    elsewhere = RunStore(output_url=str(tmp_path / "other"))  # a fresh stage cache: computed again, on the cluster
    again = query_factors.QueryFactorsInput(params.method, refs["fit_model"], refs["prepare_data"], refs["fit_preconditioner"], elsewhere, params.compute.torch_threads)
    ref = query_factors.run(again, client_factory=lambda: dask_client(on_cluster, False))
    np.testing.assert_array_equal(np.asarray(storage.open_array(ref.url, {})[...]), sequential)
    progress = [(record.process, SYSTEMS.match(record.getMessage())) for record in caplog.records]
    progress = [(pid, match[1]) for pid, match in progress if match]
    assert {systems for _, systems in progress} == {"16", "8"}
    assert {pid for pid, _ in progress} - {os.getpid()}, "every line came from a worker process"
    model, data = stored_model_and_data(params.store(), group)
    exact = small_params(str(tmp_path / "x"), method={"name": "direct", "regularization": 1e-3}).method.build(model, "cross_entropy").fit((data["x_train"], data["y_train"]))
    np.testing.assert_allclose(sequential, exact.influence_factors(data["x_test"], data["y_test"]).numpy(), rtol=1e-4, atol=1e-5 * np.abs(sequential).max())
