"""Direct's fit on issue 52's item 19: a CNN of 3,657 parameters (the pipeline's `cnn` with channels [14, 21] on 8×8
digits) over 4,000 rows, before and after its Gauss-Newton matrix became a Gram matrix of per-example rows.

    .venv/bin/python benchmarks/direct_matrix.py [--before-ref 3c23046] [--before-rows 64] [--hessian-rows 256]

Every side runs in a process of its own on the same trained model and rows (saved to a temporary file), with this
venv's interpreter and the code under test first on PYTHONPATH:
- after: this checkout's `DirectInfluence.fit` (Gauss-Newton, λ = 1e-3) over all 4,000 rows;
- before: the code at --before-ref (by `git archive`) over the first --before-rows rows, its seconds scaled by
  4,000 / rows: it formed the matrix from p products with the identity per batch, p·n (vector, row) products in all,
  linear in the rows (its Cholesky, p³/3 flops, under a second here, is scaled with them, a small overestimate);
- hessian (unless --hessian-rows 0): this checkout under second_order_mode hessian (λ = 1: the Hessian is indefinite)
  over --hessian-rows rows, scaled alike: still products with the identity, p per batch.
Each side reports wall and CPU seconds, its work counters and its progress lines (the longest silence between the
start, each line and the end). The machine's float32 GEMM rate (benchmarks/peers/gemm.py, 2,048², the torch threads
in force) and the load average are measured in the same run. Writes benchmarks/results/direct_matrix.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "direct_matrix.md"
ROWS, CHANNELS, LAM, SEED = 4000, [14, 21], 1e-3, 0
HESSIAN_LAM = 1.0  # the Hessian of this partly trained CNN is indefinite (smallest eigenvalue about -0.2): a λ its Cholesky takes; the matrix's cost does not depend on λ


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    """4,000 rows of 8×8 digits: the 1,797 images drawn with replacement, plus Gaussian noise of 0.1 (seeded)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    gen = np.random.default_rng(SEED)
    rows = gen.integers(0, len(x), ROWS)
    images = (x[rows] / 16.0 + 0.1 * gen.standard_normal((ROWS, 64))).astype(np.float32).reshape(ROWS, 8, 8)
    return torch.from_numpy(images), torch.from_numpy(y[rows])


def build_model() -> torch.nn.Module:
    """The pipeline's own `cnn` architecture (3×3 convolutions, tanh, 2×2 max-pooling, a linear head), seeded."""
    from influence_core.pipeline.specs import ModelSpec

    torch.manual_seed(SEED)
    return ModelSpec(architecture="cnn", channels=CHANNELS).build(64, 10, (8, 8))


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """5 epochs of Adam (the pipeline's rate and weight decay): trained enough for timing, which does not depend on it."""
    torch.manual_seed(SEED)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)
    for _ in range(5):
        for lo in range(0, len(x), 64):
            opt.zero_grad()
            F.cross_entropy(model(x[lo : lo + 64]), y[lo : lo + 64]).backward()
            opt.step()
    model.eval()


class Lines(logging.Handler):
    """The times of the library's log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.times.append(time.monotonic())
        print(record.getMessage(), file=sys.stderr, flush=True)


def worker(state: str, rows: int, mode: str) -> None:
    """Fit Direct on the first `rows` rows of the saved problem; one JSON line on stdout."""
    from influence_core import DirectInfluence

    saved = torch.load(state)
    model = build_model()
    model.load_state_dict(saved["model"])
    lines = Lines()
    library = logging.getLogger("influence_core")
    library.setLevel(logging.INFO)
    library.addHandler(lines)
    im = DirectInfluence(model.eval(), "cross_entropy", LAM if mode == "gauss_newton" else HESSIAN_LAM, second_order_mode=mode)
    start, cpu = time.monotonic(), time.process_time()
    im.fit((saved["x"][:rows], saved["y"][:rows]))
    end = time.monotonic()
    marks = [start, *lines.times, end]
    print(json.dumps({
        "rows": rows, "mode": mode, "seconds": end - start, "cpu_seconds": time.process_time() - cpu, "work": im.work.as_dict(),
        "parameters": im.objective.space.dim, "progress_lines": len(lines.times), "longest_silence": max(b - a for a, b in zip(marks, marks[1:])),
    }))


def side(script: Path, code: Path, state: str, rows: int, mode: str) -> dict:
    """One worker process with `code` first on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    done = subprocess.run([sys.executable, str(script), "--worker", state, "--rows", str(rows), "--mode", mode], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{mode} over {rows} rows with {code} failed:\n{done.stderr}")
    for line in done.stderr.splitlines()[-3:]:
        print(f"    {line}", flush=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def old_code(ref: str, into: Path) -> Path:
    """The package at `ref`, extracted from git into `into`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "influence_core"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def report(results: dict, args: argparse.Namespace, gemm: float, loads: list[tuple[float, float, float]]) -> str:
    after, before, hessian = results["after"], results["before"], results.get("hessian")
    scale = ROWS / before["rows"]
    before_full = before["seconds"] * scale
    flops = after["work"]["curvature_flops"]
    rows = [
        f"| after (Gram route), all {ROWS:,} rows | {after['seconds']:.1f} | {after['cpu_seconds']:.1f} | {after['work']['gradient_rows']:,} gradient rows, {flops:.3g} GEMM flops "
        f"({flops / after['seconds'] / 1e9:.1f} GFLOP/s over the whole fit, {100 * flops / after['seconds'] / 1e9 / gemm:.0f}% of the GEMM rate) | {after['progress_lines']} lines, longest silence {after['longest_silence']:.0f} s |",
        f"| before (`{args.before_ref}`), first {before['rows']} rows | {before['seconds']:.1f} | {before['cpu_seconds']:.1f} | {before['work']['product_rows']:,} (vector, row) products | "
        f"{before['progress_lines']} lines, longest silence {before['longest_silence']:.0f} s |",
        f"| before, scaled to {ROWS:,} rows (× {scale:.1f}) | {before_full:.0f} | {before['cpu_seconds'] * scale:.0f} | {before['work']['product_rows'] * scale:,.0f} products | — |",
    ]
    if hessian is not None:
        per = hessian["seconds"] / hessian["work"]["product_rows"] * 1e6
        rows.append(
            f"| hessian mode (products with the identity, λ = {HESSIAN_LAM:g}), first {hessian['rows']} rows | {hessian['seconds']:.1f} | {hessian['cpu_seconds']:.1f} | "
            f"{hessian['work']['product_rows']:,} products, {per:.0f} µs each: {hessian['seconds'] * ROWS / hessian['rows']:.0f} s scaled to {ROWS:,} rows | "
            f"{hessian['progress_lines']} lines, longest silence {hessian['longest_silence']:.0f} s |"
        )

    load = ", ".join(f"{a:.1f}" for a, _, _ in loads)
    return "\n".join([
        "# Direct's explicit matrix (issue 52, item 19)",
        "",
        f"`benchmarks/direct_matrix.py`: `DirectInfluence.fit` (second_order_mode gauss_newton, λ = {LAM:g}, batch 256) on the pipeline's `cnn` "
        f"(channels {CHANNELS}, p = {after['parameters']:,}) over {ROWS:,} rows of 8×8 digits (drawn with replacement, noise 0.1), each side in its own process. "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; float32 GEMM rate {gemm:.1f} GFLOP/s (2,048², same run); "
        f"load average (1 min) at the start of each side: {load}.",
        "",
        "| side | wall s | CPU s | work | progress |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Speed-up of the fit: {before_full / after['seconds']:.0f}× in wall seconds, {before['cpu_seconds'] * scale / after['cpu_seconds']:.0f}× in CPU seconds "
        f"(the before side scaled linearly from its {before['rows']} rows). On a machine shared with other work the CPU seconds are the steadier measure.",
        "",
    ])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before-ref", default="3c23046", help="git ref of the code before (products with the identity)")
    p.add_argument("--before-rows", type=int, default=64)
    p.add_argument("--hessian-rows", type=int, default=256, help="rows of the hessian-mode side (one batch by default); 0 skips it")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.rows, args.mode)
        return
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    from gemm import gemm_rate

    x, y = problem()
    model = build_model()
    train(model, x, y)
    script = Path(__file__).resolve()
    gemm = gemm_rate(2048, torch.get_num_threads(), 3)
    print(f"float32 GEMM rate: {gemm:.1f} GFLOP/s", flush=True)
    loads, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        state = str(Path(tmp) / "problem.pt")
        torch.save({"model": model.state_dict(), "x": x, "y": y}, state)
        before_code = old_code(args.before_ref, Path(tmp))
        sides = [("after", ROOT, ROWS, "gauss_newton"), ("before", before_code, args.before_rows, "gauss_newton")]
        if args.hessian_rows:
            sides.append(("hessian", ROOT, args.hessian_rows, "hessian"))
        for name, code, rows, mode in sides:
            loads.append(os.getloadavg())
            print(f"{name}: {rows} rows, {mode}", flush=True)
            results[name] = side(script, code, state, rows, mode)
            print(f"  {results[name]['seconds']:.1f} s", flush=True)
    text = report(results, args, gemm, loads)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
