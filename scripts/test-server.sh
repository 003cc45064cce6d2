#!/usr/bin/env bash
# The `server` example end to end with real clients: the official `openai` Python package
# (pinned, installed from PyPI into a venv under the target folder) against
# `server --synthetic tiny --cpu`: tests/server/test_openai.py (endpoints, streaming, stops,
# usage, errors, disconnects, a full queue), then tests/server/load_test.py (16 clients × 8
# greedy requests, each answer equal to its prompt's solo answer; latency and tok/s → $LOAD_JSON,
# by default under the target folder: `LOAD_JSON=bench/results/server-load-cpu.json` records the
# evidence file), then SIGTERM and a clean exit. Run by scripts/test.sh
# after the release build (with the same clippy wrapper, so nothing is rebuilt).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/server-lib.sh
source scripts/server-lib.sh
cargo build --release --example server
server_venv
log=${CARGO_TARGET_DIR:-target}/server-test.log
start_server "$log" --synthetic tiny --cpu --parallel 4
trap 'kill -KILL "$SERVER_PID" 2>/dev/null || true' EXIT
export QMOE_SERVER_BIN=${CARGO_TARGET_DIR:-target}/release/examples/server
"$PY" tests/server/test_openai.py "$SERVER_URL"
"$PY" tests/server/load_test.py "$SERVER_URL" \
    --json "${LOAD_JSON:-${CARGO_TARGET_DIR:-target}/server-load-cpu.json}" \
    --command "bash scripts/test-server.sh (server --synthetic tiny --cpu --parallel 4)"
stop_server
trap - EXIT
