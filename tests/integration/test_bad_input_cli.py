"""Bad input through the CLI and the flow (real Prefect API, moto S3): each case fails before expensive work, with
one line `field: problem. Fix: ...`, a non-zero exit, no traceback, and an earlier run in the output untouched.

"Before expensive work" is read back from Prefect: the failed flow run's task runs end at the stage that refused
the input (none for a preflight failure), and no stage from that one on has written a manifest.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
from prefect.client.schemas.sorting import FlowRunSort
from torch import nn
from typer.testing import CliRunner

from flows.cli import app
from flows.influence_run import influence_run
from flows.parameters import RunParameters
from influence_core import ConfigError
from influence_core.pipeline.store import storage
from tests.helpers import small_params, tree_hashes

pytestmark = pytest.mark.usefixtures("prefect_api")
runner = CliRunner()
STAGES = ["prepare_data", "fit_model", "fit_preconditioner", "index_training", "compute_test_factors", "compute_influences", "aggregate"]


# -- helpers ---------------------------------------------------------------------------------------------------
def manifests(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.glob("stages/*/*/manifest.json")}


@dataclass(frozen=True)
class FlowRun:
    state: str
    stages: list[str]  # the task runs, in order
    completed: set[str]  # those that finished


def flow_run_to(output_url: str) -> FlowRun | None:
    """The one flow run that wrote to `output_url`, read back from the Prefect API."""
    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_flow_runs(sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=100) if r.parameters.get("output_url") == output_url]
        if not runs:
            return None
        assert len(runs) == 1, f"{len(runs)} flow runs wrote to {output_url}"
        tasks = sorted(client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[runs[0].id]))), key=lambda t: t.created or t.expected_start_time)
    assert runs[0].state is not None and all(t.state is not None for t in tasks)
    names = [t.name.rsplit("-", 1)[0] for t in tasks]
    return FlowRun(runs[0].state.type.value, names, {n for n, t in zip(names, tasks) if t.state and t.state.is_completed()})


def assert_stopped_at(output_url: str, stages: list[str]) -> FlowRun:
    """The flow run failed after running exactly `stages` (none: the preflight refused)."""
    run = flow_run_to(output_url)
    assert run is not None and run.state == "FAILED" and run.stages == stages, run
    return run


def invoke(config: dict[str, Any], tmp_path: Path, *extra: str) -> Any:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return runner.invoke(app, ["run", "--config", str(path), *extra])


def assert_refused(result: Any, code: int, field_name: str, *words: str) -> str:
    """Exit `code`; a line `field: ... Fix: ...` naming `field`; every word in that line; no traceback."""
    lines = [line for line in result.output.splitlines() if line.startswith(f"{field_name}: ") and "Fix: " in line]
    assert result.exit_code == code, result.output
    assert lines, result.output
    for word in words:
        assert word in lines[0], lines[0]
    assert "Traceback" not in result.output, result.output
    return lines[0]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def digits_like(n_train: int = 120, n_test: int = 12, width: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x_train": rng.random((n_train, width), dtype=np.float32),
        "y_train": np.arange(n_train) % 10,
        "x_test": rng.random((n_test, width), dtype=np.float32),
        "y_test": np.arange(n_test) % 10,
    }


def npz_dataset(config: dict[str, Any], tmp_path: Path, **changes: np.ndarray) -> None:
    arrays = {**digits_like(), **changes}
    np.savez(tmp_path / "data.npz", **arrays)
    config["dataset"] = {"source": "npz", "path": str(tmp_path / "data.npz"), "chunk_rows": 32}


def token_fields(config: dict[str, Any], tmp_path: Path, ids: str = "input_ids", high: int = 64) -> None:
    """Named fields (token ids below `high`, an attention mask, labels of 3 classes) for tests.plugin_models:mean_embedding."""
    rng = np.random.default_rng(0)
    arrays = {f"{name}_{split}": value for split, n in (("train", 60), ("test", 6)) for name, value in (
        (ids, rng.integers(0, high, (n, 5))), ("attention_mask", np.ones((n, 5), np.int64)), ("y", np.arange(n) % 3))}
    np.savez(tmp_path / "tokens.npz", **arrays)
    config["dataset"] = {"source": "npz", "path": str(tmp_path / "tokens.npz"), "inputs": [ids, "attention_mask"], "chunk_rows": 32}
    config["model"] = {"factory": "tests.plugin_models:mean_embedding"}


def string_labels(config: dict[str, Any], tmp_path: Path) -> None:
    """A Parquet file whose label column holds class names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"x": rng.random((60, 4)).tolist(), "y": ["cat", "dog", "bird"] * 20}), tmp_path / "named.parquet")
    config["dataset"] = {"source": "parquet", "path": str(tmp_path / "named.parquet"), "chunk_rows": 32}


def with_nan(name: str, row: int, value: float) -> Callable[[dict[str, Any], Path], None]:
    def change(config: dict[str, Any], tmp_path: Path) -> None:
        array = digits_like()[name].copy()
        array[row, 3] = value
        npz_dataset(config, tmp_path, **{name: array})

    return change


def parquet_with_a_null(values: np.ndarray, row: int) -> Callable[[dict[str, Any], Path], None]:
    """One Parquet file of len(values) rows (x: a list column, y: labels), split by the hold-out, missing one value of
    x in the file's row `row`."""

    def change(config: dict[str, Any], tmp_path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        x = values.tolist()
        x[row][3] = None
        pq.write_table(pa.table({"x": x, "y": np.arange(len(values)) % 10}), tmp_path / "data.parquet")
        config["dataset"] = {"source": "parquet", "path": str(tmp_path / "data.parquet"), "chunk_rows": 32}

    return change


def token_labels_without_task(config: dict[str, Any], tmp_path: Path) -> None:
    """GPT-2 on token ids x with labels y = x, model.task left at auto: (B, T, V) outputs over (B, T) integer labels."""
    ids = np.random.default_rng(0).integers(0, 64, (60, 8))
    npz_dataset(config, tmp_path, x_train=ids[:48], y_train=ids[:48], x_test=ids[48:], y_test=ids[48:])
    config["model"] = {"factory": "tests.plugin_models:gpt2_lm", "options": {"n_layer": 1, "n_embd": 16, "vocab_size": 64, "n_positions": 8}}


def integer_features(config: dict[str, Any], tmp_path: Path) -> None:
    """A classifier of integer features (pixel counts 0..16): integer (n, 64) arrays, as token ids would be."""
    rng = np.random.default_rng(0)
    npz_dataset(config, tmp_path, x_train=rng.integers(0, 17, (120, 64)), x_test=rng.integers(0, 17, (12, 64)))


def language_model(method: dict[str, Any]) -> Callable[[dict[str, Any], Path], None]:
    """The built-in transformer as a byte-level language model of docstring windows, scored by `method` per token."""

    def change(config: dict[str, Any], tmp_path: Path) -> None:
        config["dataset"] = {"source": "python_docs", "window": 16, "n_train": 32, "n_test": 2, "chunk_rows": 32}
        config["model"] = {"architecture": "transformer", "task": "language_modelling", "d_model": 8, "heads": 2, "layers": 1}
        config["method"] = method
        config["aggregate"] = {"top_k": 2, "report_queries": 2, "token_scores": True}

    return change


def checkpoint_of_other_architecture(config: dict[str, Any], tmp_path: Path) -> None:
    torch.save(nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).state_dict(), tmp_path / "other.pt")
    config["model"]["checkpoint"] = str(tmp_path / "other.pt")


def set_in(path: str, value: Any) -> Callable[[dict[str, Any], Path], None]:
    def change(config: dict[str, Any], tmp_path: Path) -> None:
        *parents, leaf = path.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    return change


def rename_key(section: str, old: str, new: str) -> Callable[[dict[str, Any], Path], None]:
    def change(config: dict[str, Any], tmp_path: Path) -> None:
        node = config if not section else config[section]
        node[new] = node.pop(old)

    return change


def both(*changes: Callable[[dict[str, Any], Path], None]) -> Callable[[dict[str, Any], Path], None]:
    def change(config: dict[str, Any], tmp_path: Path) -> None:
        for one in changes:
            one(config, tmp_path)

    return change


@dataclass(frozen=True)
class Case:
    id: str
    change: Callable[[dict[str, Any], Path], None]
    field: str
    words: tuple[str, ...] = ()
    stages: list[str] | None = None  # task runs of the refused flow run; None: refused before a flow run exists
    code: int = 1

    @property
    def param(self) -> Any:
        return pytest.param(self, id=self.id)


def invalid(id: str, change: Callable[[dict[str, Any], Path], None], field_name: str, *words: str) -> Case:
    """Refused while parsing the parameters: exit 2, no flow run."""
    return Case(id, change, field_name, words, None, 2)


PARAMETER_CASES = [
    invalid("unknown method option", set_in("method.rtol", 1e-3), "method.rtol", "name=direct", "regularization"),
    invalid("unknown method", set_in("method.name", "newton"), "method", "'cg'"),
    invalid("setting of another source", set_in("dataset.n_features", 20), "dataset.n_features", "belongs to source=synthetic_classification or synthetic_regression", "set dataset.source"),
    invalid("unknown dataset source", set_in("dataset.source", "csv"), "dataset", "'digits'", "'npz'"),
    invalid("top_k = 0", set_in("aggregate.top_k", 0), "aggregate.top_k", "1 or more"),
    invalid("dataset chunk_rows = 0", set_in("dataset.chunk_rows", 0), "dataset.chunk_rows", "1 or more"),
    invalid("train_chunk_rows = 0", set_in("compute.train_chunk_rows", 0), "compute.train_chunk_rows", "1 or more"),
    invalid("method batch_size = 0", set_in("method.batch_size", 0), "method.batch_size", "1 or more"),
    invalid("training batch_size = 0", set_in("training.batch_size", 0), "training.batch_size", "1 or more"),
    invalid("misspelled section", rename_key("", "aggregate", "aggregat"), "aggregat", "did you mean 'aggregate'"),
    invalid("misspelled key", rename_key("method", "regularization", "regularisation"), "method.regularisation", "did you mean 'regularization'"),
    invalid("dataset file missing", set_in("dataset", {"source": "npz", "path": "/no/such/data.npz"}), "dataset.path", "does not exist"),
    invalid("dotted path malformed", set_in("dataset", {"source": "torch", "path": "not a module path"}), "dataset.path", "package.module:factory"),
    invalid("scheduler address missing", set_in("compute", {"cluster": "address"}), "compute.address", "tcp://"),
    invalid("negative λ", set_in("method.regularization", -1.0), "method.regularization", "Fix: set method.regularization to 0.0 or more"),  # no internal type names
    invalid("ensemble of 0", set_in("training.ensemble", 0), "training.ensemble", "1 or more"),
    invalid("ensemble with a checkpoint", both(set_in("training.ensemble", 2), set_in("model.checkpoint", "/no/such/model.pt")), "training.ensemble", "model.checkpoint", "set training.ensemble to 1"),
    invalid("ensemble with the FastIF prefilter", both(set_in("training.ensemble", 2), set_in("candidates.knn_k", 8)), "training.ensemble", "candidates.knn_k=8", "candidates.knn_k to null"),
    invalid("a model setting at the top level", set_in("task", "language_modelling"), "task", "did you mean model.task?"),
    invalid("a checkpoint at the top level", set_in("checkpoint", "model.pt"), "checkpoint", "did you mean model.checkpoint?"),
    invalid("a 1 MB region", set_in("storage.region", "x" * 1_000_000), "storage.region", "1,000,000 characters", "not printed"),
    invalid("a 1 MB model option", both(set_in("model.factory", "tests.plugin_models:dropout_batchnorm_mlp"), set_in("model.options", {"hidden": "x" * 1_000_000})), "model.options.hidden", "not printed"),
    invalid("a 1 MB dataset source", set_in("dataset.source", "x" * 1_000_000), "dataset.source", "not printed"),
    invalid("negative λ of one layer", set_in("method.regularization", {"1": 1e-3, "3": -1.0}), "method.regularization.3", "Fix: set method.regularization.3 to 0.0 or more"),
    # issue 52: λ=inf scored every example 0 and exited 0, λ=nan was refused asking for "≥ 0", top_k=true became 1
    invalid("λ = .inf", set_in("method.regularization", math.inf), "method.regularization", "Input should be a finite number ≥ 0. Fix: set method.regularization to a finite number ≥ 0"),
    invalid("λ = .nan", set_in("method.regularization", math.nan), "method.regularization", "Input should be a finite number ≥ 0. Fix: set method.regularization to a finite number ≥ 0"),
    invalid("top_k = true", set_in("aggregate.top_k", True), "aggregate.top_k", "Input should be a whole number ≥ 1. Fix: set aggregate.top_k to a whole number ≥ 1"),
    invalid("top_k = 2.5", set_in("aggregate.top_k", 2.5), "aggregate.top_k", "a whole number ≥ 1"),
    invalid("per-token scores of a classifier with integer features", both(integer_features, set_in("aggregate.token_scores", True)), "aggregate.token_scores",
            "the task is classification", "model.task: language_modelling"),
]

RUNTIME_CASES = [
    Case("float labels with cross_entropy", lambda c, p: npz_dataset(c, p, y_train=(np.arange(120) % 10).astype(np.float32), y_test=(np.arange(12) % 10).astype(np.float32)),
         "model.loss", ("cross_entropy takes integer class indices", "float32", "mse"), ["prepare_data", "fit_model"]),
    Case("λ per layer naming an unknown layer", set_in("method", {"name": "direct", "block_structure": "layer_wise", "regularization": {"1": 1e-3, "3": 1e-3, "9": 1e-3}}),
         "method.regularization", ("unknown ['9']",), ["prepare_data"]),  # before training
    Case("λ = 0 where the method needs λ > 0", set_in("method", {"name": "cg", "regularization": 0.0}), "method.regularization", ("cg got λ=0.0", "> 0"), ["prepare_data"]),
    Case("NaN features", with_nan("x_train", 7, np.nan), "dataset.path", ("x_train", "NaN or inf", "row 7"), ["prepare_data"]),
    Case("inf query features", with_nan("x_test", 2, np.inf), "dataset.path", ("x_test", "row 2"), ["prepare_data"]),
    Case("negative labels", lambda c, p: npz_dataset(c, p, y_train=np.arange(120) % 10 - 1), "dataset.path", ("negative label -1", "0..C-1"), ["prepare_data"]),
    Case("empty dataset", lambda c, p: npz_dataset(c, p, x_train=np.zeros((0, 64), np.float32), y_train=np.zeros(0, np.int64)), "dataset.path", ("no rows",), ["prepare_data"]),
    Case("x/y length mismatch", lambda c, p: npz_dataset(c, p, y_train=np.arange(100) % 10), "dataset.path", ("120 rows", "y_train has 100"), ["prepare_data"]),
    Case("query features of another width", lambda c, p: npz_dataset(c, p, x_test=np.zeros((12, 10), np.float32)), "dataset.path", ("(10,)", "(64,)"), ["prepare_data"]),
    Case("labels beyond the outputs", set_in("model.output_dim", 5), "model.output_dim", ("5 columns", "up to 9", "10 outputs"), ["prepare_data", "fit_model"]),
    Case("outputs that do not fit the loss", both(set_in("model.loss", "mse"), set_in("model.output_dim", 10)), "model", ("(64, 10)", "(64,)"), ["prepare_data", "fit_model"]),
    Case("checkpoint of another architecture", checkpoint_of_other_architecture, "model.checkpoint", ("does not fit",), ["prepare_data", "fit_model"]),
    Case("checkpoint missing", set_in("model.checkpoint", "/no/such/model.pt"), "model.checkpoint", ("/no/such/model.pt",), []),
    Case("dotted path that does not import", set_in("dataset", {"source": "torch", "path": "no_such_package_4d1f.data:make"}), "dataset.path", ("cannot load", "No module named"), ["prepare_data"]),
    Case("top_k above n_train", set_in("aggregate.top_k", 500), "aggregate.top_k", ("240 training examples", "at most 240"), ["prepare_data"]),
    Case("more local workers than cores", set_in("compute", {"cluster": "local", "n_workers": 64}), "compute.n_workers", ("64 worker processes", "at most"), []),
    Case("n_train above the rows there are", set_in("dataset.n_train", 5000), "dataset.n_train", ("n_train=5000", "1437", "at most 1437"), ["prepare_data"]),
    Case("a model factory that raises", set_in("model", {"factory": "tests.plugin_models:raising"}), "model.factory",
         ("tests.plugin_models:raising raised RuntimeError: no pretrained weights for this size (at ", "plugin_models.py:"), ["prepare_data"]),  # built to check the method
    Case("a forward that returns a tuple", set_in("model", {"factory": "tests.plugin_models:tuple_output"}), "model", ("returns a tuple, not a tensor",), ["prepare_data", "fit_model"]),
    Case("labels that are strings", string_labels, "dataset.target", ("str values such as '", "not numbers", "class indices"), ["prepare_data"]),
    Case("fields the forward does not take", lambda c, p: token_fields(c, p, ids="tokens"), "dataset.inputs", ("unexpected keyword argument 'tokens'", "arguments of the model's forward"), ["prepare_data", "fit_model"]),
    Case("token ids beyond the vocabulary", lambda c, p: token_fields(c, p, high=500), "model", ("raised IndexError", "index out of range", "embeddings [64]"), ["prepare_data", "fit_model"]),
    Case("unreachable scheduler", lambda c, p: set_in("compute", {"cluster": "address", "address": f"tcp://127.0.0.1:{closed_port()}"})(c, p), "compute.address", ("no Dask scheduler answers", "Connection refused"), []),
    # issue 35: each ran to the end with wrong scores before it was refused (row 30 of the file is row 24 of the
    # training split, row 54 row 9 of the held-out queries: the file's row is named)
    Case("language model without model.task", token_labels_without_task, "model.task", ("auto cannot tell", "(48, 8, 64)", "(48, 8)", "model.task: language_modelling"), ["prepare_data", "fit_model"]),
    Case("task whose loss is the batch's mean", set_in("model.task_class", "tests.plugin_tasks:BatchMeanLoss"), "model.task_class",
         ("tests.plugin_tasks:BatchMeanLoss", "loss returned shape ()", "not one value per example", "reduction='none'"), ["prepare_data", "fit_model"]),
    Case("null in an integer list column of Parquet", parquet_with_a_null(np.random.default_rng(0).integers(0, 16, (120, 64)), 30), "dataset.path",
         ("column 'x' of data.parquet", "missing value (null) in row 30"), ["prepare_data"]),
    Case("null in a float list column of Parquet", parquet_with_a_null(np.random.default_rng(0).random((120, 64)), 54), "dataset.path",
         ("column 'x' of data.parquet", "missing value (null) in row 54"), ["prepare_data"]),
    # issue 52: λ=1e300 scored every example 0 (exit 0); a random forward pass failed MAGIC's replay after its work,
    # with a traceback; batch norm without running statistics raised in fit_model's probe; cg's per-token scores of a
    # language model were refused only in aggregate, naming positions.weight
    Case("λ = 1e300 swamps the curvature", set_in("method.regularization", 1e300), "method.regularization", ("λ=1e+300 swamps the curvature", "set method.regularization below"),
         ["prepare_data", "fit_model", "fit_preconditioner"]),
    Case("MAGIC with F.dropout in forward", both(set_in("method", {"name": "magic"}), set_in("model", {"factory": "tests.plugin_models:random_forward"})), "model",
         ("training mode is random", "set every dropout probability to 0", "method.name"), ["prepare_data"]),  # before training
    Case("MAGIC with noise in forward", both(set_in("method", {"name": "magic"}), set_in("model", {"factory": "tests.plugin_models:random_forward", "options": {"kind": "noise"}})), "model",
         ("training mode is random", "torch.randn"), ["prepare_data"]),
    Case("batch norm without running statistics", set_in("model", {"factory": "tests.plugin_models:batch_statistics_mlp"}), "model",
         ("one example alone", "track_running_stats=False", "track_running_stats=True"), ["prepare_data", "fit_model"]),  # before training
    Case("per-token scores of cg over position embeddings", language_model({"name": "cg", "regularization": 1e-3}), "method.modules",
         ("positions.weight", "per-token scores", "set method.modules to layers applied at every token", "tokens, blocks.0.attention.query"), ["prepare_data"]),
]


# -- an earlier, complete run that bad invocations must leave as it was -----------------------------------------
@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory: pytest.TempPathFactory, prefect_api: None) -> Path:
    root = tmp_path_factory.mktemp("earlier")
    result = invoke(small_params(str(root / "run")).model_dump(mode="json"), root)
    assert result.exit_code == 0, result.output
    return root / "run"


@pytest.fixture
def earlier(earlier_run: Path, tmp_path: Path) -> Iterator[Path]:
    """A copy of the complete run; every file of it must be byte-identical after the test's bad invocation."""
    copy = tmp_path / "out"
    shutil.copytree(earlier_run, copy)
    before, stage_manifests = tree_hashes(copy), manifests(copy)
    assert "influence.zarr/zarr.json" in before and len(stage_manifests) == len(STAGES)
    yield copy
    after = tree_hashes(copy)
    changed = [name for name, digest in before.items() if after.get(name) != digest]
    assert not changed, f"the earlier run was modified: {changed}"


# -- the cases ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [c.param for c in PARAMETER_CASES + RUNTIME_CASES])
def test_bad_input_is_refused_early(case: Case, earlier: Path, tmp_path: Path) -> None:
    config = {**small_params(str(earlier)).model_dump(mode="json"), "overwrite": True}  # even allowed to replace it,
    before = manifests(earlier)  # a run refused for bad input leaves the earlier run as it was
    case.change(config, tmp_path)
    result = invoke(config, tmp_path)
    assert_refused(result, case.code, case.field, *case.words)
    assert len(result.output) < 2000, "a refusal is a line or two, never a value or a parameter dict echoed"
    if case.stages is None:
        assert flow_run_to(str(earlier)) is None  # refused while parsing: no flow run at all
        return
    run = assert_stopped_at(str(earlier), case.stages)
    new = {name.split("/")[1] for name in manifests(earlier) - before}
    found = {name.split("/")[1] for name in before}  # stage keys do not depend on where the output lives: the earlier run's stages of equal inputs are found complete
    assert new <= run.completed <= new | found, f"new manifests of {new}, but completed {run.completed}"  # the refusing stage wrote none


def test_pickle_checkpoint_is_refused_without_running_its_code(earlier: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    torch.save({"weight": Payload()}, tmp_path / "evil.pt")
    config = {**small_params(str(earlier)).model_dump(mode="json"), "overwrite": True}
    config["model"]["checkpoint"] = str(tmp_path / "evil.pt")
    line = assert_refused(invoke(config, tmp_path), 1, "model.checkpoint", "weights_only=True", "evil.pt")
    assert "state_dict" in line
    assert_stopped_at(str(earlier), ["prepare_data", "fit_model"])
    assert not marker.exists()
    torch.load(tmp_path / "evil.pt", weights_only=False)  # the payload is live: a full unpickle runs it
    assert marker.exists()


@contextmanager
def read_only(root: Path) -> Iterator[None]:
    """Root ignores permission bits, so as root the tree is made immutable instead (chattr +i)."""
    as_root = os.geteuid() == 0
    lock, unlock = (["chattr", "-R", "+i", str(root)], ["chattr", "-R", "-i", str(root)]) if as_root else (["chmod", "-R", "a-w", str(root)], ["chmod", "-R", "u+w", str(root)])
    subprocess.run(lock, check=True)
    try:
        yield
    finally:
        subprocess.run(unlock, check=True)


def test_read_only_output_directory(earlier: Path, tmp_path: Path) -> None:
    with read_only(earlier):
        with pytest.raises(OSError):
            (earlier / "probe").write_bytes(b"")  # the directory really is read-only for this process
        result = invoke(small_params(str(earlier)).model_dump(mode="json"), tmp_path)
    assert_refused(result, 1, "output_url", "cannot write", str(earlier))
    assert_stopped_at(str(earlier), [])


def test_read_only_parent_of_a_new_output(tmp_path: Path) -> None:
    parent = tmp_path / "locked"
    parent.mkdir()
    with read_only(parent):
        result = invoke(small_params(str(parent / "new" / "run")).model_dump(mode="json"), tmp_path)
    assert_refused(result, 1, "output_url", "cannot write")
    assert not (parent / "new").exists()


# -- S3: each refused by the preflight, before any stage ---------------------------------------------------------
def test_missing_bucket(tmp_path: Path, s3_endpoint: str) -> None:
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    result = invoke(small_params(url, storage={"endpoint_url": s3_endpoint}).model_dump(mode="json"), tmp_path)
    assert_refused(result, 1, "output_url", "does not exist", "aws s3 mb")
    assert_stopped_at(url, [])


def test_missing_credentials(tmp_path: Path, s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    url = f"s3://{s3_bucket}/run"
    result = invoke(small_params(url, storage={"endpoint_url": s3_endpoint}).model_dump(mode="json"), tmp_path)
    assert_refused(result, 1, "output_url", "no S3 credentials", "AWS_ACCESS_KEY_ID")
    assert_stopped_at(url, [])


def test_closed_endpoint_port(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    url = f"s3://bucket-{uuid.uuid4().hex[:8]}/run"
    result = invoke(small_params(url, storage={"endpoint_url": endpoint}).model_dump(mode="json"), tmp_path)
    assert_refused(result, 1, "storage.endpoint_url", endpoint, "Connection refused")
    assert_stopped_at(url, [])


def test_credentials_in_the_endpoint_are_refused_and_not_echoed(tmp_path: Path) -> None:
    config = small_params(str(tmp_path / "out")).model_dump(mode="json")
    config["storage"]["endpoint_url"] = "http://someone:hunter2-secret@127.0.0.1:9000"
    result = invoke(config, tmp_path)
    assert_refused(result, 2, "storage.endpoint_url", "must not carry credentials")
    assert "hunter2" not in result.output


# -- the config file itself ---------------------------------------------------------------------------------------
def test_config_path_that_does_not_exist(tmp_path: Path) -> None:
    result = runner.invoke(app, ["run", "--config", str(tmp_path / "nope.yaml")])
    assert_refused(result, 2, "--config", "nope.yaml", "is not a file")


def test_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("output_url: runs/x\nmethod:\n  name: [cg\n")
    assert_refused(runner.invoke(app, ["run", "--config", str(path)]), 2, "--config", "not valid YAML", "line 4")


def test_config_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- output_url\n- runs/x\n")
    assert_refused(runner.invoke(app, ["run", "--config", str(path)]), 2, "--config", "list, not a mapping")


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", ("is not UTF-8 text (byte 0 is b'\\x89': a binary file?)",)),
        (b"", ("holds nothing (it is empty or only comments), not a mapping",)),
        (b"# output_url: runs/x\n", ("holds nothing (it is empty or only comments), not a mapping",)),
        (b"method:\n  name: cg\naggregate:\n  top_k: 3\nmethod:\n  name: direct\n", ("gives 'method' twice in one mapping (lines 1 and 5)", "Fix: keep one 'method' there")),
        (b"method:\n  name: cg\n  name: direct\n", ("gives 'name' twice in one mapping (lines 2 and 3)", "Fix: keep one 'name' there")),
    ],
    ids=["binary", "empty", "only-comments", "section-twice", "field-twice"],
)
def test_a_config_file_that_is_not_one_mapping_is_refused_before_any_run(content: bytes, words: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 52, item 14: a binary file (UnicodeDecodeError before), an empty one (it ran the defaults into ./runs/demo)
    and a key or section given twice (the last one silently won) are each one line naming --config, exit 2, and no
    flow run starts (nothing is written where the defaults would write)."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    assert_refused(runner.invoke(app, ["run", "--config", str(path)]), 2, "--config", "'" + str(path) + "'", *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def test_unsupported_output_scheme(tmp_path: Path) -> None:
    result = invoke(small_params(str(tmp_path)).model_dump(mode="json") | {"output_url": "gs://bucket/run"}, tmp_path)
    assert_refused(result, 2, "output_url", "unsupported scheme 'gs'", "s3://bucket/prefix")


# -- show and verify on a missing or unfinished run ----------------------------------------------------------------
def test_show_and_verify_on_a_missing_run(tmp_path: Path) -> None:
    for command in ("show", "verify"):
        result = runner.invoke(app, [command, str(tmp_path / "nothing")])
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
    assert_refused(runner.invoke(app, ["show", str(tmp_path / "nothing")]), 1, "output_url", "no influence.zarr")
    assert not (tmp_path / "nothing").exists()


def test_show_and_verify_on_an_incomplete_run(earlier_run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "out"
    shutil.copytree(earlier_run, copy)
    storage.open_group(str(copy / "influence.zarr"), {}, mode="a").attrs["status"] = "running"
    before = tree_hashes(copy)
    assert_refused(runner.invoke(app, ["show", str(copy)]), 1, "output_url", "not complete", "status='running'")
    assert_refused(runner.invoke(app, ["verify", str(copy)], terminal_width=200), 1, "output_url", "checks failed: status")
    assert tree_hashes(copy) == before  # show and verify only read


# -- the flow itself, as a deployment calls it ---------------------------------------------------------------------
@pytest.mark.parametrize("case", [c.param for c in RUNTIME_CASES if c.id in {"NaN features", "unreachable scheduler", "checkpoint of another architecture"}])
def test_the_flow_raises_config_error(case: Case, tmp_path: Path) -> None:
    config = small_params(str(tmp_path / "out")).model_dump(mode="json")
    case.change(config, tmp_path)
    with pytest.raises(ConfigError) as info:
        influence_run(**RunParameters.model_validate(config).sections())
    assert info.value.field == case.field and info.value.fix
    assert_stopped_at(str(tmp_path / "out"), case.stages or [])
    assert not (tmp_path / "out" / "influence.zarr").exists()


def test_no_traceback_on_the_terminal(tmp_path: Path) -> None:
    """The real command in a subprocess, so Prefect's own log output (which CliRunner does not capture) is seen too."""
    from prefect.settings import PREFECT_API_URL

    config = small_params(str(tmp_path / "out")).model_dump(mode="json")
    with_nan("x_train", 7, np.nan)(config, tmp_path)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    done = subprocess.run([str(Path(sys.executable).parent / "influence-pipeline"), "run", "--config", str(tmp_path / "run.yaml")], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "dataset.path: x_train holds NaN or inf (first at row 7). Fix: " in done.stdout
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    run = assert_stopped_at(str(tmp_path / "out"), ["prepare_data"])
    line = next(line for line in done.stdout.splitlines() if line.startswith("dataset.path: "))
    assert (done.stdout + done.stderr).count(line) == 1, done.stderr  # printed once: not also by the log and the closing states
    assert "Finished in state Failed (refused: dataset.path)" in done.stderr
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_runs(sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=100)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in flow_run if r.parameters.get("output_url") == str(tmp_path / "out")])))
    assert [log.message for log in logs].count(line) == 1 and sum(line in log.message for log in logs) == 1, [log.message for log in logs]  # the API's logs hold it once, at ERROR
    assert run.state == "FAILED"
