#!/usr/bin/env bash
# Runs layer_bench at both model shapes, decode (T=1) and prefill (T=128), each sample a burst of
# 16 consecutive calls as in a decode step, appending one JSON
# line per run to bench/results/layer-bench-cpu.jsonl. Run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/layer-bench-cpu.jsonl
cargo build --release --example layer_bench
for shape in olmoe qwen; do
  for t in 1 128; do
    ./target/release/examples/layer_bench --shape "$shape" --tokens "$t" --json "$out" | tail -1
  done
done
# Single decode calls after an idle pause (the wake-up of an idle core included in each call).
./target/release/examples/layer_bench --shape olmoe --tokens 1 --burst 1 --json "$out" | tail -1
# The kernels' compute rate: experts that stay in cache, one thread, long bursts (one cold call
# in 64 after the other backends have run).
RAYON_NUM_THREADS=1 ./target/release/examples/layer_bench --shape cached --tokens 1 --burst 64 \
  --json "$out" | tail -1
