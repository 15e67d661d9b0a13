#!/usr/bin/env bash
# `make serve`: a local Prefect server (SQLite, 127.0.0.1), the work pool, the deployments of prefect.yaml, and a
# process worker in the foreground. Ctrl-C stops the worker and the server.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-.venv/bin}"
PORT="${PREFECT_PORT:-4200}"
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}"
export PREFECT_API_URL="http://127.0.0.1:${PORT}/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export INFLUENCE_PIPELINE_HOME="$PWD"

"$BIN/prefect" server start --host 127.0.0.1 --port "$PORT" > "$PREFECT_HOME.server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -fsS "$PREFECT_API_URL/health" > /dev/null 2>&1 && break
  sleep 1
done
curl -fsS "$PREFECT_API_URL/health" > /dev/null || { echo "the Prefect server did not start; see $PREFECT_HOME.server.log" >&2; exit 1; }

"$BIN/prefect" work-pool inspect influence-pool > /dev/null 2>&1 || "$BIN/prefect" work-pool create influence-pool --type process
"$BIN/prefect" --no-prompt deploy --all
echo "UI: http://127.0.0.1:${PORT}  (deployments: influence-run/nightly, influence-run/on-demand)"
"$BIN/prefect" worker start --pool influence-pool --type process
