#!/usr/bin/env bash
# Memory plans of the 30B-class models (docs/architecture.md §5) from their published
# config.json (examples/configs/): Qwen3-30B-A3B and Mixtral-8x7B-Instruct-v0.1 on a CUDA target,
# BF16 non-expert weights, INT4 g128 experts, batch 1, at budgets of 6, 8, 12, 16 and 24 GiB and
# contexts of 4096 and 32768 tokens → bench/results/plan/plan-<model>-cuda-<budget>-ctx<ctx>.json
# (the per-layer expert capacities chosen, or the refusal: the component that does not fit and
# the bytes missing). A refused plan is tried again with --allow-ctx-reduction
# (…-reduce.json: the longest context that fits, if any). Predictions only, no weights needed:
# a few seconds. Prints the README table at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/plan
mkdir -p "$out"
cargo build --release --example plan
bin=${CARGO_TARGET_DIR:-target}/release/examples/plan
for model in qwen3-30b-a3b mixtral-8x7b-instruct-v0.1; do
  for budget in 6GiB 8GiB 12GiB 16GiB 24GiB; do
    for ctx in 4096 32768; do
      json=$out/plan-$model-cuda-$budget-ctx$ctx.json
      args=(--config "examples/configs/$model.json" --vram-budget "$budget" --ctx "$ctx")
      if ! "$bin" "${args[@]}" --json "$json" >/dev/null 2>&1; then
        "$bin" "${args[@]}" --allow-ctx-reduction --json "${json%.json}-reduce.json" \
          >/dev/null 2>&1 || true
      fi
    done
  done
done
python3 - "$out" <<'PY'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])

def size(b):
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"

def caps(d):
    res = d["resident_per_layer"]
    lo, hi = min(res), max(res)
    experts = 128 if d["model_type"] == "qwen3_moe" else 8
    text = f"{lo} of {experts}" if lo == hi else f"{lo}–{hi} of {experts}"
    return text + (" (all)" if lo == experts else "")

def total(d):
    return f"{size(d['total_min_bytes'])}–{size(d['total_max_bytes'])}"

def refused(d):
    r = d["refused"]
    return f"refused: `{r['component']}` needs {size(r['needed_bytes'])}, {size(r['missing_bytes'])} missing"

print("| model | budget | ctx | resident experts per layer | predicted total (min–max) | with `--allow-ctx-reduction` |")
print("|---|---|---|---|---|---|")
for model, name in [("qwen3-30b-a3b", "Qwen3-30B-A3B"), ("mixtral-8x7b-instruct-v0.1", "Mixtral-8x7B-Instruct-v0.1")]:
    for budget in [6, 8, 12, 16, 24]:
        for ctx in [4096, 32768]:
            base = out / f"plan-{model}-cuda-{budget}GiB-ctx{ctx}.json"
            d = json.loads(base.read_text())
            reduce = base.with_name(base.stem + "-reduce.json")
            if "refused" not in d:
                cells = [caps(d), total(d), "—"]
            else:
                r = json.loads(reduce.read_text())
                if "refused" in r:
                    after = "refused: no context fits"
                else:
                    after = f"ctx {r['ctx']}: {caps(r)}, {total(r)}"
                cells = [refused(d), "—", after]
            print(f"| {name} | {budget} GiB | {ctx} | " + " | ".join(cells) + " |")
PY
