# Sourced by the peers' venv scripts (benchmarks/pydvl/setup_env.sh, benchmarks/peers/setup_kronfluence.sh):
# one way to build an isolated venv that holds this machine's CPU torch 2.13.0, installed FIRST and then kept
# fixed by a constraints file, so no dependency can swap in another (e.g. CUDA) build. Idempotent by stamp file.
#
#   source torch_venv.sh
#   torch_venv_current "$VENV" "$STAMP_TEXT" && { echo "$VENV/bin/python"; exit 0; }
#   torch_venv_create "$VENV"            # venv + torch first; sets PY and CONSTRAINTS
#   "$PY" -m pip install -c "$CONSTRAINTS" ...
#   torch_venv_stamp "$VENV" "$STAMP_TEXT"

TORCH_SPEC="torch==2.13.0+cpu"
# torch's own dependencies, pinned to the versions verified with it.
TORCH_DEPS=(
  "filelock==4.2.11" "fsspec==2026.9.0" "Jinja2==3.1.6" "MarkupSafe==3.0.4"
  "mpmath==1.3.0" "networkx==3.6.1" "sympy==1.14.0" "typing_extensions==4.16.0"
  "setuptools==84.2.1"
)

# The stamp of a venv: a hash of the torch pins and of whatever else the caller passes (its requirements).
torch_venv_hash() {
  { echo "$TORCH_SPEC"; printf '%s\n' "${TORCH_DEPS[@]}"; printf '%s' "$1"; } | sha256sum | cut -d' ' -f1
}

# True when the venv exists and was completed with these exact pins.
torch_venv_current() {
  local venv="$1" want
  want="$(torch_venv_hash "$2")"
  [[ -x "$venv/bin/python" && -f "$venv/.setup-stamp" && "$(cat "$venv/.setup-stamp")" == "$want" ]]
}

# Create the venv (python3.11) if needed, forget its stamp, install torch first and write the constraint.
torch_venv_create() {
  local venv="$1"
  PY="$venv/bin/python"
  if [[ ! -x "$PY" ]]; then
    echo "creating venv $venv" >&2
    mkdir -p "$(dirname "$venv")"
    python3.11 -m venv "$venv"
  fi
  rm -f "$venv/.setup-stamp"
  "$PY" -m pip install --upgrade pip >&2
  CONSTRAINTS="$venv/torch-constraint.txt"
  echo "$TORCH_SPEC" >"$CONSTRAINTS"
  echo "installing $TORCH_SPEC first" >&2
  "$PY" -m pip install --only-binary=:all: -c "$CONSTRAINTS" "$TORCH_SPEC" "${TORCH_DEPS[@]}" >&2
}

# Mark the venv complete (call last, after the caller's checks passed).
torch_venv_stamp() {
  torch_venv_hash "$2" >"$1/.setup-stamp"
}
