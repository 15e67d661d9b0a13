"""The peer benchmark's own parts: our runner's scores against the independent float64 reference, the reference's
solvers against each other, and the subprocess wrapper's failure reporting (benchmarks/peers/)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import execute  # noqa: E402
import workloads  # noqa: E402

LAM = 0.2  # above the tiny model's most negative Hessian eigenvalue (about -0.06)
SPEC = {"name": "T", "source": "synthetic", "features": 6, "hidden": [5], "activation": "tanh", "classes": 3, "n_train": 120, "n_test": 7,
        "regularization": LAM, "epochs": 30, "batch": 32, "lr": 1e-2, "weight_decay": 1e-3, "seed": 3, "quick": True}


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return workloads.prepare(SPEC, tmp_path_factory.mktemp("peers"))


def run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, str(PEERS / script), *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def reference(workload: Path, matrix: str, solver: str, out: Path, *options: str) -> np.ndarray:
    run("reference.py", "--workload", str(workload), "--matrix", matrix, "--solver", solver, "--queries", "7", "--regularization", str(LAM), "--out", str(out), *options)
    return np.load(out)


@pytest.fixture(scope="module")
def direct(workload: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], np.ndarray]:
    """The reference's float64 Direct solve of each matrix, computed once for the module's tests (a subprocess each)."""
    out = tmp_path_factory.mktemp("direct")

    @functools.cache
    def solve(matrix: str) -> np.ndarray:
        return reference(workload, matrix, "direct", out / f"{matrix}.npy")

    return solve


def test_prepare_is_deterministic_and_reused(workload: Path, tmp_path: Path) -> None:
    again = workloads.prepare(SPEC, tmp_path)
    with np.load(workload / "data.npz") as a, np.load(again / "data.npz") as b:
        assert all(np.array_equal(a[k], b[k]) for k in a.files)
    assert json.loads((again / "workload.json").read_text())["n_params"] == 6 * 5 + 5 + 5 * 3 + 3
    assert workloads.prepare(SPEC, tmp_path) == again  # found complete, not written again


@pytest.mark.slow  # a subprocess per runner and reference solve, ~6 s each: the benchmark's harness, run by make test-e2e
@pytest.mark.parametrize(("method", "mode", "matrix"), [("direct", "hessian", "hessian"), ("cg", "gauss_newton", "ggn")])
def test_our_runner_matches_the_independent_reference(workload: Path, direct: Callable[[str], np.ndarray], tmp_path: Path, method: str, mode: str, matrix: str) -> None:
    """Sign, scale and λ of the runner's scores, against reference.py's float64 Direct solve (torch.func only)."""
    options = {"second_order_mode": mode, **({"rtol": 1e-7} if method == "cg" else {})}
    result = run("ours_runner.py", "--workload", str(workload), "--method", method, "--options", json.dumps(options),
                 "--regularization", str(LAM), "--scores", str(tmp_path / "ours.npy"))
    exact = direct(matrix)
    ours = np.load(tmp_path / "ours.npy")
    assert ours.shape == exact.shape == (7, 120)
    np.testing.assert_allclose(ours, exact, rtol=0, atol=2e-4 * np.abs(exact).max())
    assert set(result["stages"]) == {"fit", "query_factors", "pairwise"} and result["peak_rss_bytes"] > 0


W4_SOLVE = ("--preconditioner", "nystroem", "--preconditioner-rank", "8", "--product-dtype", "float32", "--rtol", "1e-6")  # as plan.py's W4


@pytest.mark.slow
@pytest.mark.parametrize(("matrix", "solver", "options", "tol"), [("hessian", "cg", (), 1e-7), ("ggn", "cg", (), 1e-7), ("ef", "woodbury", (), 1e-7),
                                                                  ("ggn", "block-cg", W4_SOLVE, 1e-5)])
def test_reference_solvers_agree_with_its_direct_solve(workload: Path, direct: Callable[[str], np.ndarray], tmp_path: Path, matrix: str, solver: str, options: tuple[str, ...], tol: float) -> None:
    other = reference(workload, matrix, solver, tmp_path / "other.npy", *options)
    np.testing.assert_allclose(other, direct(matrix), rtol=0, atol=tol * np.abs(direct(matrix)).max())


def test_failures_and_timeouts_are_results(tmp_path: Path) -> None:
    failed = execute.run_json([sys.executable, "-c", "import sys; sys.exit('boom')"], 60, tmp_path / "fail.log")
    assert failed["failed"] and "boom" in failed["error"] and not execute.ok(failed)
    slow = execute.run_json([sys.executable, "-c", "import time; time.sleep(600)"], 1, tmp_path / "slow.log")
    assert slow["timed_out"] and execute.outcome(slow) == "timed out after 1 s"
    fine = execute.run_json([sys.executable, "-c", "print('{\"x\": 1}')"], 60, tmp_path / "ok.log")
    assert execute.ok(fine) and fine["x"] == 1


def test_separate_runs_merge_into_one_report(tmp_path: Path) -> None:
    """Workloads run one per process merge into one result: every run, row and GEMM rate kept, an interrupted part
    leaves the whole marked interrupted, and each part keeps the commit it measured."""
    sys.path.insert(0, str(PEERS.parent))
    import peers

    def part(name: str, started: str, complete: bool) -> Path:
        result = {"runs": {f"{name}/ours": {"seconds": 1}}, "rows": [{"workload": name}], "pipelines": [], "references": {name: []},
                  "commands": [f"cmd {name}"], "workloads": {name: {}}, "gemm": {"start": {"best": {"2": 100.0}}},
                  "skipped": ["same note"], "machine": {"started": started, "cpus": 2, "commit": f"c{name}"}, "argv": ["benchmarks/peers.py", "--workloads", name]}
        if complete:
            result["total_seconds"] = 60.0
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(result))
        return path

    merged = peers.merge([str(part("W1", "2026-01-02", True)), str(part("W2", "2026-01-01", True))])
    assert set(merged["runs"]) == {"W1/ours", "W2/ours"} and [r["workload"] for r in merged["rows"]] == ["W1", "W2"]
    assert set(merged["gemm"]) == {"W1 start", "W2 start"} and merged["skipped"] == ["same note"]
    assert merged["machine"]["started"] == "2026-01-01" and merged["total_seconds"] == 120.0
    assert [m["commit"] for m in merged["merged_from"]] == ["cW1", "cW2"]  # each part names the code it measured
    assert "total_seconds" not in peers.merge([str(part("W1", "2026-01-02", True)), str(part("W3", "2026-01-03", False))])
