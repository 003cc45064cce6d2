#!/usr/bin/env bash
# CPU calibration of the memory plan on a real checkpoint folder (the synthetic models of
# bench/calibrate-cpu.sh are built in memory; a folder's checkpoint and pack are memory-mapped,
# and only the pages a run touches count in its RSS). Per non-expert dtype (the default BF16,
# `--dense-weights int8`, `--dtype f32`): `plan` predicts the process RSS of a 128-token prompt
# and 64 generated tokens (ctx 192, prefill chunk 128), `bench` runs exactly that in its own
# process and reports its peak RSS (VmHWM); one JSON line per configuration goes to
# bench/results/calibration-cpu-folder.jsonl (prediction, measurement, inside or not, device,
# commit, commands, date), and the table is printed.
#
#   bash bench/calibrate-folder.sh MODEL_DIR [PACK]
#
# PACK: the folder's .qmoe pack (default: quantized into target/ on first use). About 3 minutes
# and 5 GiB of RAM for OLMoE-1B-7B on 2 cores; run with no other large process.
set -euo pipefail
cd "$(dirname "$0")/.."
model_dir=${1:?usage: bench/calibrate-folder.sh MODEL_DIR [PACK]}
pack=${2:-target/calibrate-folder/$(basename "$model_dir")-g128.qmoe}
out=${OUT:-bench/results/calibration-cpu-folder.jsonl}
work=target/calibrate-folder
mkdir -p "$work"
cargo build --release --example plan --example bench --example quantize
bin=./target/release/examples
if [[ ! -f $pack ]]; then
  "$bin/quantize" --model-dir "$model_dir" --out "$pack"
fi
rm -f "$out"
i=0
for variant in "" "--dense-weights int8" "--dtype f32"; do
  read -r -a extra <<<"$variant"
  plan_cmd=("$bin/plan" --model-dir "$model_dir" --device cpu --ctx 192 --prefill-chunk 128
    "${extra[@]}" --json "$work/plan-$i.json")
  bench_cmd=("$bin/bench" --model-dir "$model_dir" --cpu --pack "$pack" --prompts 1 --blocks 1
    -n 64 --warmup 0 --prompt-tokens 128 "${extra[@]}" --json "$work/bench-$i.json")
  "${plan_cmd[@]}" >/dev/null
  "${bench_cmd[@]}" >"$work/bench-$i.log" 2>&1 || { tail -20 "$work/bench-$i.log" >&2; exit 1; }
  python3 - "$work/plan-$i.json" "$work/bench-$i.json" "${variant:-default}" "${plan_cmd[*]}" \
    "${bench_cmd[*]}" >>"$out" <<'EOF'
import json, sys
plan, bench = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
run = bench["runs"][0]
rss = next(h for h in plan["host"] if h["name"] == "process_rss")
peak = run["peak_rss_bytes"]
print(json.dumps({
    "variant": sys.argv[3], "model_dir": bench["model_id"], "dense_weights": run["dense_weights"],
    "ctx": plan["ctx"], "prefill_chunk": plan["prefill_chunk"],
    "predicted_process_rss": {"min_bytes": rss["min_bytes"], "max_bytes": rss["max_bytes"]},
    "components": plan["components"], "peak_rss_bytes": peak,
    "inside": rss["min_bytes"] <= peak <= rss["max_bytes"],
    "device": bench["device"], "commit": bench["commit"], "date": bench["date"],
    "plan_command": sys.argv[4], "bench_command": sys.argv[5],
    "command": "bash bench/calibrate-folder.sh " + bench["model_id"],
}))
EOF
  i=$((i + 1))
done
python3 - "$out" <<'EOF'
import json, sys
gib = 2**30
print(f"{'variant':24} {'predicted process RSS':>24} {'peak RSS':>10}  inside")
for line in open(sys.argv[1]):
    r = json.loads(line)
    p = r["predicted_process_rss"]
    print(f"{r['variant']:24} {p['min_bytes']/gib:10.2f}–{p['max_bytes']/gib:.2f} GiB "
          f"{r['peak_rss_bytes']/gib:9.2f} GiB  {'yes' if r['inside'] else 'NO'}")
EOF
