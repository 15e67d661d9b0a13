#!/usr/bin/env bash
# `make serve`: a local Prefect server (SQLite, 127.0.0.1), the work pool, the deployments of prefect.yaml, and a
# process worker. Ctrl-C stops the worker and the server: the worker gets SIGINT and, as an idle prefect 3.8.8 worker
# can ignore it and keep polling, SIGKILL after 10 s.
set -euo pipefail
set -m  # the server and the worker in their own process groups: Ctrl-C reaches only this script, which stops them
cd "$(dirname "$0")/.."
BIN="${BIN:-.venv/bin}"
PORT="${PREFECT_PORT:-4200}"
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.prefect}"
export PREFECT_API_URL="http://127.0.0.1:${PORT}/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export INFLUENCE_PIPELINE_HOME="$PWD"
mkdir -p "$PREFECT_HOME"
LOG="$PREFECT_HOME/server.log"  # inside PREFECT_HOME (git-ignored .prefect/ by default), not beside it

"$BIN/prefect" server start --host 127.0.0.1 --port "$PORT" > "$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -fsS "$PREFECT_API_URL/health" > /dev/null 2>&1 && break
  sleep 1
done
curl -fsS "$PREFECT_API_URL/health" > /dev/null || { echo "the Prefect server did not start; see $LOG" >&2; exit 1; }

"$BIN/prefect" work-pool inspect influence-pool > /dev/null 2>&1 || "$BIN/prefect" work-pool create influence-pool --type process
"$BIN/prefect" --no-prompt deploy --all
"$BIN/python" -m flows.service  # the pool's concurrency limit; the failure webhook when INFLUENCE_FAILURE_WEBHOOK_URL is set
echo "UI: http://127.0.0.1:${PORT}  (deployments: influence-run/nightly, influence-run/on-demand, influence-question/question)"
echo "In another shell: export PREFECT_API_URL=${PREFECT_API_URL}, then ${BIN}/prefect deployment run influence-run/on-demand"
"$BIN/prefect" worker start --pool influence-pool --type process &
WORKER=$!
stop_worker() {
  kill -INT "$WORKER" 2>/dev/null || return 0
  for _ in $(seq 1 10); do kill -0 "$WORKER" 2>/dev/null || return 0; sleep 1; done
  echo "the worker did not stop on SIGINT in 10 s: killing it" >&2
  kill -KILL "$WORKER" 2>/dev/null || true
}
trap 'stop_worker; kill "$SERVER" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM
wait "$WORKER"
