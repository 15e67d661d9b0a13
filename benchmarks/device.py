"""The text demo's GPT on a GPU machine: `compute.cluster: cuda` against `local` (the same machine's CPUs), each
stage's seconds and the scoring stage's share of the card's own float32 GEMM rate.

    python benchmarks/device.py --out DIR        (needs CUDA and the gpu extra; writes DIR/device.md and device.json)

Sides alternate (cuda, local, cuda, ...) and every run starts from an empty output URL, so no stage is cached.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("fit_model", "fit_preconditioner", "index_training", "compute_test_factors", "compute_influences")


def gpu_gemm_rate(n: int = 8192, repeats: int = 10) -> float:
    """Best float32 GFLOP/s of torch.mm on the GPU (TF32 off: the precision the stages run in)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / 1e9


def run_demo(cluster: str, url: Path, extra: list[str]) -> dict:
    """One whole text-demo run through the CLI; its summary's stages and the wall seconds."""
    sets = [f"compute.cluster={cluster}", f"output_url={url}", *extra]
    command = [sys.executable, "-m", "flows.cli", "run", "--config", str(ROOT / "configs/text-demo.yaml"), *(a for s in sets for a in ("--set", s))]
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    stages = json.loads((url / "summary.json").read_text())["stages"]
    return {"cluster": cluster, "wall": wall, "stages": {s: stages[s]["seconds"] for s in STAGES}, "score_flops": stages["compute_influences"]["work"]["score_flops"]}


def table(runs: list[dict], gemm: float) -> str:
    lines = ["| run | cluster | " + " | ".join(STAGES) + " | whole run (s) | scoring % of GEMM |", "|---" * (len(STAGES) + 4) + "|"]
    for i, r in enumerate(runs):
        share = f"{r['score_flops'] / r['stages']['compute_influences'] / 1e9 / gemm * 100:.2f}" if r["cluster"] == "cuda" else "—"
        cells = " | ".join(f"{r['stages'][s]:.2f}" for s in STAGES)
        lines.append(f"| {i + 1} | {r['cluster']} | {cells} | {r['wall']:.1f} | {share} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=1, help="alternating (cuda, local) pairs")
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra --set overrides for both sides")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    gemm = gpu_gemm_rate()
    device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    runs = [run_demo(side, a.out / f"run-{k}-{side}", a.sets) for k in range(a.rounds) for side in ("cuda", "local")]
    (a.out / "device.json").write_text(json.dumps({"device": device, "gemm_gflops": gemm, "runs": runs}, indent=1))
    text = f"Device: {device}; float32 GEMM (TF32 off) {gemm:,.0f} GFLOP/s.\n\n{table(runs, gemm)}\n"
    (a.out / "device.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
