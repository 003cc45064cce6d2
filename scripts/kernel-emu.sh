#!/usr/bin/env bash
# Runs the CUDA kernel source on the CPU under the host emulator (candle-qmoe-kernels/emu): the
# real w4a16_moe.cu, compiled by g++ with QMOE_EMU, on small random problems of both paths and
# all activation types, against a float64 reference computed from the slab bytes. cp.async
# copies land only at their cp.async.wait_group, so pipeline-accounting mistakes show too.
#   scripts/kernel-emu.sh [--quick]   the cases (all, or one activation type)
#   scripts/kernel-emu.sh --sanitize  a few small cases reaching every kernel and path, built
#       with ThreadSanitizer (shared-memory races: a missing __syncthreads/__syncwarp is reported
#       as a data race between two CUDA threads) and with AddressSanitizer + UBSan (reads or
#       writes outside the global buffers or the exactly-sized dynamic shared memory).
# Proves indexing, arithmetic and intra-block synchronisation without a GPU; cross-block
# ordering and speed still need the GPU check.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh # CUDA headers (cuda_fp16.h, cuda_bf16.h) only
mkdir -p target/kernel-emu
build() { # build OUTPUT FLAGS...
    local out=$1
    shift
    g++ -std=c++20 -pthread -Wall -Wno-unknown-pragmas -Wno-class-memaccess -Wno-tsan "$@" \
        -I"$CUDA_HOME/include" candle-qmoe-kernels/emu/main.cpp -o "$out"
}
if [[ "${1:-}" == "--sanitize" ]]; then
    # g++ compiles on one core: build both at once.
    build target/kernel-emu/emu-tsan -O1 -g -fsanitize=thread &
    tsan=$!
    build target/kernel-emu/emu-asan -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all &
    asan=$!
    rc=0
    wait "$tsan" || rc=$?
    wait "$asan" || rc=$?
    [ "$rc" -eq 0 ] || exit "$rc"
    echo "kernel-emu: ThreadSanitizer"
    TSAN_OPTIONS="halt_on_error=1 exitcode=66" target/kernel-emu/emu-tsan --race
    echo "kernel-emu: AddressSanitizer + UndefinedBehaviorSanitizer"
    ASAN_OPTIONS="detect_leaks=0" target/kernel-emu/emu-asan --race
    exit 0
fi
build target/kernel-emu/emu -O2
target/kernel-emu/emu "$@"
