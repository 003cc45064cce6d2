# shellcheck shell=bash
# Sourced by scripts/test-server.sh and bench/serve-throughput.sh: the Python environment with
# the official `openai` client, and starting/stopping the `server` example.

# The pinned client the tests talk to the server with.
OPENAI_VERSION=3.57.0

# server_venv [PACKAGE==VERSION ...]: a venv in the target folder ($SERVER_VENV, reused when it
# already has the packages) with openai==$OPENAI_VERSION and the extra packages; sets PY.
server_venv() {
    local target=${CARGO_TARGET_DIR:-target}
    SERVER_VENV=${SERVER_VENV:-$target/server-venv}
    PY=$SERVER_VENV/bin/python
    [[ -x $PY ]] || python3 -m venv "$SERVER_VENV"
    local want=("openai==$OPENAI_VERSION" "$@") missing
    missing=$(printf '%s\n' "${want[@]}" | grep -vxF -f <("$PY" -m pip freeze) || true)
    [[ -z $missing ]] || "$PY" -m pip install --quiet "${want[@]}"
}

# start_server LOG ARGS...: starts the release `server` example with ARGS (plus --port 0) in the
# background, logging to LOG; waits for its `listening on` line (model loading included) and
# sets SERVER_URL and SERVER_PID.
start_server() {
    local log=$1 target=${CARGO_TARGET_DIR:-target}
    shift
    "$target/release/examples/server" "$@" --port 0 >"$log" 2>&1 &
    SERVER_PID=$!
    local waited=0
    until SERVER_URL=$(grep -o 'http://[0-9.:]*' "$log" | head -1) && [[ -n $SERVER_URL ]]; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null || ((waited >= 600)); then
            echo "the server did not start:" >&2
            cat "$log" >&2
            return 1
        fi
        sleep 0.5
        waited=$((waited + 1))
    done
    echo "server $SERVER_PID at $SERVER_URL"
}

# stop_server: SIGTERM, then checks that the server exits by itself with status 0 within 20 s.
stop_server() {
    kill -TERM "$SERVER_PID"
    local waited=0
    while kill -0 "$SERVER_PID" 2>/dev/null; do
        if ((waited >= 40)); then
            echo "the server did not exit 20 s after SIGTERM" >&2
            kill -KILL "$SERVER_PID"
            return 1
        fi
        sleep 0.5
        waited=$((waited + 1))
    done
    local status=0
    wait "$SERVER_PID" || status=$?
    if ((status != 0)); then
        echo "the server exited with status $status after SIGTERM" >&2
        return 1
    fi
    echo "server $SERVER_PID stopped cleanly (exit 0)"
}
