#!/usr/bin/env bash
# Create the isolated virtualenv for the pyDVL 0.10 baseline
# (benchmarks/.venvs/pydvl, git-ignored) and print its python path.
#
# pyDVL 0.10.0 pins numpy<2 and numcodecs<0.16, which clash with the project's
# own environment, hence a separate venv. torch is installed FIRST, as the CPU
# build, and then held fixed by a constraints file so that no dependency can
# swap in a CUDA build (benchmarks/peers/torch_venv.sh). Everything else is
# pinned in requirements.txt beside this script. Idempotent: a stamp file
# records the hash of the pins and the script is a no-op when it matches.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BENCH_DIR="$(dirname "$HERE")"
VENV="${PYDVL_VENV:-$BENCH_DIR/.venvs/pydvl}"
REQS="$HERE/requirements.txt"
# shellcheck source=../peers/torch_venv.sh
source "$BENCH_DIR/peers/torch_venv.sh"

if torch_venv_current "$VENV" "$(cat "$REQS")"; then
  echo "pydvl venv up to date ($VENV)" >&2
  echo "$VENV/bin/python"
  exit 0
fi

torch_venv_create "$VENV"

echo "installing pydvl[influence]==0.10.0 and pinned dependencies" >&2
"$PY" -m pip install --only-binary=:all: -c "$CONSTRAINTS" -r "$REQS" >&2

"$PY" -m pip check >&2
"$PY" -W ignore::FutureWarning - >&2 <<'PYEOF'
import numpy, torch, dask, distributed, zarr, numcodecs, pydvl
from pydvl.influence import DaskInfluenceCalculator  # noqa: F401
from pydvl.influence.torch import CgInfluence, DirectInfluence, LissaInfluence  # noqa: F401
assert numpy.__version__.startswith("1."), numpy.__version__
assert torch.__version__.endswith("+cpu"), torch.__version__
assert not torch.cuda.is_available() or torch.version.cuda is None
print("pydvl", pydvl.__version__, "torch", torch.__version__,
      "numpy", numpy.__version__, "dask", dask.__version__,
      "distributed", distributed.__version__, "zarr", zarr.__version__,
      "numcodecs", numcodecs.__version__)
PYEOF

torch_venv_stamp "$VENV" "$(cat "$REQS")"
echo "$VENV/bin/python"
