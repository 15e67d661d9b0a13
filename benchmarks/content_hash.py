"""What keying a dataset file by its content costs: `storage.content_token` (a streamed sha256) on a multi-GB file,
beside this machine's plain read rate of the same file and its sha256 rate in memory, in one run.

    .venv/bin/python benchmarks/content_hash.py --gb 4

Each figure is the best of --reps. "cold" reads follow `echo 3 > /proc/sys/vm/drop_caches` where this process may
write it (root on a VM); otherwise only warm (page-cache) reads are reported, and the output says so.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

from influence_core.pipeline.store import storage

BLOCK = 8 * 2**20


def drop_caches() -> bool:
    """Empty the page cache so the next read comes from the disk; False where not permitted."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def plain_read(path: Path) -> float:
    """Seconds to read the file once in BLOCK steps, hashing nothing."""
    start = time.perf_counter()
    with path.open("rb") as handle:
        while handle.read(BLOCK):
            pass
    return time.perf_counter() - start


def token(path: Path) -> float:
    start = time.perf_counter()
    storage.content_token(str(path), {})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0, help="file size in GB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the file is written (default: a temporary folder on the project's disk)")
    args = parser.parse_args()
    size = int(args.gb * 1e9)
    with tempfile.TemporaryDirectory(dir=args.dir or Path(__file__).resolve().parent) as folder:
        path = Path(folder) / "data.npz"
        block = os.urandom(BLOCK)
        with path.open("wb") as handle:
            for _ in range(size // BLOCK):
                handle.write(block)
        gb = path.stat().st_size / 1e9
        buffer = block * 16  # 128 MiB, formed before the clock starts
        memory = min(_timed(lambda: hashlib.sha256(buffer).digest()) for _ in range(args.reps))
        print(f"file: {gb:.2f} GB; sha256 in memory: {len(buffer) / memory / 1e9:.2f} GB/s")
        for kind in ("warm", "cold"):
            if kind == "cold" and not drop_caches():
                print("cold: not measured (this process may not drop the page cache)")
                continue
            reads, hashes = [], []
            for _ in range(args.reps):  # alternating, each after the same cache state
                if kind == "cold":
                    drop_caches()
                reads.append(plain_read(path))
                if kind == "cold":
                    drop_caches()
                hashes.append(token(path))
            read, hashed = min(reads), min(hashes)
            print(f"{kind}: plain read {gb / read:.2f} GB/s ({read:.2f} s); content_token {gb / hashed:.2f} GB/s ({hashed:.2f} s); ratio {hashed / read:.2f}x")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
