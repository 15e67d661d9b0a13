#!/usr/bin/env bash
# gpu_check.sh: exercise `compute.cluster: cuda` on a lent GPU machine and record the numbers, in one call.
#
# What it does, in order (each step's output goes to a file in OUTDIR; at most 8 files, flat, so a device tool
# that returns OUTDIR brings them all back):
#   1. env.txt      nvidia-smi, Python/torch/CUDA, and the versions of the preinstalled packages the project uses
#   2. install.log  installs the carried wheels (benchmarks/gpu_check.wheels.txt, from $WHL, default .whl) with
#                   --no-index --no-deps --target $SITE (default /tmp/site), puts $SITE and the repo on PYTHONPATH
#                   (the project itself is never pip-installed), then `pip check` and an import smoke test
#   3. tests.log, junit.xml
#                   the tests that skip without CUDA: tests/integration/test_device.py (cluster=cuda scores equal a
#                   local CPU cluster's, MLP EK-FAC / MLP CG / CNN EK-FAC), plus test_engine's
#                   test_cuda_cluster_without_gpu_is_a_clear_error, which assumes no GPU is visible
#   4. bench.log, device.md, device.json
#                   benchmarks/device.py: the text demo's GPT with cluster=cuda vs local, and the card's float32
#                   GEMM rate (its run folders, Zarr stores of many files, stay in $BENCH_DIR)
# Usage, from the repository root on the GPU machine (needs Python 3.12 with torch+CUDA preinstalled):
#   bash benchmarks/gpu_check.sh [OUTDIR]        OUTDIR defaults to $OUT, else ./gpu-check-out
# Knobs (environment): SOURCE_COMMIT (names the tree tested when it has no .git), WHL, SITE, TEST_TIMEOUT (s, default 300), BENCH_TIMEOUT (s, default 240), ROUNDS (1).
# Never changes the card's settings. Exit status: pytest's, or the benchmark's if the tests passed.
set -u
OUTDIR=${1:-${OUT:-gpu-check-out}}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
WHL=${WHL:-.whl}
SITE=${SITE:-/tmp/site}
BENCH_DIR=${BENCH_DIR:-/tmp/gpu-check-bench}
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
t0=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }

stamp "1. environment" | tee "$OUTDIR/env.txt"
{
  echo "source: ${SOURCE_COMMIT:-$(git log -1 --format='%H %s' 2>/dev/null || echo 'unknown (set SOURCE_COMMIT)')}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1
  nproc; free -g | head -2
  $PY -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
  $PY -m pip list 2>/dev/null | grep -iE '^(numpy|scipy|scikit-learn|matplotlib|pandas|pytest|pytest-timeout|psutil|safetensors|cuda-core|cuda-bindings|cuda-pathfinder|nvidia-ml-py|pynvml|click|rich|typer|pyyaml|fsspec|pydantic|bokeh) '
} >>"$OUTDIR/env.txt" 2>&1

stamp "2. install wheels from $WHL into $SITE" | tee "$OUTDIR/install.log"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl >>"$OUTDIR/install.log" 2>&1 \
  || { stamp "wheel install failed" | tee -a "$OUTDIR/install.log"; exit 3; }
export PYTHONPATH="$SITE:$PWD"
{
  stamp "installed $(ls "$WHL"/*.whl | wc -l) wheels"
  echo "--- pip check (informational: preinstalled packages outside the carried set may be listed)"
  $PY -m pip check 2>&1 | head -40
  echo "--- import smoke test"
  $PY -c '
import importlib.metadata as md
import dask, distributed, dask_cuda, prefect, zarr, numcodecs, pydantic, numpy, torch
from dask_cuda import LocalCUDACluster
import flows.cli, influence_core
for name in ("dask", "distributed", "dask-cuda", "rapids-dask-dependency", "prefect", "zarr", "numcodecs", "pydantic", "fsspec", "numpy", "cuda-core", "nvidia-ml-py"):
    print(name, md.version(name))
'
} >>"$OUTDIR/install.log" 2>&1
tail -14 "$OUTDIR/install.log"

stamp "3. CUDA tests"
timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -v -rA -p no:cacheprovider --timeout 240 --junitxml "$OUTDIR/junit.xml" \
  tests/integration/test_device.py \
  "tests/integration/test_engine.py::test_cuda_cluster_without_gpu_is_a_clear_error" >"$OUTDIR/tests.log" 2>&1
tests_rc=$?
grep -E '(PASSED|FAILED|SKIPPED|ERROR)( |$)|^(FAILED|ERROR|SKIPPED) |passed|failed' "$OUTDIR/tests.log" | tail -20
stamp "tests exit $tests_rc"

stamp "4. benchmarks/device.py (cuda vs local, GEMM rate)"
rm -rf "$BENCH_DIR"
timeout "${BENCH_TIMEOUT:-240}" $PY benchmarks/device.py --out "$BENCH_DIR" --rounds "${ROUNDS:-1}" >"$OUTDIR/bench.log" 2>&1
bench_rc=$?
cp "$BENCH_DIR"/device.md "$BENCH_DIR"/device.json "$OUTDIR"/ 2>/dev/null
tail -8 "$OUTDIR/bench.log"
stamp "benchmark exit $bench_rc"
[ "$tests_rc" -ne 0 ] && exit "$tests_rc"
exit "$bench_rc"
