#!/usr/bin/env bash
# Fidelity of every port against its transformers golden: `parity` on each tests/fixtures/*-tiny
# checkpoint with every experts backend (f32, bf16, int4) and compute dtype (f32, bf16), six runs each,
# gathered into one JSON file naming the device, the commit and the command of each run.
#
#   bash bench/parity-fixtures.sh [OUT]    (default bench/results/parity-fixtures-<commit>.json)
#
# Exit status 1 when any run's verdict fails (the file is written all the same).
set -euo pipefail
cd "$(dirname "$0")/.."

commit=$(git rev-parse --short=12 HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then commit="$commit-dirty"; fi
out=${1:-bench/results/parity-fixtures-$commit.json}

cargo build --release --example parity
bin=${CARGO_TARGET_DIR:-target}/release/examples/parity
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT

failed=0
for dir in tests/fixtures/*-tiny; do
    fixture=$(basename "$dir")
    for experts in f32 bf16 int4; do
        for dtype in f32 bf16; do
            json="$runs/$fixture-$experts-$dtype.json"
            cmd="$bin --model-dir $dir --golden $dir/golden.safetensors --experts $experts --dtype $dtype --json $json"
            echo "$cmd" >"$json.cmd"
            if ! $cmd >"$json.log" 2>&1; then
                failed=1
                echo "FAILED: $cmd" >&2
                cat "$json.log" >&2
            fi
        done
    done
done

python3 - "$runs" "$out" "$commit" <<'EOF'
import json, os, platform, subprocess, sys, datetime
runs, out, commit = sys.argv[1:]
def cpu():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()
results = []
for name in sorted(os.listdir(runs)):
    if not name.endswith(".json"):
        continue
    path = os.path.join(runs, name)
    run = json.load(open(path))
    run["command"] = open(path + ".cmd").read().strip().replace(path, "RUN.json")
    results.append(run)
doc = {
    "schema": "parity-fixtures/1",
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": commit,
    "device": f"{cpu()}, {os.cpu_count()} CPUs",
    "command": "bash bench/parity-fixtures.sh",
    "runs": results,
    "all_pass": all(r["pass"] for r in results),
}
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
json.dump(doc, open(out, "w"), indent=1)
print(f"{len(results)} runs, all pass: {doc['all_pass']} -> {out}")
EOF
exit $failed
