"""This machine's write rate as a stage sees it: rounds of files written back to back, each round's seconds and the
kernel's dirty bytes after it. On this VM a round of 488 MB took 0.09-0.15 s in some runs and ~1 s in others, from
the first round on or only once about 0.9 GB were dirty (2026-11-28): why a stage that writes hundreds of MB (W3's
query factors without an index, 465 MB) takes 0.1 s in one run and 1 s in the next.

    .venv/bin/python benchmarks/write_rate.py [--rounds 6] [--mb 465] [--dir benchmarks/.scratch/write_rate]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np

FILE_MB = 4.65  # one row of W3's query factors (1.16 M float32), the size of the chunks the stage writes


def dirty_mb() -> float:
    """The kernel's dirty and write-back pages, in MB (Linux)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[name].split()[0]) for name in ("Dirty", "Writeback")) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--mb", type=float, default=465.0, help="MB written per round")
    parser.add_argument("--dir", type=Path, default=Path("benchmarks/.scratch/write_rate"))
    args = parser.parse_args()
    files = max(1, round(args.mb / FILE_MB))
    block = np.random.default_rng(0).random(int(FILE_MB * 2**20 / 4), dtype=np.float32)
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        print(f"dirty before: {dirty_mb():.0f} MB")
        for round_ in range(args.rounds):
            start = time.perf_counter()
            for i in range(files):
                (args.dir / f"{round_}-{i}").write_bytes(memoryview(block))
            seconds = time.perf_counter() - start
            print(f"round {round_}: {files * block.nbytes / 1e6:.0f} MB in {seconds:.3f} s = {files * block.nbytes / 1e6 / seconds:,.0f} MB/s; dirty after: {dirty_mb():.0f} MB", flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
