#!/usr/bin/env bash
# Serving throughput on the CPU: `server --synthetic ${KIND:-olmoe} --cpu --parallel 8`, then
# bench/serve_throughput.py at 1, 2, 4 and 8 concurrent greedy requests: aggregate decode tok/s
# and routed-expert bytes read per generated token (from /metrics) →
# bench/results/serve-throughput-cpu.json and .svg. Needs an idle machine for meaningful
# numbers. Knobs: KIND (tiny for a smoke run), LEVELS (1,2,4,8), REQUESTS per client (2),
# MAX_TOKENS (64), OUT (bench/results/serve-throughput-cpu), SERVER_ARGS (extra flags).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/server-lib.sh
source scripts/server-lib.sh
KIND=${KIND:-olmoe}
LEVELS=${LEVELS:-1,2,4,8}
OUT=${OUT:-bench/results/serve-throughput-cpu}
slots=$(tr ',' '\n' <<<"$LEVELS" | sort -n | tail -1)
cargo build --release --example server --example mem_bandwidth
bandwidth=$("${CARGO_TARGET_DIR:-target}/release/examples/mem_bandwidth" | tail -1)
server_venv matplotlib==3.11.2
log=${CARGO_TARGET_DIR:-target}/serve-throughput.log
# shellcheck disable=SC2086 # SERVER_ARGS is a list of flags
start_server "$log" --synthetic "$KIND" --cpu --parallel "$slots" ${SERVER_ARGS:-}
trap 'kill -KILL "$SERVER_PID" 2>/dev/null || true' EXIT
"$PY" bench/serve_throughput.py "$SERVER_URL" --levels "$LEVELS" --requests "${REQUESTS:-2}" \
    --max-tokens "${MAX_TOKENS:-64}" --out "$OUT" --bandwidth "$bandwidth" \
    --command "KIND=$KIND LEVELS=$LEVELS bash bench/serve-throughput.sh (server --synthetic $KIND --cpu --parallel $slots ${SERVER_ARGS:-})"
stop_server
trap - EXIT
