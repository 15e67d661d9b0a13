"""One output, one configuration: a run of other parameters is refused unless --overwrite (which replaces the old
run cleanly), and two runs at once on one output_url never leave a mixed output."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from flows.influence_run import influence_run
from influence_core import ConfigError
from influence_core.pipeline.store import storage
from influence_core.pipeline.store.runlock import exclusive_run
from tests.helpers import assert_same_outputs, read_outputs, small_params

pytestmark = pytest.mark.usefixtures("prefect_api")
REPO = Path(__file__).resolve().parents[2]
STAGES = ["prepare_data", "fit_model", "fit_preconditioner", "index_training", "compute_test_factors", "compute_influences", "aggregate"]
runner = CliRunner()


def file_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def write_config(path: Path, params) -> Path:
    path.write_text(yaml.safe_dump(params.model_dump(mode="json", exclude={"overwrite"})))
    return path


def assert_one_consistent_run(params, summary: dict) -> None:
    """Every array was written by a stage of this run, and attrs and summary.json describe the same run."""
    group, _ = read_outputs(params.store())
    assert group.attrs["status"] == "complete"
    assert group.attrs["run_fingerprint"] == params.run_fingerprint()
    fingerprints = group.attrs["fingerprints"]
    assert fingerprints == {name: stage["fingerprint"] for name, stage in summary["stages"].items()}
    for name in group.array_keys():
        assert group[name].attrs["fingerprint"] in (fingerprints["compute_influences"], fingerprints["aggregate"]), name


def test_other_parameters_are_refused_then_overwritten_through_the_cli(tmp_path):
    first = small_params(str(tmp_path / "out"))
    result = runner.invoke(app, ["run", "--config", str(write_config(tmp_path / "first.yaml", first))])
    assert result.exit_code == 0, result.output
    # an array only the old configuration had (as a kNN-prefilter run writes candidate_scores)
    group = storage.open_group(first.store().influence_url, {}, mode="a")
    group.create_array("candidate_scores", shape=(12, 3), dtype="float32", attributes={"fingerprint": group.attrs["fingerprints"]["aggregate"]})[...] = 1.0
    before = file_hashes(tmp_path / "out")

    second = small_params(str(tmp_path / "out"), method={"name": "cg", "regularization": 1e-3, "rtol": 1e-8}, aggregate={"top_k": 2, "report_queries": 3})
    config = write_config(tmp_path / "second.yaml", second)
    refused = runner.invoke(app, ["run", "--config", str(config)], terminal_width=300)
    assert refused.exit_code == 1, refused.output
    text = " ".join(refused.output.split())
    assert "output_url:" in text and "complete run of other parameters" in text and "--overwrite" in text
    assert file_hashes(tmp_path / "out") == before  # the earlier run is untouched, byte for byte

    replaced = runner.invoke(app, ["run", "--config", str(config), "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    group, arrays = read_outputs(second.store())
    assert group.attrs["config"]["method"]["name"] == "cg" and group.attrs["config"]["aggregate"]["top_k"] == 2
    assert "candidate_scores" not in arrays  # nothing of the replaced run survives
    assert arrays["topk_helpful_indices"].shape == (12, 2)
    np.testing.assert_array_equal(arrays["topk_helpful_indices"], np.argsort(-arrays["scores"], axis=1, kind="stable")[:, :2])
    assert_one_consistent_run(second, json.loads((tmp_path / "out" / "summary.json").read_text()))


def test_refusal_through_the_flow_happens_before_any_stage(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    first = small_params(str(tmp_path / "out"))
    influence_run(**first.sections())
    before = file_hashes(tmp_path / "out")
    other = small_params(str(tmp_path / "out"), training={"epochs": 16})
    state = influence_run(**other.sections(), return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match=r"output_url: .* holds a complete run of other parameters .* --overwrite"):
        state.result()
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    assert tasks == []  # not a single stage was started
    assert file_hashes(tmp_path / "out") == before

    again = influence_run(**first.sections())  # the same parameters are always welcome: everything is reused
    assert {stage["outcome"] for stage in again["stages"].values()} <= {"cached", "found complete"}


class CliRun:
    """`python -m flows.cli run --config ...` in its own process, its stderr collected as it comes."""

    def __init__(self, config: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--config", str(config)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self.reader = threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True)  # type: ignore[arg-type]
        self.reader.start()

    def waiting(self) -> bool:
        return any("waiting for it to finish" in line for line in list(self.err))

    def finish(self) -> tuple[int, str]:
        out = self.proc.stdout.read()  # type: ignore[union-attr]
        self.proc.wait(timeout=900)
        self.reader.join()
        return self.proc.returncode, out + "".join(self.err)


def printed_outcomes(log: str) -> dict[str, str]:
    """The stage outcomes the CLI prints at the end of a run (a stage's line may end with its metrics)."""
    found = dict(re.findall(r"^\s+(\w+)\s+(computed|cached|found complete)\s+[\d.]+ s(?: [^\n]*)?$", log, flags=re.M))
    assert list(found) == STAGES, log[-3000:]
    return found


def run_two_at_once(tmp_path: Path, first, second) -> tuple[tuple[int, str], tuple[int, str]]:
    """Start both runs while the output's run lock is held here, release it once both wait, and let them race."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO), "INFLUENCE_LOCK_DIR": str(tmp_path / "locks"), "COLUMNS": "300"}
    with exclusive_run(first.store(), on_wait=print):
        runs = [CliRun(write_config(tmp_path / f"{i}.yaml", p), env) for i, p in enumerate((first, second))]
        pause = threading.Event()
        while not all(run.waiting() for run in runs):
            assert all(run.proc.poll() is None for run in runs), [run.err for run in runs]
            pause.wait(0.2)
    return runs[0].finish(), runs[1].finish()


@pytest.mark.slow
def test_two_runs_at_once_with_the_same_parameters_share_the_work(tmp_path):
    params = small_params(str(tmp_path / "out"))
    (code_a, log_a), (code_b, log_b) = run_two_at_once(tmp_path, params, params)
    assert code_a == 0, log_a[-3000:]
    assert code_b == 0, log_b[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert_one_consistent_run(params, summary)
    reference = small_params(str(tmp_path / "reference"))
    influence_run(**reference.sections())
    assert_same_outputs(params.store(), read_outputs(reference.store())[1])
    # one run computed every stage; the one that got the lock second found them all complete
    outcomes = sorted((printed_outcomes(log_a), printed_outcomes(log_b)), key=lambda o: o["prepare_data"] != "computed")
    assert outcomes[0] == dict.fromkeys(STAGES, "computed")
    assert set(outcomes[1].values()) <= {"cached", "found complete"}
    assert outcomes[1] == {name: stage["outcome"] for name, stage in summary["stages"].items()}


@pytest.mark.slow
def test_two_runs_at_once_with_different_parameters_never_mix(tmp_path):
    first = small_params(str(tmp_path / "out"))
    second = small_params(str(tmp_path / "out"), aggregate={"top_k": 2, "report_queries": 3}, training={"epochs": 16})
    results = run_two_at_once(tmp_path, first, second)
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], [log[-3000:] for _, log in results]
    winner, loser = (first, second) if results[0][0] == 0 else (second, first)
    refused = " ".join(next(log for code, log in results if code == 1).split())
    assert "holds a running run of other parameters" in refused or "holds a complete run of other parameters" in refused
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert_one_consistent_run(winner, summary)
    assert summary["config"]["aggregate"]["top_k"] == winner.aggregate.top_k
    reference = winner.model_copy(update={"output_url": str(tmp_path / "reference")})
    influence_run(**reference.sections())
    assert_same_outputs(winner.store(), read_outputs(reference.store())[1])
    assert loser.run_fingerprint() != winner.run_fingerprint()
