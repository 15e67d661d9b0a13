"""A query-only question over a training index of 1,000,000 rows: seconds, peak RSS, and the index bytes read against
this disk's own read rate (the path should be I/O-bound).

    .venv/bin/python benchmarks/index_scale.py [--rows 1000000] [--queries 100] [--out DIR]

The index is built once by a pipeline run (synthetic 16-feature classification, a linear model, Direct on its
170 parameters, a local 2-worker cluster: 680 MB of float32 rows); then `influence-pipeline query` answers new
queries from it, cold (the page cache dropped first, where this machine allows it) and warm. Peak RSS is the query
process's (`ru_maxrss`). The disk's read rate is measured on the index's own files with the cache dropped. Writes
DIR/index_scale.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EXE = Path(sys.executable).with_name("influence-pipeline")


def drop_caches() -> bool:
    """Empty the page cache (root on Linux), so a read measures the disk; False where not allowed."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_rate(files: list[Path]) -> float:
    """MB/s of reading `files` once, front to back, in 8 MB blocks."""
    start, total = time.perf_counter(), 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while block := f.read(8 * 2**20):
                total += len(block)
    return total / 1e6 / (time.perf_counter() - start)


def build(out: Path, rows: int) -> dict:
    """The pipeline run that writes the index; its summary."""
    config = {
        "output_url": str(out / "run"), "dataset": {"source": "synthetic_classification", "n_features": 16, "n_classes": 10, "n_train": rows, "n_test": 10, "chunk_rows": 65536},
        "model": {"architecture": "linear"}, "training": {"epochs": 1, "batch_size": 1024},
        "method": {"name": "direct", "regularization": 1e-3, "batch_size": 4096}, "compute": {"cluster": "local", "n_workers": 2, "index_budget_gb": 2.0},
        "aggregate": {"top_k": 5, "self_influence": "off"},
    }
    (out / "build.json").write_text(json.dumps(config))
    import yaml

    (out / "build.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([str(EXE), "run", "--config", str(out / "build.yaml"), "--overwrite"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "run" / "summary.json").read_text())


def ask(out: Path, queries: int, cold: bool) -> dict:
    """One `influence-pipeline query` process: wall seconds, its own peak RSS (wait4's, not the build's), its work line."""
    rng = np.random.default_rng(1)
    np.savez(out / "queries.npz", x=rng.standard_normal((queries, 16)).astype(np.float32), y=rng.integers(0, 10, queries))
    dropped = drop_caches() if cold else False
    log = out / "query.log"
    start = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen([str(EXE), "query", str(out / "run"), "--queries", str(out / "queries.npz"), "--top", "5"], stdout=sink, stderr=subprocess.STDOUT, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    printed = log.read_text()
    assert proc.returncode == 0, printed[-3000:]
    line = next(text for text in printed.splitlines() if " queries in " in text)  # "100 queries in 2.16 s: ..."
    return {"wall": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "cache_dropped": dropped, "line": line, "answer": float(line.split(" queries in ")[1].split(" s")[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / ".scratch" / "index_scale")
    parser.add_argument("--reuse", action="store_true", help="ask the run already built under --out instead of building it again")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    summary = json.loads((args.out / "run" / "summary.json").read_text()) if args.reuse else build(args.out, args.rows)
    built = summary["wall_seconds"] if args.reuse else time.perf_counter() - start
    index = summary["stages"]["index_training"]
    root = Path(index["url"]) if Path(index["url"]).is_absolute() else args.out / "run" / index["url"]
    files = sorted(path for path in root.rglob("*") if path.is_file() and path.name != "zarr.json")  # the chunk files
    size = sum(f.stat().st_size for f in files)
    cold_disk = drop_caches()
    disk = read_rate(files)
    cold = ask(args.out, args.queries, cold=True)
    warm = ask(args.out, args.queries, cold=False)
    lines = [
        f"# A question over a {args.rows:,}-row training index", "",
        f"Built by one pipeline run in {built:.0f} s (index_training {index['seconds']:.1f} s, {index['bytes_per_row']} bytes a row, {size / 1e6:.0f} MB in {len(files)} chunk files).",
        f"This disk read the index files at {disk:.0f} MB/s ({'page cache dropped' if cold_disk else 'page cache NOT dropped: a warm figure'}).", "",
        "| question | process wall s | answer s | peak RSS MB | index MB/s over the process / the answer | work |", "|---|---|---|---|---|---|",
    ]
    for name, r in (("cold", cold), ("warm", warm)):
        rates = f"{size / 1e6 / r['wall']:.0f} / {size / 1e6 / r['answer']:.0f}"
        lines.append(f"| {args.queries} queries, {name}{'' if r['cache_dropped'] or name == 'warm' else ' (cache not dropped)'} | {r['wall']:.2f} | {r['answer']:.2f} | {r['peak_rss_mb']:.0f} | {rates} | {r['line']} |")
    text = "\n".join(lines) + "\n"
    (args.out / "index_scale.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
