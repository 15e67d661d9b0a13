"""Small shared builders for tests: tiny pipeline parameters and reference computations."""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.sorting import FlowRunSort

from flows.parameters import RunParameters
from influence_core import examples
from influence_core.pipeline.store import storage
from influence_core.pipeline.store.loading import load_model, open_data
from influence_core.pipeline.store.publish import stored_refs
from influence_core.pipeline.store.run_store import RunStore


def small_params(output_url: str, **overrides: Any) -> RunParameters:
    """Digits subset, a small MLP, exact Gauss-Newton influence: seconds per run."""
    config: dict[str, Any] = {
        "output_url": output_url,
        "dataset": {"n_train": 240, "n_test": 12, "chunk_rows": 64},
        "model": {"hidden": [8]},
        "training": {"epochs": 15},
        "method": {"name": "direct", "regularization": 1e-3},
        "compute": {"cluster": "sequential", "train_chunk_rows": 64},
        "aggregate": {"top_k": 4, "report_queries": 3},
    }
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        if field:
            config.setdefault(section, {})[field] = value
        else:
            config[section] = value
    return RunParameters.model_validate(config)


def read_outputs(store: RunStore) -> tuple[zarr.Group, dict[str, np.ndarray]]:
    group = storage.open_group(store.influence_url, store.options, mode="r")
    return group, {name: np.asarray(group[name][...]) for name in group.array_keys()}


def assert_same_outputs(store: RunStore, expected: dict[str, np.ndarray]) -> zarr.Group:
    """The run's influence.zarr holds exactly the expected arrays, bit for bit; returns its group."""
    group, arrays = read_outputs(store)
    assert arrays.keys() == expected.keys()
    for name, values in expected.items():
        np.testing.assert_array_equal(arrays[name], values, err_msg=name)
    return group


def stored_model_and_data(store: RunStore, group: zarr.Group) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The trained model and the stored arrays, read back independently of the pipeline's own loaders."""
    refs = stored_refs(store, group.attrs)
    model = load_model(refs["fit_model"], store.options)  # type: ignore[arg-type]
    arrays = open_data(refs["prepare_data"], store.options)  # type: ignore[arg-type]
    return model, {name: examples.read(arr) for name, arr in arrays.items()}  # inputs of named fields: a dict of tensors


def tree_hashes(root: Path) -> dict[str, str]:
    """The sha256 of every file under `root`, by relative path: what "left byte-identical" compares."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def shown_indices(output: str, column: int) -> list[list[int]]:
    """The training indices a printed top-k table shows per query, in order: column 2 helpful, 3 harmful (a query's
    row starts on the line that carries its number)."""
    rows: list[list[int]] = []
    for line in output.splitlines():
        cells = line.split("│")
        if len(cells) != 6:
            continue
        if cells[1].strip():
            rows.append([])
        found = re.match(r"\s*#(\d+) ", cells[column + 1])
        if found:
            rows[-1].append(int(found.group(1)))
    return rows


FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def latest_task_runs(output_url: str, last: str) -> dict[str, str]:
    """The latest flow run to `output_url`: each of its task runs' final state type (COMPLETED for a cache hit too,
    FAILED), read back from the Prefect API once task run `last` is there and every task run has reached a final
    state (the engine reports states in the background: PENDING or RUNNING for up to 60 s on a loaded machine)."""
    deadline = time.monotonic() + 60
    while True:
        with get_client(sync_client=True) as client:
            runs = [r for r in client.read_flow_runs(sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=50) if r.parameters.get("output_url") == output_url]
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[runs[0].id])))
        states = {t.name.rsplit("-", 1)[0]: t.state.type.value for t in tasks if t.state is not None}
        if (last in states and set(states.values()) <= FINAL_STATES) or time.monotonic() > deadline:
            return states
        time.sleep(0.2)
