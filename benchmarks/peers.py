"""Side-by-side peer benchmark: this project against pyDVL 0.10 and Kronfluence 1.0.1 on the same models and data.

    make bench                                   (= .venv/bin/python benchmarks/peers.py)
    .venv/bin/python benchmarks/peers.py --quick (tiny sizes, one repetition: a smoke run of a few minutes)

1. Builds the peers' virtualenvs (benchmarks/.venvs/, idempotent) and measures the machine's float32 GEMM rate
   (benchmarks/peers/gemm.py, at the start and at the end of the run).
2. Prepares each workload once (benchmarks/peers/workloads.py: seeded data and a trained MLP as .npz + state_dict)
   and its exact float64 answers (benchmarks/peers/reference.py), cached under the scratch directory.
3. Runs every side as its own subprocess (benchmarks/peers/*_runner.py, each in its own venv; one JSON line,
   peak RSS per side), alternating sides (ours, peer, ours, peer), and keeps the minimum of the repetitions per
   stage (a side whose first run took longer than --repeat-under seconds runs once; one that fails or exceeds
   --timeout is reported as such); then this project's whole Prefect flow on the same data and model
   (pipeline_runner.py).
4. Writes benchmarks/results/peers.md (tables, flop model, GEMM rates, commands, targets), peers.png (seconds per
   stage per side per workload) and peers.json (every raw result), and prints the summary (each side's best W2
   path and the targets). `--report-only` rewrites the report from peers.json without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import execute  # noqa: E402
import plan as planning  # noqa: E402
import report  # noqa: E402
import workloads  # noqa: E402

RUNNERS = {"ours": "ours_runner.py", "pydvl": "pydvl_runner.py", "kronfluence": "kronfluence_runner.py"}
SETUP = {"pydvl": ROOT / "benchmarks" / "pydvl" / "setup_env.sh", "kronfluence": PEERS / "setup_kronfluence.sh"}
THREADS = 2  # every side's torch threads; the GEMM rate at this count is the ceiling the stages are compared with


def measured_commit() -> str:
    """The commit being measured, marked `+dirty` when the work tree differs from it (results name their code)."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def venv_pythons() -> dict[str, str]:
    """The python of each side: this one for ours, the peers' (built on first use, stamped) for theirs."""
    pythons = {"ours": sys.executable}
    for side, script in SETUP.items():
        out = subprocess.run(["bash", str(script)], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{script} failed:\n{out.stderr[-3000:]}")
        pythons[side] = out.stdout.strip().splitlines()[-1]
    return pythons


def ours_options() -> set[str]:
    """Optional options this version of ours' EK-FAC accepts (`query_rank`, being added concurrently): probed by
    constructing it on a tiny model, so a name that is declared but not passed through does not count."""
    from torch import nn

    from influence_core import EkfacInfluence

    found = set()
    for option, value in {"query_rank": 2}.items():
        try:
            EkfacInfluence(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), "cross_entropy", 1e-3, **{option: value})
            found.add(option)
        except TypeError:
            continue
    return found


class Harness:
    """Runs the plan and collects every result into one JSON-serialisable dict."""

    def __init__(self, args: argparse.Namespace, pythons: dict[str, str]) -> None:
        self.args, self.pythons = args, pythons
        self.scratch = Path(args.scratch).resolve()
        self.logs = self.scratch / "logs"
        self.results: dict[str, Any] = {"runs": {}, "rows": [], "pipelines": [], "references": {}, "commands": [], "workloads": {}}
        self.dirs: dict[str, Path] = {}
        self.specs: dict[str, dict[str, Any]] = {}

    def lam(self, workload: str) -> float:
        return float(self.specs[workload]["regularization"])

    def command(self, cmd: list[str], kind: str) -> list[str]:
        self.results["commands"].append({"kind": kind, "command": " ".join(shlex.quote(c) for c in cmd)})
        return cmd

    def prepare(self, names: list[str]) -> None:
        for name in names:
            spec = workloads.workload_spec(name, self.args.quick)
            start = time.perf_counter()
            root = workloads.prepare(spec, self.scratch)
            self.dirs[name] = root
            self.specs[name] = {**json.loads((root / "workload.json").read_text()), "regularization": spec["regularization"]}
            self.results["workloads"][name] = {"dir": str(root), "spec": self.specs[name], "prepare_seconds": time.perf_counter() - start}
            print(f"[peers] {name}: {root.name} p={self.specs[name]['n_params']:,} n_train={self.specs[name]['n_train']} n_test={self.specs[name]['n_test']} λ={self.lam(name):g}", flush=True)

    def reference(self, workload: str, ref: planning.Reference) -> None:
        """Compute (or find) an exact answer; cached beside the workload, keyed by matrix, solver, queries, λ."""
        queries = min(ref.queries, self.specs[workload]["n_test"])
        path = self.dirs[workload] / f"exact-{ref.matrix}-{ref.solver}-q{queries}-lam{self.lam(workload):g}.npy"
        meta = path.with_suffix(".json")
        if not path.exists():
            cmd = self.command([self.pythons["ours"], str(PEERS / "reference.py"), "--workload", str(self.dirs[workload]), "--matrix", ref.matrix,
                                "--solver", ref.solver, "--queries", str(queries), "--regularization", str(self.lam(workload)), "--out", str(path),
                                *ref.arguments], "reference")
            print(f"[peers] {workload}: exact {ref.matrix} by {ref.solver} on {queries} queries ...", flush=True)
            result = execute.run_json(cmd, self.args.reference_timeout, self.logs / f"{workload}-exact-{ref.matrix}.log")
            if not execute.ok(result):
                print(f"[peers]   {execute.outcome(result)}", flush=True)
                self.results["references"].setdefault(workload, {})[ref.matrix] = {**result, "queries": queries}
                return
            meta.write_text(json.dumps(result))
        result = json.loads(meta.read_text())
        self.results["references"].setdefault(workload, {})[ref.matrix] = {**result, "file": str(path), "queries": queries}
        print(f"[peers]   exact {ref.matrix}: {result.get('seconds', 0):.0f} s {result.get('iterations', '')}", flush=True)

    def run_config(self, workload: str, config: planning.Config, rep: int) -> dict[str, Any]:
        scores = self.dirs[workload] / "scores" / f"{config.key}.npy"
        scores.parent.mkdir(exist_ok=True)
        cmd = self.command([self.pythons[config.side], str(PEERS / RUNNERS[config.side]), "--workload", str(self.dirs[workload]), "--method", config.method,
                            "--options", json.dumps(config.options), "--regularization", str(self.lam(workload)), "--threads", str(THREADS),
                            "--scores", str(scores)], "side")
        result = execute.run_json(cmd, self.args.timeout, self.logs / f"{workload}-{config.key}-rep{rep}.log")
        stages = result.get("stages", {})
        print(f"[peers] {workload} {config.side:11s} {config.label}: rep {rep}: "
              + (", ".join(f"{k} {v:.2f} s" for k, v in stages.items()) if execute.ok(result) else execute.outcome(result)), flush=True)
        return {**result, "scores_file": str(scores)} if execute.ok(result) else result

    def run_row(self, row: planning.Row, kind: str) -> None:
        """Alternate the row's configurations rep by rep (ours, peer, ours, peer); a configuration already run on
        this workload (in another row) is not run again."""
        reps = row.reps or self.args.reps
        keys = [f"{row.workload}/{c.key}" for c in row.configs]
        todo = [(k, c) for k, c in zip(keys, row.configs) if k not in self.results["runs"]]
        for key, c in todo:
            self.results["runs"][key] = {"workload": row.workload, "config": asdict(c), "reps": []}
        for rep in range(reps):
            for key, c in todo:
                runs = self.results["runs"][key]["reps"]
                if rep > 0 and runs and not execute.ok(runs[-1]):
                    continue  # a side that failed or timed out is not tried again
                if rep > 0 and runs and runs[0]["wall"] > self.args.repeat_under:
                    continue  # too long to repeat within the run's time; the report shows its repetitions
                runs.append(self.run_config(row.workload, c, rep))
        self.results["rows"].append({"workload": row.workload, "title": row.title, "kind": kind, "configs": keys})

    def pipeline(self, item: planning.Pipeline, run_anyway: bool) -> None:
        """The whole flow, `--reps` times, each in a fresh output directory and PREFECT_HOME (nothing cached), each
        right after a run of its library row's configuration (library, pipeline, library, pipeline), kept with the
        pipeline's (`library_reps`): the two are compared under the same load, and the peer rows keep their own reps."""
        from pipeline_runner import self_influence_switch

        entry: dict[str, Any] = {"workload": item.workload, "title": item.title, "library": f"{item.workload}/{item.config.key}", "reps": [], "method": item.method,
                                 "compute": item.compute}
        self.results["pipelines"].append(entry)
        if not self_influence_switch() and not run_anyway:
            entry["skipped"] = ("this version has no `aggregate.self_influence` switch, so compute_influences would also precondition every "
                                f"training example for self-influence ({self.specs[item.workload]['n_train']:,} extra {item.method['name']} solves), "
                                "not the work of the library row; rerun with --pipeline-with-self-influence to measure it anyway")
            print(f"[peers] {item.workload} pipeline skipped: {entry['skipped']}", flush=True)
            return
        entry["library_reps"] = []
        for rep in range(self.args.reps):
            entry["library_reps"].append(self.run_config(item.workload, item.config, rep))
            run_dir = Path(tempfile.mkdtemp(prefix=f"pipeline-{item.workload}-", dir=self.scratch))
            scores = self.dirs[item.workload] / "scores" / item.scores_name
            cmd = self.command([self.pythons["ours"], str(PEERS / "pipeline_runner.py"), "--workload", str(self.dirs[item.workload]),
                                "--method", json.dumps(item.method), "--regularization", str(self.lam(item.workload)), "--out", str(run_dir / "run"),
                                "--scores", str(scores), "--compute", json.dumps(item.compute)], "pipeline")
            env = {"PREFECT_HOME": str(run_dir / "prefect"), "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                   "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "600"}  # a loaded machine starts the API slowly
            result = execute.run_json(cmd, self.args.timeout, self.logs / f"{item.workload}-pipeline-rep{rep}.log", env=env)
            if execute.ok(result):
                result["scores_file"] = str(scores)
            entry["reps"].append(result)
            print(f"[peers] {item.workload} pipeline rep {rep}: "
                  + (", ".join(f"{k} {v:.2f} s" for k, v in result["stages"].items()) if execute.ok(result) else execute.outcome(result)), flush=True)
            if not execute.ok(result):
                break

    def save(self, path: Path) -> None:
        """The raw results so far (rewritten after every row, so an interrupted run keeps what it measured)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.results, indent=1, default=str))

    def gemm(self, when: str) -> None:
        cmd = self.command([self.pythons["ours"], str(PEERS / "gemm.py"), "--threads", "1", str(THREADS), "--sizes", *map(str, self.args.gemm_sizes)], "gemm")
        result = execute.run_json(cmd, 600, self.logs / f"gemm-{when}.log")
        self.results.setdefault("gemm", {})[when] = {**result, "load_average": os.getloadavg()}
        print(f"[peers] GEMM float32 ({when}): {result.get('best')} GFLOP/s by thread count, load average {os.getloadavg()}", flush=True)


def agreement(results: dict[str, Any]) -> None:
    """Pearson, Spearman and scale of every run's scores against ours' in its row and against the exact answer of
    each matrix (on the rows the exact answer covers)."""
    from scipy.stats import pearsonr, spearmanr

    def load(run: dict[str, Any]) -> np.ndarray | None:
        """The last good repetition's scores; None when there is none or its file is gone (a merged older run
        keeps the agreement it recorded)."""
        good = [r for r in run["reps"] if execute.ok(r)]
        return np.load(good[-1]["scores_file"]).astype(np.float64) if good and Path(good[-1]["scores_file"]).exists() else None

    def corr(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
        """Correlations of a with b, and the least-squares scale of a on b (1 when the two share a scale)."""
        a, b = a.ravel(), b.ravel()
        return {"pearson": float(pearsonr(a, b)[0]), "spearman": float(spearmanr(a, b)[0]), "scale": float(a @ b / (b @ b)), "pairs": int(a.size)}

    exact = {w: {m: np.load(r["file"]) for m, r in refs.items() if "file" in r and Path(r["file"]).exists()} for w, refs in results["references"].items()}
    for key, run in results["runs"].items():
        scores = load(run)
        if scores is None or not np.isfinite(scores).all():
            continue
        refs = exact.get(run["workload"], {})
        if refs or "vs_exact" not in run:
            run["vs_exact"] = {m: corr(scores[: len(e)], e) for m, e in refs.items()}
    for key, run in results["runs"].items():  # low-rank query factors against the same side's full rank
        options = run["config"]["options"]
        if "query_rank" in options:
            full = next((k for k, r in results["runs"].items() if r["workload"] == run["workload"] and r["config"]["side"] == run["config"]["side"]
                         and r["config"]["method"] == run["config"]["method"] and "query_rank" not in r["config"]["options"]), None)
            mine, theirs = load(run), load(results["runs"][full]) if full else None
            if mine is not None and theirs is not None:
                run["vs_full_rank"] = corr(mine, theirs)
    for row in results["rows"]:
        first = results["runs"][row["configs"][0]]
        base = load(first)
        for key in row["configs"][1:]:
            other = load(results["runs"][key])
            if base is not None and other is not None and np.isfinite(other).all():
                results["runs"][key].setdefault("vs_ours", {})[row["configs"][0]] = corr(other, base)
    for entry in results["pipelines"]:
        good = [r for r in entry["reps"] if execute.ok(r)]
        lib = load({"reps": entry["library_reps"]} if entry.get("library_reps") else results["runs"][entry["library"]])  # alternated with it
        if good and lib is not None and Path(good[-1]["scores_file"]).exists():
            entry["vs_library"] = corr(np.load(good[-1]["scores_file"]), lib)


def merge(paths: list[str]) -> dict[str, Any]:
    """One result from the peers.json files of separate runs (e.g. one workload per run, the machine idle for each):
    runs, rows, pipelines and references are united, each run's GEMM rates kept under its workloads' names."""
    parts = [json.loads(Path(path).read_text()) for path in paths]
    merged: dict[str, Any] = {"runs": {}, "rows": [], "pipelines": [], "references": {}, "commands": [], "workloads": {}, "gemm": {}, "skipped": []}
    for part in parts:
        for key in ("runs", "references", "workloads"):
            merged[key].update(part.get(key, {}))
        for key in ("rows", "pipelines", "commands"):
            merged[key] += part.get(key, [])
        merged["skipped"] += [s for s in part.get("skipped", []) if s not in merged["skipped"]]
        name = "+".join(part.get("workloads", {})) or "run"
        merged["gemm"].update({f"{name} {when}": g for when, g in part.get("gemm", {}).items()})
    complete = all("total_seconds" in part for part in parts)
    merged["machine"] = min((part["machine"] for part in parts), key=lambda m: m["started"])
    merged["argv"] = ["benchmarks/peers.py", "--merge", *paths]
    merged["merged_from"] = [{"argv": part["argv"], "started": part["machine"]["started"], "commit": part["machine"].get("commit", "unknown"),
                             "complete": "total_seconds" in part} for part in parts]
    if complete:
        merged["total_seconds"] = sum(part["total_seconds"] for part in parts)
    return merged


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny workloads and one repetition: a smoke run")
    p.add_argument("--workloads", nargs="+", default=["W1", "W2", "W3", "W4"], choices=["W1", "W2", "W3", "W4"])
    p.add_argument("--reps", type=int, default=None, help="repetitions per side (default 2; 1 with --quick)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before one side's run is killed and reported as timed out")
    p.add_argument("--repeat-under", type=float, default=1200, help="repeat a side only when its first run took less than this many seconds")
    p.add_argument("--reference-timeout", type=float, default=None, help="seconds allowed for one exact answer")
    p.add_argument("--gemm-sizes", type=int, nargs="+", default=None)
    p.add_argument("--pipeline-with-self-influence", action="store_true", help="run the pipeline rows even when self-influence cannot be switched off")
    p.add_argument("--scratch", default=str(ROOT / "benchmarks" / ".scratch" / "peers"), help="workloads, scores, logs (kept between runs)")
    p.add_argument("--results", default=None, help="where peers.md, peers.png and peers.json go (default benchmarks/results; --quick: the scratch directory)")
    p.add_argument("--report-only", action="store_true", help="recompute agreement and rewrite peers.md/png from the existing peers.json")
    p.add_argument("--pipelines-only", action="store_true", help="only the whole-flow rows, each beside its library row (no peer venvs, exact answers or peer rows)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="write one report from the peers.json of separate runs (e.g. --workloads W1, then W2, ...)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the running side is killed with its workers
    args.reps = args.reps or (1 if args.quick else 2)
    args.timeout = args.timeout or (600 if args.quick else 5400)
    args.reference_timeout = args.reference_timeout or (600 if args.quick else 7200)
    args.gemm_sizes = args.gemm_sizes or ([1024, 2048] if args.quick else [2048, 4096])
    suffix = "-quick" if args.quick else ""
    out = Path(args.results or (Path(args.scratch) if args.quick else ROOT / "benchmarks" / "results"))
    raw = out / f"peers{suffix}.json"
    if args.report_only or args.merge:
        results = merge(args.merge) if args.merge else json.loads(raw.read_text())
        if args.merge:
            out.mkdir(parents=True, exist_ok=True)
            raw.write_text(json.dumps(results, indent=1))
        agreement(results)
        print(report.summary(report.write(results, out, suffix, planning.E2E_PEARSON, THREADS), out / f"peers{suffix}.md"))
        return

    started = time.perf_counter()
    pythons = {"ours": sys.executable} if args.pipelines_only else venv_pythons()
    harness = Harness(args, pythons)
    harness.results["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                                  "commit": measured_commit(), "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    harness.results["argv"] = ["benchmarks/peers.py", *(argv if argv is not None else sys.argv[1:])]
    harness.gemm("start")
    import torch

    plan = planning.build(args.quick, args.workloads, ours_options(), torch.cuda.is_available())
    harness.results["skipped"] = list(plan.skipped)
    harness.prepare(args.workloads)
    if args.pipelines_only:
        plan = planning.Plan([], [], {}, plan.pipelines, plan.skipped)
    for workload, refs in plan.references.items():
        for ref in refs:
            harness.reference(workload, ref)
    order = {"W1": 0, "W4": 1, "W3": 2, "W2": 3}  # the cheaper workloads first, so an interrupted run has them
    for row in sorted(plan.rows, key=lambda r: order[r.workload]):
        harness.run_row(row, "compare")
        harness.save(raw)
    for row in plan.sweep:
        harness.run_row(row, "sweep")
        harness.save(raw)
    for item in sorted(plan.pipelines, key=lambda i: order[i.workload]):
        harness.pipeline(item, args.quick or args.pipeline_with_self_influence)
        harness.save(raw)
    harness.gemm("end")
    harness.results["total_seconds"] = time.perf_counter() - started
    harness.save(raw)
    agreement(harness.results)
    harness.save(raw)
    print(report.summary(report.write(harness.results, out, suffix, planning.E2E_PEARSON, THREADS), out / f"peers{suffix}.md"))


if __name__ == "__main__":
    main()
