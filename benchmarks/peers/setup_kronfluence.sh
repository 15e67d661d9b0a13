#!/usr/bin/env bash
# Create the isolated virtualenv for Kronfluence 1.0.1 (benchmarks/.venvs/kronfluence, git-ignored) and print its
# python path.
#
# torch 2.13.0 (this machine's CPU build) is installed FIRST and held by a constraints file (torch_venv.sh).
# Kronfluence declares torchvision but never imports it, and PyPI's torchvision breaks beside the CPU torch, so
# kronfluence goes in with --no-deps and its real imports (accelerate einops einconv opt-einsum safetensors tqdm)
# from kronfluence-requirements.txt. Checked at the end: torchvision absent, `import kronfluence`, and a tiny
# EK-FAC fit + pairwise scores. Idempotent: a stamp file records the hash of the pins.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BENCH_DIR="$(dirname "$HERE")"
VENV="${KRONFLUENCE_VENV:-$BENCH_DIR/.venvs/kronfluence}"
REQS="$HERE/kronfluence-requirements.txt"
KRONFLUENCE="kronfluence==1.0.1"
# shellcheck source=torch_venv.sh
source "$HERE/torch_venv.sh"

if torch_venv_current "$VENV" "$KRONFLUENCE$(cat "$REQS")"; then
  echo "kronfluence venv up to date ($VENV)" >&2
  echo "$VENV/bin/python"
  exit 0
fi

torch_venv_create "$VENV"

echo "installing kronfluence's imports (pinned), then $KRONFLUENCE without its declared dependencies" >&2
"$PY" -m pip install --only-binary=:all: -c "$CONSTRAINTS" -r "$REQS" >&2
"$PY" -m pip install --no-deps "$KRONFLUENCE" >&2

if "$PY" -m pip show torchvision >/dev/null 2>&1; then
  echo "torchvision got installed; it must not be (it breaks beside the CPU torch)" >&2
  exit 1
fi
"$PY" - >&2 <<'PYEOF'
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import kronfluence
from kronfluence.analyzer import Analyzer, prepare_model
from kronfluence.arguments import FactorArguments, ScoreArguments
from kronfluence.task import Task

assert torch.__version__.endswith("+cpu"), torch.__version__


class Classification(Task):
    def compute_train_loss(self, batch, model, sample=False):
        x, y = batch
        logits = model(x)
        if sample:
            with torch.no_grad():
                y = torch.multinomial(torch.softmax(logits, -1), 1).flatten()
        return F.cross_entropy(logits, y, reduction="sum")

    def compute_measurement(self, batch, model):
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="sum")


torch.manual_seed(0)
x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))
data = TensorDataset(x, y)
model = prepare_model(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)), Classification())
with tempfile.TemporaryDirectory() as out:
    analyzer = Analyzer("check", model, Classification(), cpu=True, output_dir=out, disable_tqdm=True)
    analyzer.fit_all_factors("ekfac", data, per_device_batch_size=16, factor_args=FactorArguments(strategy="ekfac"))
    analyzer.compute_pairwise_scores("s", "ekfac", data, data, per_device_query_batch_size=16,
                                     per_device_train_batch_size=16, score_args=ScoreArguments(damping_factor=1e-3))
    scores = analyzer.load_pairwise_scores("s")["all_modules"]
assert scores.shape == (64, 64) and bool(torch.isfinite(scores).all()), scores.shape
print("kronfluence", kronfluence.__version__, "torch", torch.__version__, "tiny EK-FAC pairwise", tuple(scores.shape))
PYEOF

torch_venv_stamp "$VENV" "$KRONFLUENCE$(cat "$REQS")"
echo "$VENV/bin/python"
