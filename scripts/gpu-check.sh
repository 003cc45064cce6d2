#!/usr/bin/env bash
# GPU check of the CUDA kernels (docs/architecture.md §9): correctness against the dense F32 oracle,
# timings against Candle's fused-MoE kernels, the residency sweep; JSON results, a short table.
#
#   scripts/gpu-check.sh build         # HERE (no GPU needed): builds the cuda-feature binaries
#                                      # (examples/gpu_check, examples/residency_sweep,
#                                      # tests/cuda_kernels), strips and xz-compresses them
#                                      # into target/gpu-carry/
#                                      # with the commit id, checks they fit 64 MiB
#                                      # (small enough to copy to a GPU machine quickly).
#   scripts/gpu-check.sh run [--full]  # ON THE GPU MACHINE (no Rust, no network): unpacks under
#                                      # target/gpu-run, finds the CUDA 13 runtime libraries there,
#                                      # runs the tests, the check and the sweep, copies logs and
#                                      # JSON to $OUT.
#
# GPU time may be short, so the first call is a quick pass that leaves time for a second try:
# tests ≤ 100 s, `gpu_check --quick` ≤ 150 s, a quick residency sweep ≤ 90 s, end to end (`bench` on synthetic OLMoE at 16, 32 and all
# resident experts) ≤ 120 s: under 8 minutes at most; the first three took 66 s on an H200.
# After `scripts/gpu-check.sh build` here, with the repository and target/gpu-carry copied to the
# GPU machine, from the repository root there (give it 480 s):
#
#   bash scripts/gpu-check.sh run
#
# Then, only if time is left, the full pass (all cases and timings, both synthetic models: tests
# ≤ 100 s, check ≤ 200 s, sweep ≤ 120 s, end to end ≤ 150 s; give it 590 s):
#
#   bash scripts/gpu-check.sh run --full
#
# The limits can be changed with QMOE_TEST_TIMEOUT, QMOE_CHECK_TIMEOUT, QMOE_SWEEP_TIMEOUT,
# QMOE_BENCH_TIMEOUT.
# Extra arguments after `run [--full]` go to gpu_check. The JSON goes to $OUT/gpu_check.json,
# $OUT/residency_sweep.json and $OUT/bench-<model>.json (with a plot .svg), the logs to
# $OUT/logs.tar.gz (few files to copy back; $OUT defaults to target/gpu-out): copy them to
# bench/results/gpu-check-<date>-<commit12>[-quick].json, bench/results/residency-sweep-h200.json
# and bench/results/bench-<model>-h200.json and commit them.
#
# The libcuda stub of scripts/cuda-env.sh is never carried: the GPU machine's driver provides
# libcuda.so.1. libcudart/libcublas/libcublasLt/libcurand/libnvrtc (CUDA 13) are looked for in
# the usual toolkit and driver folders, then in the `nvidia` Python wheels there (PyTorch cu130:
# Python is asked where the `nvidia` package lives); if one is missing and a copy was carried in
# target/gpu-carry/libs (QMOE_CARRY_LIBS=1 at build time, small ones only), that copy is used.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=target/gpu-carry
LIMIT=$((64 * 1024 * 1024))
BINS=(gpu_check cuda_kernels residency_sweep bench)
LIBS=(libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13)

build() {
    # shellcheck source=scripts/cuda-env.sh
    source scripts/cuda-env.sh
    local msg
    msg=$(cargo build --release --features cuda --example gpu_check --example residency_sweep \
        --example bench --test cuda_kernels --message-format=json-render-diagnostics)
    rm -rf "$CARRY"
    mkdir -p "$CARRY"
    # Stripped and xz-compressed: the embedded PTX and cubins compress 2.3x better with xz than
    # with gzip (one binary: 12.3 MB gzipped, 5.5 MB as xz), and the working tree takes ~29 MB.
    local exe b
    for b in "${BINS[@]}"; do
        exe=$(jq -r --arg b "$b" 'select(.reason == "compiler-artifact" and .target.name == $b and .executable != null) | .executable' <<<"$msg" | tail -1)
        strip -o "$CARRY/$b" "$exe"
        xz -9 -T2 "$CARRY/$b"
    done
    {
        git rev-parse HEAD 2>/dev/null || echo unknown
    } | tr -d '\n' >"$CARRY/COMMIT"
    if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
        echo -n "-dirty" >>"$CARRY/COMMIT"
    fi
    if [ "${QMOE_CARRY_LIBS:-0}" = 1 ]; then
        mkdir -p "$CARRY/libs"
        cp -L "$CUDA_HOME/lib64/libcudart.so.13" "$CARRY/libs/"
    fi
    # What travels: the tracked and untracked-but-not-ignored files, plus the carry folder.
    local carry tree total
    carry=$(du -cb "$CARRY" | tail -1 | cut -f1)
    tree=$(git ls-files -co --exclude-standard -z | du --files0-from=- -cb 2>/dev/null | tail -1 | cut -f1)
    total=$((carry + tree))
    ls -l "$CARRY"
    echo "gpu-check: carry $carry + working tree $tree = $total bytes (limit $LIMIT), commit $(cat "$CARRY/COMMIT")"
    if [ "$total" -ge "$LIMIT" ]; then
        echo "gpu-check: carry folder plus working tree too large" >&2
        exit 1
    fi
}

# Prints the `lib` folders of the `nvidia` Python wheels (nvidia/cu13/lib, nvidia/*/lib), as the
# machine's Python finds the namespace package; nothing when there is none.
nvidia_wheel_libs() {
    local py
    for py in python3 python; do
        command -v "$py" >/dev/null 2>&1 || continue
        "$py" - <<'PY' 2>/dev/null && return 0
import glob
import os

import nvidia

for base in nvidia.__path__:
    for lib in sorted(glob.glob(os.path.join(base, "*", "lib"))):
        print(lib)
PY
    done
    return 0
}

# Prints the directory holding $1: the usual toolkit and driver folders, then the folders in
# WHEEL_LIBS (one per line), then the carried copies.
find_lib() {
    local name=$1 d
    local dirs=(${CUDA_HOME:+$CUDA_HOME/lib64} /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64
        /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu /usr/lib64
        /usr/local/nvidia/lib64)
    mapfile -t -O "${#dirs[@]}" dirs <<<"$WHEEL_LIBS"
    for d in "${dirs[@]}"; do
        # Never a stub, nor a forward-compatibility libcuda (it must match the kernel driver).
        case "$d" in *stubs* | *compat*) continue ;; esac
        if [ -n "$d" ] && [ -e "$d/$name" ]; then
            echo "$d"
            return 0
        fi
    done
    if [ -e "$CARRY/libs/$name" ]; then
        echo "$PWD/$CARRY/libs"
        return 0
    fi
    return 1
}

run() {
    local full=0
    if [ "${1:-}" = "--full" ]; then
        full=1
        shift
    fi
    OUT=${OUT:-$PWD/target/gpu-out}
    mkdir -p "$OUT"
    local work=target/gpu-run
    rm -rf "$work"
    mkdir -p "$work"
    for b in "${BINS[@]}"; do
        # xz if the machine has it, else Python's lzma module.
        xz -dc "$CARRY/$b.xz" >"$work/$b" 2>/dev/null ||
            python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
                "$CARRY/$b.xz" "$work/$b"
        chmod +x "$work/$b"
    done
    WHEEL_LIBS=$(nvidia_wheel_libs)
    local libpath="" lib dir
    local libs=("${LIBS[@]}")
    # The driver's libcuda.so.1 is normally in the loader cache; search for it only if not.
    # (grep reads all of ldconfig's output: `grep -q` in a pipe could end it early, and pipefail
    # would then report a miss.)
    if ! grep -q "libcuda.so.1 " <<<"$(ldconfig -p 2>/dev/null)"; then
        libs+=(libcuda.so.1)
    fi
    for lib in "${libs[@]}"; do
        if dir=$(find_lib "$lib"); then
            echo "gpu-check: $lib in $dir"
            case ":$libpath:" in *":$dir:"*) ;; *) libpath="$libpath${libpath:+:}$dir" ;; esac
        else
            echo "gpu-check: $lib not found" >&2
        fi
    done
    export LD_LIBRARY_PATH="$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export QMOE_COMMIT
    QMOE_COMMIT=$(cat "$CARRY/COMMIT" 2>/dev/null || echo unknown)
    {
        echo "commit $QMOE_COMMIT, pass $([ "$full" = 1 ] && echo full || echo quick)"
        echo "nvidia wheel lib folders: ${WHEEL_LIBS:-none}"
        echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
        nvidia-smi 2>&1 || true
        ldd "$work/gpu_check" 2>&1 || true
    } >"$OUT/env.txt"
    if ldd "$work/gpu_check" | grep -q "not found"; then
        ldd "$work/gpu_check" | grep "not found" >&2
        echo "gpu-check: missing libraries (see $OUT/env.txt)" >&2
    fi
    local t_tests t_check t_sweep t_bench suffix check_args sweep_args bench_models
    if [ "$full" = 1 ]; then
        t_tests=100 t_check=200 t_sweep=120 t_bench=150 suffix=""
        check_args=()
        sweep_args=(--trace-tokens 128 --models "olmoe,qwen2moe" --quick -n 16)
        bench_models=(olmoe qwen2moe)
    else
        t_tests=100 t_check=150 t_sweep=90 t_bench=120 suffix="-quick"
        check_args=(--quick)
        sweep_args=(--trace-tokens 64 --models olmoe --quick -n 8)
        bench_models=(olmoe)
    fi
    local rc_tests=0 rc_check=0 rc_sweep=0 rc_bench=0 m rc
    set +e
    echo "gpu-check: tests (cuda_kernels, ≤ ${QMOE_TEST_TIMEOUT:-$t_tests} s)"
    timeout -k 10 "${QMOE_TEST_TIMEOUT:-$t_tests}" "$work/cuda_kernels" --test-threads 1 >"$OUT/tests.log" 2>&1
    rc_tests=$?
    grep -E "^test result|FAILED|failed|panicked|SKIPPED" "$OUT/tests.log" | tail -20
    echo "gpu-check: check (gpu_check ${check_args[*]}, ≤ ${QMOE_CHECK_TIMEOUT:-$t_check} s)"
    timeout -k 10 "${QMOE_CHECK_TIMEOUT:-$t_check}" "$work/gpu_check" --json "$OUT/gpu_check.json" \
        --json "bench/results/gpu-check-$(date -u +%F)-${QMOE_COMMIT:0:12}$suffix.json" \
        --commit "$QMOE_COMMIT" ${check_args[@]+"${check_args[@]}"} "$@" \
        2>"$OUT/gpu_check.log" | tee "$OUT/gpu_check.txt"
    rc_check=${PIPESTATUS[0]}
    echo "gpu-check: residency sweep (residency_sweep, ≤ ${QMOE_SWEEP_TIMEOUT:-$t_sweep} s)"
    timeout -k 10 "${QMOE_SWEEP_TIMEOUT:-$t_sweep}" "$work/residency_sweep" --json "$OUT/residency_sweep.json" \
        "${sweep_args[@]}" 2>"$OUT/residency_sweep.log"
    rc_sweep=$?
    tail -n 25 "$OUT/residency_sweep.log"
    # End to end: the benchmark contract, shrunk, on the synthetic models at 16 and 32 resident
    # experts per layer and at full residency (decode tok/s, TTFT, peak device memory), with the
    # per-part tally of host time per token (`--profile`: decode is bound by the host there).
    echo "gpu-check: end to end (bench ${bench_models[*]}, ≤ ${QMOE_BENCH_TIMEOUT:-$t_bench} s in all)"
    local bench_end=$((SECONDS + ${QMOE_BENCH_TIMEOUT:-$t_bench}))
    for m in "${bench_models[@]}"; do
        timeout -k 10 $((bench_end - SECONDS > 1 ? bench_end - SECONDS : 1)) "$work/bench" \
            --synthetic "$m" --sweep 16,32,all --prompts 2 --blocks 2 -n 32 --warmup 16 --profile \
            --json "$OUT/bench-$m.json" >>"$OUT/bench.log" 2>&1
        rc=$?
        [ "$rc" -eq 0 ] || rc_bench=$rc
    done
    grep -vE "^\s*$" "$OUT/bench.log" | tail -n 12
    set -e
    # The logs travel as one archive: few files to copy back.
    local logs=(env.txt tests.log gpu_check.log gpu_check.txt residency_sweep.log bench.log)
    tar -czf "$OUT/logs.tar.gz" -C "$OUT" "${logs[@]}" && (cd "$OUT" && rm -f "${logs[@]}")
    echo "gpu-check: tests rc=$rc_tests, check rc=$rc_check, sweep rc=$rc_sweep, bench rc=$rc_bench (124 = timed out); logs in $OUT/logs.tar.gz"
    [ "$rc_tests" -eq 0 ] && [ "$rc_check" -eq 0 ] && [ "$rc_sweep" -eq 0 ] && [ "$rc_bench" -eq 0 ]
}

case "${1:-}" in
    build) build ;;
    run)
        shift
        run "$@"
        ;;
    *)
        echo "usage: $0 build | run [--full] [gpu_check args]" >&2
        exit 2
        ;;
esac
