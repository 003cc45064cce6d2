#!/usr/bin/env bash
# CPU calibration of the memory plan: runs the calibrate example once per configuration (one
# process each, so that every peak RSS covers one run) and writes a fresh
# bench/results/calibration-cpu.jsonl, then prints the table (predicted process RSS min–max,
# measured peak RSS, inside?). Synthetic tiny at several residencies and contexts; synthetic
# OLMoE-1B-7B without a cache and with 8 and 32 experts per layer at ctx 256 and 2048, and with
# a cache of all 64 (a second copy of the pack) at ctx 256: about 7 minutes and 9 GiB of RAM on
# 2 cores. Run on an otherwise idle machine, never alongside another synthetic OLMoE process.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/calibration-cpu.jsonl
cargo build --release --example calibrate
bin=./target/release/examples/calibrate
rm -f "$out"
run() {
  "$bin" --synthetic "$1" --resident "$2" --ctx "$3" --jsonl "$out" | tail -1
}
for resident in none 2 4 all; do
  for ctx in 64 1024 4000; do
    run tiny "$resident" "$ctx"
  done
done
for resident in none 8 32; do
  for ctx in 256 2048; do
    run olmoe "$resident" "$ctx"
  done
done
run olmoe all 256
echo
"$bin" --table "$out"
