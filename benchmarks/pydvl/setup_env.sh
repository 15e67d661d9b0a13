#!/usr/bin/env bash
# Create the isolated virtualenv for the pyDVL 0.10 baseline
# (benchmarks/.venvs/pydvl, git-ignored) and print its python path.
#
# pyDVL 0.10.0 pins numpy<2 and numcodecs<0.16, which clash with the project's
# own environment, hence a separate venv. torch is installed FIRST, as the CPU
# build, and then held fixed by a constraints file so that no dependency can
# swap in a CUDA build. Everything else is pinned in requirements.txt beside
# this script. Idempotent: a stamp file records the hash of the pins and the
# script is a no-op when it matches.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BENCH_DIR="$(dirname "$HERE")"
VENV="${PYDVL_VENV:-$BENCH_DIR/.venvs/pydvl}"
PY="$VENV/bin/python"
STAMP="$VENV/.pydvl-setup-stamp"
REQS="$HERE/requirements.txt"

TORCH_SPEC="torch==2.13.0+cpu"
# torch's own dependencies, pinned to the versions verified with it.
TORCH_DEPS=(
  "filelock==4.2.11" "fsspec==2026.9.0" "Jinja2==3.1.6" "MarkupSafe==3.0.4"
  "mpmath==1.3.0" "networkx==3.6.1" "sympy==1.14.0" "typing_extensions==4.16.0"
  "setuptools==84.2.1"
)

want_stamp="$(
  { echo "$TORCH_SPEC"; printf '%s\n' "${TORCH_DEPS[@]}"; cat "$REQS"; } \
    | sha256sum | cut -d' ' -f1
)"

if [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" ]]; then
  echo "pydvl venv up to date ($VENV)" >&2
  echo "$PY"
  exit 0
fi

if [[ ! -x "$PY" ]]; then
  echo "creating venv $VENV" >&2
  mkdir -p "$(dirname "$VENV")"
  python3.11 -m venv "$VENV"
fi
rm -f "$STAMP"

"$PY" -m pip install --upgrade pip >&2

# Keep torch pinned to the CPU build for every later install step, so no
# dependency can resolve to another (e.g. CUDA) torch build.
CONSTRAINTS="$VENV/pydvl-torch-constraint.txt"
echo "$TORCH_SPEC" >"$CONSTRAINTS"

echo "installing $TORCH_SPEC first" >&2
"$PY" -m pip install --only-binary=:all: -c "$CONSTRAINTS" \
  "$TORCH_SPEC" "${TORCH_DEPS[@]}" >&2

echo "installing pydvl[influence]==0.10.0 and pinned dependencies" >&2
"$PY" -m pip install --only-binary=:all: -c "$CONSTRAINTS" -r "$REQS" >&2

"$PY" -m pip check >&2
"$PY" -W ignore::FutureWarning - >&2 <<'EOF'
import numpy, torch, dask, distributed, zarr, numcodecs, pydvl
from pydvl.influence import DaskInfluenceCalculator  # noqa: F401
from pydvl.influence.torch import DirectInfluence  # noqa: F401
assert numpy.__version__.startswith("1."), numpy.__version__
assert torch.__version__.endswith("+cpu"), torch.__version__
assert not torch.cuda.is_available() or torch.version.cuda is None
print("pydvl", pydvl.__version__, "torch", torch.__version__,
      "numpy", numpy.__version__, "dask", dask.__version__,
      "distributed", distributed.__version__, "zarr", zarr.__version__,
      "numcodecs", numcodecs.__version__)
EOF

echo "$want_stamp" >"$STAMP"
echo "$PY"
