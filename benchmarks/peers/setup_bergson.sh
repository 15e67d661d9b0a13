#!/usr/bin/env bash
# Create the isolated virtualenv for EleutherAI's bergson 2.5.1 (benchmarks/.venvs/bergson, git-ignored) and print
# its python path.
#
# torch 2.13.0 (this machine's CPU build) is installed FIRST and held by a constraints file (torch_venv.sh). bergson
# declares torchvision, torchaudio and bitsandbytes (and torch<2.10); the index serves CUDA builds of the first three,
# which break `import transformers`, and bergson never needs them on a CPU. So bergson goes in with --no-deps and its
# other requirements from bergson-requirements.txt. Checked at the end: those three absent, `import bergson`, and
# `bergson build` of a tiny random GPT-2 (a byte-level tokenizer saved beside it) on four rows. Idempotent: a stamp
# file records the hash of the pins.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BENCH_DIR="$(dirname "$HERE")"
VENV="${BERGSON_VENV:-$BENCH_DIR/.venvs/bergson}"
REQS="$HERE/bergson-requirements.txt"
BERGSON="bergson==2.5.1"
# shellcheck source=torch_venv.sh
source "$HERE/torch_venv.sh"

if torch_venv_current "$VENV" "$BERGSON$(cat "$REQS")"; then
  echo "bergson venv up to date ($VENV)" >&2
  echo "$VENV/bin/python"
  exit 0
fi

torch_venv_create "$VENV"

echo "installing bergson's requirements (pinned, without torchvision, torchaudio, bitsandbytes), then $BERGSON without its declared dependencies" >&2
"$PY" -m pip install --only-binary=:all: -c "$CONSTRAINTS" -r "$REQS" >&2
"$PY" -m pip install --no-deps "$BERGSON" >&2

for absent in torchvision torchaudio bitsandbytes; do
  if "$PY" -m pip show "$absent" >/dev/null 2>&1; then
    echo "$absent got installed; it must not be (the index's build breaks import transformers)" >&2
    exit 1
  fi
done
CHECK="$(mktemp -d)"
trap 'rm -rf "$CHECK"' EXIT
"$PY" - "$CHECK" >&2 <<'PYEOF'
import sys

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

import bergson

assert torch.__version__.endswith("+cpu"), torch.__version__
root = sys.argv[1]
vocab = {bytes([i]).decode("latin-1"): i for i in range(256)}
tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[])), model_max_length=64)
GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=256, n_positions=64)).save_pretrained(f"{root}/model")
tokenizer.save_pretrained(f"{root}/model")
Dataset.from_dict({"text": ["bergson on a CPU", "four rows", "of bytes", "checked"]}).save_to_disk(f"{root}/data")
print("bergson", bergson.__version__, "torch", torch.__version__)
PYEOF
OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 "$VENV/bin/bergson" build "$CHECK/index" --model "$CHECK/model" --dataset "$CHECK/data" --token_batch_size 64 >&2
"$PY" -c "import sys; from bergson.data import load_gradients; g = load_gradients(sys.argv[1]); assert g.shape[0] == 4, g.shape; print('tiny bergson build', g.shape)" "$CHECK/index" >&2

torch_venv_stamp "$VENV" "$BERGSON$(cat "$REQS")"
echo "$VENV/bin/python"
