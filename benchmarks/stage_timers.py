"""Wall seconds summed around named functions while one whole flow runs (benchmarks/peers/pipeline_runner.py), by
calling thread (the flow's main thread or a task thread): where a stage's own costs go, without a sampling profiler's
slowdown.

    .venv/bin/python benchmarks/stage_timers.py influence_core.pipeline.stages.index:IndexWorker.__init__,tasks.progress:ChunkProgress.__call__ \\
        --workload benchmarks/.scratch/peers/W3-... --method '{"name": "ekfac", "fisher": "sampled", "batch_size": 256}' \\
        --regularization 0.001 --out /tmp/run --scores /tmp/s.npy --compute '{}'

The first argument lists module:attribute (attribute dotted for a method); the rest go to pipeline_runner.py. The
totals print to stderr at exit, one line per function and thread kind, with the number of calls. A function is
replaced where its module holds it, so a caller that imported it by name before is not timed: name the caller's
module (e.g. `influence_core.pipeline.stages.index:load_influence_model`).
"""

from __future__ import annotations

import atexit
import collections
import functools
import importlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "peers")]

TOTALS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def timed(target: str) -> None:
    """Replace module:attribute with a wrapper adding its wall seconds to TOTALS."""
    module, _, attribute = target.partition(":")
    owner: Any = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            where = "main" if threading.current_thread() is threading.main_thread() else "thread"
            key = f"{module.rsplit('.', 1)[-1]}.{attribute} [{where}]"
            TOTALS[key] += time.perf_counter() - start
            CALLS[key] += 1

    setattr(owner, name, wrapper)


def report() -> None:
    for key, seconds in sorted(TOTALS.items()):
        print(f"TIMER {key}: {seconds:.3f} s x{CALLS[key]}", file=sys.stderr)


def main() -> None:
    targets, sys.argv[1:] = sys.argv[1], sys.argv[2:]
    for target in filter(None, targets.split(",")):
        timed(target)
    atexit.register(report)
    import pipeline_runner

    pipeline_runner.main()


if __name__ == "__main__":
    main()
