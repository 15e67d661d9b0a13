"""This project's whole Prefect flow on a benchmark workload, in its own process (run by benchmarks/peers.py).

    .venv/bin/python benchmarks/peers/pipeline_runner.py --workload DIR --method '{"name": "cg", ...}' \
        --regularization 0.1 --out RUN_DIR --scores S.npy

Same data (source `npz`) and model (`model.checkpoint` = the workload's state_dict, hidden widths and activation
matching) as the library rows; a local Dask cluster of 2 single-threaded workers, 2 torch threads for the stages
that compute in the flow process, `aggregate.top_k` 5, and `aggregate.self_influence` off when this version has
that switch (`self_influence` in the output tells). Prefect runs on its ephemeral API (a temporary PREFECT_HOME,
set by the caller). Prints one JSON line: per-stage seconds from summary.json (`stages.<name>.seconds`), the
flow's wall time, the peak RSS of the whole process tree (driver and workers, sampled), and saves the scores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.memory import PeakRSS  # noqa: E402


def self_influence_off() -> dict:
    """The `aggregate` setting that leaves self-influence out in this version ("off", or False), or {} when it
    has no such switch (self-influence is then always computed)."""
    from pydantic import ValidationError

    from influence_core.pipeline.specs import AggregateSpec

    for value in ("off", False):
        try:
            AggregateSpec(self_influence=value)
            return {"self_influence": value}
        except ValidationError:
            continue
    return {}


def self_influence_switch() -> bool:
    """Whether this version can leave self-influence out (`aggregate.self_influence`)."""
    return bool(self_influence_off())


def model_section(spec: dict, checkpoint: Path) -> dict:
    """The built-in architecture whose state_dict the workload's model.pt is: the MLP, or (W4) the causal transformer."""
    if spec.get("model") == "gpt":
        return {"architecture": "transformer", "task": "language_modelling", "d_model": spec["d_model"], "heads": spec["heads"], "layers": spec["blocks"],
                "vocab_size": spec["vocab"], "checkpoint": str(checkpoint)}
    return {"architecture": "mlp", "hidden": spec["hidden"], "activation": spec["activation"], "output_dim": spec["classes"], "checkpoint": str(checkpoint)}


def rerank_off() -> dict:
    """The `aggregate` setting that leaves re-ranking out in this version (the library side re-ranks nothing), or {}
    when it has none."""
    from influence_core.pipeline.specs import AggregateSpec

    return {"rerank": 0} if "rerank" in AggregateSpec.model_fields else {}


def parameters(workload: Path, method: dict, regularization: float, out: Path, compute: dict) -> dict:
    spec = json.loads((workload / "workload.json").read_text())
    aggregate = {"top_k": 5, **self_influence_off(), **rerank_off()}
    return {
        "output_url": str(out),
        "dataset": {"source": "npz", "path": str(workload / "data.npz")},
        "model": model_section(spec, workload / "model.pt"),
        "method": {**method, "regularization": regularization},
        "compute": {"cluster": "local", "n_workers": 2, "torch_threads": 2, **compute},
        "aggregate": aggregate,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True, type=Path)
    p.add_argument("--method", required=True, help="the `method` section as JSON (without regularization)")
    p.add_argument("--regularization", type=float, required=True)
    p.add_argument("--out", required=True, type=Path, help="a fresh output directory for the run")
    p.add_argument("--scores", required=True)
    p.add_argument("--compute", default="{}", help="more `compute` options as JSON, e.g. '{\"index_budget_gb\": 0}'")
    a = p.parse_args()

    from flows.influence_run import influence_run
    from flows.parameters import RunParameters
    from influence_core.pipeline.store import storage

    params = RunParameters.model_validate(parameters(a.workload, json.loads(a.method), a.regularization, a.out, json.loads(a.compute)))
    with PeakRSS() as memory:
        start = time.perf_counter()
        summary = influence_run(**params.sections())
        wall = time.perf_counter() - start
    group = storage.open_group(params.store().influence_url, {}, mode="r")
    np.save(a.scores, np.asarray(group["scores"][...], dtype=np.float32))
    print(json.dumps({
        "stages": {name: stage["seconds"] for name, stage in summary["stages"].items()},
        "outcomes": {name: stage["outcome"] for name, stage in summary["stages"].items()},
        "flow_wall": wall,
        "peak_rss_bytes": memory.peak,
        "self_influence": not self_influence_switch(),
        "parameters": params.public_config(),
    }))


if __name__ == "__main__":
    main()
