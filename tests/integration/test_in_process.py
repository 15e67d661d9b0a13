"""Small work of a local cluster runs in the flow's process, on as many threads as the cluster has workers, with the
workers' arithmetic: a run whose factor passes, index pass and scoring stayed here writes the same bits as the same
run with every task on the workers (`compute.in_process_gflop: 0`), and each stage's summary says where it ran."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flows.influence_run import influence_run
from tests.helpers import read_outputs, small_params

HERE = "in the flow's process on 2 threads"


def _run(tmp_path, name: str, **compute):
    params = small_params(
        str(tmp_path / name), method={"name": "ekfac", "regularization": 1e-3}, aggregate={"top_k": 4, "self_influence": "exact"},
        compute={"cluster": "local", "n_workers": 2, "train_chunk_rows": 64, **compute},
    )
    influence_run(**params.sections())
    return json.loads((tmp_path / name / "summary.json").read_text())["stages"], read_outputs(params.store())[1]


@pytest.mark.parametrize("index_budget_gb", [1.0, 0.0], ids=["with an index", "without an index"])
def test_work_kept_in_the_flows_process_gives_the_workers_bits(tmp_path, prefect_api, index_budget_gb):
    here, kept = _run(tmp_path, "here", index_budget_gb=index_budget_gb)
    there, expected = _run(tmp_path, "there", index_budget_gb=index_budget_gb, in_process_gflop=0)
    stages = ["fit_preconditioner", "compute_influences"] + (["index_training"] if index_budget_gb else [])
    for name in stages:
        assert here[name]["ran"].startswith(HERE) and there[name]["ran"] == "local", (name, here[name]["ran"], there[name]["ran"])
    assert kept.keys() == expected.keys() >= {"scores", "self_influence", "train_totals"}
    for name, values in expected.items():
        assert values.tobytes() == kept[name].tobytes(), name
    assert np.abs(expected["scores"]).max() > 0
