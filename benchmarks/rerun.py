"""Cost of a repeated run: the demo flow twice with the same parameters, then once with only top_k changed.

    .venv/bin/python benchmarks/rerun.py [output_dir]

Runs against Prefect's ephemeral API (started once, before the first timing) and a local Dask cluster.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time

from flows.influence_run import influence_run
from flows.parameters import RunParameters


def timed(params: RunParameters) -> tuple[float, dict[str, str]]:
    start = time.perf_counter()
    summary = influence_run(**params.sections())
    return time.perf_counter() - start, {name: s["outcome"] for name, s in summary["stages"].items()}


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="rerun-")
    shutil.rmtree(out, ignore_errors=True)
    params = RunParameters(output_url=out)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # start the ephemeral API outside the timings
        client.hello()
    first, o1 = timed(params)
    second, o2 = timed(params)
    params = params.model_copy(update={"aggregate": params.aggregate.model_copy(update={"top_k": 3}), "overwrite": True})  # other parameters, same output
    third, o3 = timed(params)
    print(f"first run (all computed)     {first:7.2f} s  {o1}")
    print(f"same parameters              {second:7.2f} s  ({second / first:.1%} of the first)  {o2}")
    print(f"only aggregate.top_k changed {third:7.2f} s  ({third / first:.1%} of the first)  {o3}")


if __name__ == "__main__":
    main()
